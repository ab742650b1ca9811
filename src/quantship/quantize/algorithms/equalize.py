"""Cross-layer equalization's format-neutral part (Nagel et al. 2019, section 4.1): the sweep's limits,
the channel arithmetic on numpy arrays and the record. The front-ends find the pairs and apply the scales:
``quantize.equalize`` (pt2e, on ``nn.Module`` copies), ``quantize_onnx.equalize`` (an onnx-ir pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TOLERANCE = 1e-3  # stop when every scale of a sweep is within this of 1
MAX_SWEEPS = 50
MAX_BETWEEN = 3  # homogeneous ops crossed between two convs (MTCNN: PReLU then MaxPool)
MIN_RANGE = 1e-8  # a channel whose weights are (almost) all zero on one side is left alone

def input_channel_ranges(w2: np.ndarray, group: int) -> np.ndarray:
    """Largest absolute weight that reads each input channel of a (grouped) conv."""
    out_per_group, in_per_group = w2.shape[0] // group, w2.shape[1]
    per_output = np.abs(w2).reshape(w2.shape[0], in_per_group, -1).max(axis=2)  # [out, in_per_group]
    return per_output.reshape(group, out_per_group, in_per_group).max(axis=1).reshape(-1)


def scale_input_channels(w2: np.ndarray, group: int, s: np.ndarray) -> np.ndarray:
    """``w2`` with input channel ``c`` multiplied by ``s[c]`` (float32)."""
    out_per_group, in_per_group = w2.shape[0] // group, w2.shape[1]
    factors = s.reshape(group, 1, in_per_group)  # channel c = g * in_per_group + j
    shaped = w2.reshape(group, out_per_group, in_per_group, -1) * factors[..., None]
    return shaped.reshape(w2.shape).astype(np.float32)


def equalizing_scales(r1: np.ndarray, r2: np.ndarray) -> np.ndarray:
    """``s`` per channel so that ``r1 / s`` and ``r2 * s`` meet at ``sqrt(r1 * r2)`` (1 where a side is ~0)."""
    usable = (r1 > MIN_RANGE) & (r2 > MIN_RANGE)
    s = np.ones_like(r1, dtype=np.float64)
    s[usable] = np.sqrt(r1[usable] * r2[usable]) / r2[usable]
    return s


@dataclass
class Equalization:
    """What equalization did: pairs found, pairs whose scales moved, convs skipped (why), float check."""

    pairs: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    pairs_changed: int = 0
    sweeps: int = 0
    max_abs_diff: float = 0.0  # largest |equalized - original| float output on the first calibration batch
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"pairs_changed": self.pairs_changed, "pairs": dict(self.pairs), "skipped": dict(self.skipped),
                "sweeps": self.sweeps, "max_abs_diff": self.max_abs_diff, "seconds": round(self.seconds, 3)}
