"""The float islands of a ``full`` placement: tensors left float on purpose, each by a named rule.

The structure (which tensors) is ``inspect.read.islands``, shared with the ``fully_quantized`` rule; this module
holds the reasons, measured on the real models, and the rule that needs calibrated ranges
(``split_range_output_concat``), applied to a plan once the observers have run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from quantship.quantize_onnx.calibrate import TensorObserver

if TYPE_CHECKING:
    from quantship.quantize_onnx.place import Plan

CONCAT_TIE_RATIO = 8.0  # a Concat ties its inputs' scales unless their ranges differ more than this

# Tensors a ``full`` placement leaves float on purpose: one int8 scale cannot hold them, and the fully
# integer targets run them in float (``inspect.read.islands``; TiGrIS 0.12.1 compiles a float tail, TensorRT runs
# a normalisation's arithmetic in float). Measured on the real models (per-tensor SQNR of the full-placement
# file against the float file, ONNX Runtime with every intermediate exposed).
ISLAND_RULES: dict[str, str] = {
    "normalisation_statistics": "the per-row mean/variance of a written-out normalisation stays float: "
                                "E[x^2] - E[x]^2 cancels and the variance spans orders of magnitude across "
                                "rows (magika LayerNorm_0: inputs 31 dB, variance 7.6 dB, its reciprocal "
                                "square root diverges; 66/2000 files against FP32's 1849)",
    "polynomial_interior": "the inside of an activation written out as a polynomial under a saturating op "
                           "(GELU's x + 0.044715 x^3 before its Tanh) stays float: x^3 spans the cube of x's "
                           "range, one int8 scale rounds it and x to 0 (magika's second GELU: x^3 +-1e6, "
                           "its Tanh at 0.1 dB SQNR)",
    "split_range_output_concat": f"a Concat writing a graph output from inputs whose ranges differ more than "
                                 f"{CONCAT_TIE_RATIO:g}x moves each input's dequantized values (exact) instead "
                                 f"of one shared scale (nudenet's head: boxes 0..320 and scores 0..1 in one "
                                 f"int8 scale round every score to 0; 0/118 FP32 detections)",
}


def range_ratio(members: Iterable[str], observers: dict[str, TensorObserver], symmetric: bool) -> float | None:
    """The largest calibrated magnitude over the smallest, among ``members`` (None: nothing observed)."""
    ranges = [observers[m].clipping_range(symmetric) for m in members if m in observers and observers[m].low != np.inf]
    widths = [max(abs(lo), abs(hi)) for lo, hi in ranges]
    if not widths:
        return None
    return max(widths) / min(widths) if min(widths) > 0 else float("inf")


def release_split_range_outputs(p: Plan, observers: dict[str, TensorObserver], symmetric: bool) -> list[str]:
    """``split_range_output_concat``: a graph-output Concat whose inputs' ranges differ more than
    CONCAT_TIE_RATIO loses its output pair (the plan changes: known only once calibrated), unless its scale
    was shared on request (``Plan.forced_ties``)."""
    released = []
    forced = set().union(*p.forced_ties.values())
    for out, ins in p.output_concats.items():
        ratio = range_ratio(ins, observers, symmetric)
        if out in p.tensors and out not in forced and ratio is not None and ratio > CONCAT_TIE_RATIO:
            p.tensors.remove(out)
            p.islands[out] = "split_range_output_concat"
            released.append(out)
    return released
