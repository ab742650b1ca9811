"""torchao's histogram observer with the same range search, without its 100,000-step Python loop.

``HistogramObserver.calculate_qparams`` (torchao 0.18) narrows the recorded range with a search over
quantiles in steps of 1e-5: up to 100,001 iterations, each indexing tensors element by element from
Python, to compute a quantization error at the few steps where a range end moves. One observer
costs about a second on these CPUs; a model holds hundreds (mobileone_s0 spent 349 s in it).

``HistogramSearchObserver`` runs the same search and returns the same tensors, bit for bit:

- the quantile bounds are the same float64 sequences torchao builds by repeated addition of the
  step (``numpy.add.accumulate`` adds in order, as the loop does), compared in float32 with the same
  cumulative counts, as torch compares a float32 tensor with a Python float;
- each bound's bin comes from a binary search on those counts (they never decrease) instead of a
  walk from the previous bin;
- the runs of steps where neither range end moves (most of the 100,001) are skipped to their end
  at once: in such a run only the upper bound moves, so the first step that moves the upper end is
  found by one vectorised comparison;
- the quantization error at each step that moves an end is torchao's own ``_compute_quantization_error``.

One exception, on purpose: a range whose ends are both under ``TINY`` (2^-20) in magnitude, or one of
whose ends is above ``HUGE`` (2^20), is searched scaled by a power of two that brings it near 1, and the
result scaled back. Every step of the error is a product, quotient or sum of values scaled by that power
(the error by its square), so the search is bit for bit torchao's wherever torchao's float32 arithmetic
neither underflows nor overflows. Where it underflows (values around 1e-20 and below, which an untrained
model's branches produce: Hugging Face MobileViT), torchao's error is 0 at every step; where it
overflows (the cube of a distance above ~7e12 is inf in float32: an untrained timm mobileone_s0's
activations reach 1e14, its BatchNorms at their initial statistics and its branches summed), the error
is inf or nan (inf - inf) at every step. Either way ``norm > norm_min`` never holds, the search never stops early and
narrows the range bin by bin to a single bin: about 1,000-1,300 error evaluations and 0.7-2.5 s per
observer (582 s of MobileViT's convert; a constant quantized output for mobileone_s0, every activation
clamped to one bin). Scaled, the search stops where the error grows, as it does for a range near 1.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torchao.quantization.pt2e import HistogramObserver

from quantship.progress import step

_STEP = 1e-5  # torchao's quantile granularity
_MAX_STEPS = 100_002  # alpha and beta meet after 1 / _STEP moves, one of them per step
TINY = 2.0 ** -20  # a range inside +-TINY is searched scaled by a power of two (see above)
HUGE = 2.0 ** 20  # so is a range with an end beyond +-HUGE


def _bounds() -> tuple[np.ndarray, np.ndarray]:
    """The lower (from 0) and upper (from 1) quantile bounds after k steps, as the loop computes them."""
    lower = np.add.accumulate(np.concatenate([[0.0], np.full(_MAX_STEPS, _STEP)]))
    upper = np.add.accumulate(np.concatenate([[1.0], np.full(_MAX_STEPS, -_STEP)]))
    return lower, upper


_LOWER, _UPPER = _bounds()
_FALLING = -_UPPER


def search_range(obs: HistogramObserver) -> tuple[torch.Tensor, torch.Tensor]:
    """``obs._non_linear_param_search()``'s (new_min, new_max), computed without its per-step loop."""
    if obs.histogram.size()[0] != obs.bins:
        raise ValueError(f"the histogram holds {obs.histogram.size()[0]} bins, the observer {obs.bins}")
    low, high = obs.min_val.clone(), obs.max_val.clone()
    magnitude = max(abs(float(low)), abs(float(high)))
    if 0.0 < magnitude < TINY or HUGE < magnitude < math.inf:
        factor = 2.0 ** -math.frexp(magnitude)[1]  # magnitude * factor in [0.5, 1): exact, a power of two
        obs.min_val.copy_(low.double() * factor)  # in float64: the factor can pass float32's largest
        obs.max_val.copy_(high.double() * factor)
    try:
        start, end = _search_bins(obs)
    finally:
        obs.min_val.copy_(low)
        obs.max_val.copy_(high)
    bin_width = (high - low) / obs.bins
    return low + bin_width * start, low + bin_width * (end + 1)


def _search_bins(obs: HistogramObserver) -> tuple[int, int]:
    """The first and last histogram bin the search keeps."""
    total = torch.sum(obs.histogram).item()
    cumulative = torch.cumsum(obs.histogram, dim=0).cpu().numpy()
    lower_at = (_LOWER * total).astype(cumulative.dtype)  # torch compares in the histogram's dtype
    upper_at = (_UPPER * total).astype(cumulative.dtype)
    falling_at = -upper_at
    i_lower = i_upper = 0  # steps taken by each bound
    start, end = 0, obs.bins - 1
    norm_min = float("inf")
    while _LOWER[i_lower] < _UPPER[i_upper]:
        low_threshold, high_threshold = lower_at[i_lower + 1], upper_at[i_upper + 1]
        left = min(max(int(np.searchsorted(cumulative, low_threshold, side="left")), start), end)
        right = min(max(int(np.searchsorted(cumulative, high_threshold, side="right")) - 1, start), end)
        if left - start > end - right:
            next_start, next_end = left, end
            i_lower += 1
        else:
            next_start, next_end = start, right
            i_upper += 1
        if next_start == start and next_end == end:
            # neither end moved (left == start, right == end): only the upper bound moves until the first
            # step whose threshold falls below the last bin's count, or until the bounds meet
            if start == end:
                break
            # both sequences decrease: negated, they are sorted for a binary search
            moves = int(np.searchsorted(falling_at, -cumulative[end], side="right"))  # upper_at < last count
            meets = int(np.searchsorted(_FALLING, -_LOWER[i_lower], side="left"))  # _UPPER <= lower bound
            if moves >= len(falling_at) or meets <= moves - 1:
                break  # the bounds meet first (or at the same step): the loop ends with the range as it is
            i_upper = moves - 1
            continue
        norm = obs._compute_quantization_error(next_start, next_end)
        if norm > norm_min:
            break
        norm_min = norm
        start, end = next_start, next_end
    return start, end


class HistogramSearchObserver(HistogramObserver):
    """torchao's ``HistogramObserver``, its range search run by ``search_range`` (same scales, bit for bit)."""

    def _non_linear_param_search(self) -> tuple[torch.Tensor, torch.Tensor]:
        with step("quantize: histogram range search"):  # inside convert; seconds to minutes on a large model
            return search_range(self)
