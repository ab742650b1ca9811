"""Bias correction's format-neutral part (Nagel et al. 2019, section 4.2): the record, the per-channel
means read batch by batch, the corrected bias and the layer depths. The front-ends' passes
(``quantize.bias_correction`` for pt2e, ``quantize_onnx.bias_correction`` for ONNX) run the models and
call these on numpy arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SAMPLES = 64  # calibration samples the shift is measured on (the leading batches)


@dataclass
class BiasCorrection:
    """What bias correction did: layers corrected, biases added, layers skipped (with why), passes."""

    n_corrected: int = 0
    n_added: int = 0  # layers that had no bias and got one
    skipped: dict[str, str] = field(default_factory=dict)
    n_passes: int = 0  # quantized-model passes (one per depth)
    samples: int = 0
    max_shift: float = 0.0  # largest |mean_quantized - mean_float| corrected
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"n_corrected": self.n_corrected, "n_added": self.n_added, "skipped": dict(self.skipped),
                "n_passes": self.n_passes, "samples": self.samples, "max_shift": self.max_shift,
                "seconds": round(self.seconds, 3)}


class ChannelMeans:
    """Mean per channel of each of ``n`` tensors, read batch by batch (float64 sums, nothing else kept)."""

    def __init__(self, n: int):
        self.sums: list[np.ndarray | None] = [None] * n
        self.counts = [0] * n

    def add(self, k: int, value: np.ndarray, axis: int) -> None:
        moved = np.moveaxis(value.astype(np.float64), axis, 0).reshape(value.shape[axis], -1)
        total = moved.sum(axis=1)
        self.sums[k] = total if self.sums[k] is None else self.sums[k] + total
        self.counts[k] += moved.shape[1]

    def means(self) -> list[np.ndarray]:
        return [s / max(c, 1) for s, c in zip(self.sums, self.counts)]


def corrected_bias(stored: np.ndarray, mean_quantized: np.ndarray, mean_float: np.ndarray,
                   report: BiasCorrection, divisor: float = 1.0) -> np.ndarray:
    """``stored`` minus the shift of the output mean (over ``divisor``: Gemm's beta), as float32."""
    shift = mean_quantized - mean_float
    report.max_shift = max(report.max_shift, float(np.abs(shift).max()))
    return (stored - (shift / divisor).reshape(stored.shape)).astype(np.float32)


def layer_depths(nodes: Iterable[Any], inputs_of: Callable[[Any], Iterable[Any]],
                 outputs_of: Callable[[Any], Iterable[Any]], is_layer: Callable[[Any], bool]) -> dict[int, int]:
    """{id(layer node): the longest chain of layers above it (0: none)}, over ``nodes`` in graph order."""
    depth_of: dict[int, int] = {}  # id(value) -> layers on the longest path to it
    depths = {}
    for node in nodes:
        above = max((depth_of.get(id(v), 0) for v in inputs_of(node) if v is not None), default=0)
        layer = is_layer(node)
        if layer:
            depths[id(node)] = above
        for o in outputs_of(node):
            depth_of[id(o)] = above + layer
    return depths
