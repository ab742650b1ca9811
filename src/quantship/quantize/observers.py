"""Activation observers that clip outliers: ``act_observer='percentile'`` and ``'mse'``.

Both keep torchao's running histogram of everything seen during calibration (``HistogramObserver``
combines batches whose ranges differ) and only change how a range is chosen from it:

- ``PercentileObserver``: the range ends at a percentile of what was seen: 99.99th of ``|x|``
  (symmetric), or the [0.01, 99.99] percentiles (affine). A handful of outliers stop setting
  the scale of every other value.
- ``MSEObserver``: the clipping range whose expected quantization error over the histogram is
  smallest (rounding noise inside the range, clipping error outside it), found by a grid search.

Each works for symmetric and affine int8 per-tensor activations and, like every observer, is a
plain module (picklable, deep-copyable). ``OBSERVERS`` maps the spec name to the class.
"""

from __future__ import annotations

import torch
from torchao.quantization.pt2e import HistogramObserver


def _bins(obs: HistogramObserver) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left edges, right edges and counts of the observer's histogram (float64)."""
    hist = obs.histogram.detach().double()
    lo, hi = float(obs.min_val), float(obs.max_val)
    edges = torch.linspace(lo, hi, hist.numel() + 1, dtype=torch.float64)
    return edges[:-1], edges[1:], hist


def _has_spread(obs: HistogramObserver) -> bool:
    """True when a histogram was recorded over a non-empty range."""
    lo, hi = float(obs.min_val), float(obs.max_val)
    return lo != float("inf") and hi > lo and float(obs.histogram.sum()) > 0


def _quantile(left: torch.Tensor, right: torch.Tensor, counts: torch.Tensor, q: float) -> float:
    """The value below which a fraction ``q`` of the histogram's mass lies (linear within a bin)."""
    cdf = torch.cumsum(counts, 0)
    target = q * float(cdf[-1])
    i = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype)).item())
    i = min(i, counts.numel() - 1)
    below = float(cdf[i - 1]) if i > 0 else 0.0
    inside = float(counts[i])
    frac = 0.0 if inside == 0 else (target - below) / inside
    return float(left[i] + frac * (right[i] - left[i]))


class PercentileObserver(HistogramObserver):
    """Clips the range at a percentile of all calibration values (99.99 by default).

    Symmetric: the ``percentile`` of ``|x|`` sets ``max |x|``. Affine: the range is
    [``100 - percentile``, ``percentile``] percentiles of ``x``. Never wider than min/max.
    """

    def __init__(self, *args, percentile: float = 99.99, **kwargs) -> None:
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile={percentile!r} must lie in (50, 100], e.g. 99.99")
        super().__init__(*args, **kwargs)
        self.percentile = float(percentile)

    def clipping_range(self) -> tuple[float, float]:
        """The (min, max) handed to the scale/zero-point formula."""
        lo, hi = float(self.min_val), float(self.max_val)
        if not _has_spread(self):
            return lo, hi
        left, right, counts = _bins(self)
        q = self.percentile / 100.0
        if self.qscheme == torch.per_tensor_symmetric:
            # the histogram of |x|: fold each bin onto its absolute range
            a_left = torch.where(left >= 0, left, torch.where(right <= 0, -right, torch.zeros_like(left)))
            a_right = torch.maximum(left.abs(), right.abs())
            order = torch.argsort(a_right)
            t = _quantile(a_left[order], a_right[order], counts[order], q)
            return max(lo, -t), min(hi, t)
        return max(lo, _quantile(left, right, counts, 1.0 - q)), min(hi, _quantile(left, right, counts, q))

    @torch.jit.export
    def calculate_qparams(self):
        if float(self.min_val) == float("inf"):
            return super().calculate_qparams()  # nothing seen: torchao's default and warning
        lo, hi = self.clipping_range()
        return self._calculate_qparams(torch.tensor(lo), torch.tensor(hi))

    def extra_repr(self) -> str:
        return f"percentile={self.percentile}, {super().extra_repr()}"


