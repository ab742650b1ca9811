"""SmoothQuant's format-neutral part (Xiao et al. 2022): alpha's check, the scale rule on numpy arrays
and the record. The front-ends find the groups (a producer and the layers reading it) and apply ``s``:
``quantize.smooth_quant`` (pt2e, ``nn.Module`` copies), ``quantize_onnx.smooth_quant`` (an onnx-ir pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from quantship.errors import SpecRefused

DEFAULT_ALPHA = 0.5
MIN_RANGE = 1e-8  # a channel whose activation is (almost) all zero keeps s = 1

def check_alpha(alpha: object) -> float:
    """``alpha`` as a float in [0, 1], or a one-line refusal that says what to give."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise SpecRefused(f"smooth_quant={alpha!r}: give the migration strength alpha, a number in [0, 1] "
                          f"(the paper's default {DEFAULT_ALPHA}), or None for no smoothing")
    return float(alpha)


@dataclass
class Smoothing:
    """What SmoothQuant did: layers smoothed (with the range of their ``s``), layers skipped (why)."""

    alpha: float
    smoothed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"alpha": self.alpha, "layers_smoothed": len(self.smoothed), "layers_skipped": len(self.skipped),
                "smoothed": dict(self.smoothed), "skipped": dict(self.skipped), "seconds": round(self.seconds, 3)}


def smoothing_scales(x_range: np.ndarray, w_range: np.ndarray, alpha: float) -> np.ndarray:
    """``s_j = max|X_j| ^ alpha / max|W[:, j]| ^ (1 - alpha)`` per input channel (float64; 1 where either side
    is ~0). A channel no layer reads (all-zero weights) makes the formula infinite while any ``s`` is exact
    there: it gets the median smoothed activation range instead."""
    x_range, w_range = np.asarray(x_range, np.float64), np.asarray(w_range, np.float64)
    s = np.ones_like(x_range)
    usable = (x_range > MIN_RANGE) & (w_range > MIN_RANGE)
    s[usable] = x_range[usable] ** alpha / w_range[usable] ** (1.0 - alpha)
    unread = (x_range > MIN_RANGE) & (w_range <= MIN_RANGE)
    if unread.any() and usable.any():
        s[unread] = x_range[unread] / np.median(x_range[usable] / s[usable])
    return s