class MSEObserver(HistogramObserver):
    """Chooses the clipping range that minimises the expected quantization MSE over the histogram.

    For a candidate range the error of a bin inside it is the rounding noise ``scale**2 / 12``;
    a bin outside it costs its squared distance to the range end. Candidates shrink the observed
    range in ``n_candidates`` steps down to ``min_fraction`` of it (both ends independently when
    affine).
    """

    def __init__(self, *args, n_candidates: int = 200, min_fraction: float = 0.01, **kwargs) -> None:
        if n_candidates < 2:
            raise ValueError(f"n_candidates={n_candidates!r} must be at least 2")
        if not 0.0 < min_fraction < 1.0:
            raise ValueError(f"min_fraction={min_fraction!r} must lie in (0, 1), e.g. 0.01")
        super().__init__(*args, **kwargs)
        self.n_candidates = int(n_candidates)
        self.min_fraction = float(min_fraction)

    def _errors(self, lows: torch.Tensor, highs: torch.Tensor) -> torch.Tensor:
        """Expected total squared error for each (low, high) candidate pair (vectors of length K).

        Prefix sums of count, value and value**2 over the bins give each candidate's clipping
        error in O(log bins), so a fine grid stays cheap.
        """
        left, right, counts = _bins(self)
        centres = (left + right) / 2
        zero = torch.zeros(1, dtype=torch.float64)
        n_cum = torch.cat([zero, torch.cumsum(counts, 0)])
        s1_cum = torch.cat([zero, torch.cumsum(counts * centres, 0)])
        s2_cum = torch.cat([zero, torch.cumsum(counts * centres**2, 0)])
        i = torch.searchsorted(centres, lows)  # bins strictly below the low end
        j = torch.searchsorted(centres, highs, right=True)  # bins up to the high end
        below = lows**2 * n_cum[i] - 2 * lows * s1_cum[i] + s2_cum[i]
        above = (s2_cum[-1] - s2_cum[j]) - 2 * highs * (s1_cum[-1] - s1_cum[j]) + highs**2 * (n_cum[-1] - n_cum[j])
        n_levels = float(self.quant_max - self.quant_min)
        if self.qscheme == torch.per_tensor_symmetric:
            scale = torch.maximum(-lows, highs) * 2 / n_levels
        else:
            scale = (highs - lows) / n_levels
        return below + above + (n_cum[j] - n_cum[i]) * scale**2 / 12

    def clipping_range(self) -> tuple[float, float]:
        """The (min, max) handed to the scale/zero-point formula."""
        lo, hi = float(self.min_val), float(self.max_val)
        if not _has_spread(self):
            return lo, hi
        lo_neg, hi_pos = min(lo, 0.0), max(hi, 0.0)
        fractions = torch.linspace(self.min_fraction, 1.0, self.n_candidates, dtype=torch.float64)
        if self.qscheme == torch.per_tensor_symmetric:
            t = fractions * max(-lo_neg, hi_pos)
            lows, highs = torch.where(torch.tensor(lo_neg < 0), -t, torch.zeros_like(t)), t
        else:
            grid_lo, grid_hi = torch.meshgrid(fractions * lo_neg, fractions * hi_pos, indexing="ij")
            lows, highs = grid_lo.reshape(-1), grid_hi.reshape(-1)
        best = int(torch.argmin(self._errors(lows, highs)))
        return max(lo, float(lows[best])), min(hi, float(highs[best]))

    @torch.jit.export
    def calculate_qparams(self):
        if float(self.min_val) == float("inf"):
            return super().calculate_qparams()
        lo, hi = self.clipping_range()
        return self._calculate_qparams(torch.tensor(lo), torch.tensor(hi))

    def extra_repr(self) -> str:
        return f"n_candidates={self.n_candidates}, {super().extra_repr()}"


OBSERVERS = {"percentile": PercentileObserver, "mse": MSEObserver}


def rebin_histogram(counts: torch.Tensor, old_lo: float, old_hi: float, lo: float, hi: float) -> torch.Tensor:
    """A histogram recorded on ``[old_lo, old_hi]`` re-binned onto ``[lo, hi]`` (same bin count, float64).

    Each bin's count is spread evenly over its width and split between the new bins it overlaps:
    the cumulative count is linear inside a bin, so it is read at the new edges and differenced.
    ``[lo, hi]`` must contain the old range. An empty histogram (or an observer that saw nothing,
    ``old_lo = inf``) gives zeros; a single value (``old_lo == old_hi``) lands in the bin holding it.
    This is how histograms recorded on different ranks are brought onto one range before being added.
    """
    bins = counts.numel()
    counts = counts.detach().double()
    if old_lo == float("inf") or float(counts.sum()) == 0:
        return torch.zeros(bins, dtype=torch.float64)
    if (old_lo, old_hi) == (lo, hi):
        return counts.clone()
    if not lo <= old_lo <= old_hi <= hi:
        raise ValueError(f"re-binning onto [{lo}, {hi}] would drop values of the range [{old_lo}, {old_hi}]")
    if old_hi == old_lo or hi == lo:
        out = torch.zeros(bins, dtype=torch.float64)
        out[0 if hi == lo else min(int((old_lo - lo) / (hi - lo) * bins), bins - 1)] = counts.sum()
        return out
    old_edges = torch.linspace(old_lo, old_hi, bins + 1, dtype=torch.float64)
    cumulative = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(counts, 0)])
    new_edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64).clamp(old_lo, old_hi)
    # the piecewise-linear cumulative count read at each new edge
    i = torch.searchsorted(old_edges, new_edges, right=True).clamp(1, bins)
    left, right = old_edges[i - 1], old_edges[i]
    frac = ((new_edges - left) / (right - left)).clamp(0.0, 1.0)
    at_edges = cumulative[i - 1] + frac * (cumulative[i] - cumulative[i - 1])
    return torch.diff(at_edges)
