"""The float islands: tensors left float on purpose, each by a named rule (a ``full`` placement's; a
detector's post-processing in every placement).

The structure (which tensors) is ``inspect.read.islands``, shared with the ``fully_quantized`` rule; this module
holds the reasons, measured on the real models, and the rule that needs calibrated ranges
(``split_range_output_concat``), applied to a plan once the observers have run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from quantship.inspect.read.islands import Op
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
    "detection_postprocess": "a detector's post-processing (what feeds NonMaxSuppression / TopK back to the "
                             "head's Conv outputs, and what is computed from it: anchors, box decoding, scores, "
                             "top-k, NMS) stays float in every placement: decoded boxes span the image (0..320 "
                             "px) while the deltas they decode are O(1), and the top-k ranks scores a few 1e-4 "
                             "apart (untrained RetinaNet: 0.04550, 0.04539), which one int8 scale would reorder; "
                             "ONNX Runtime has no integer kernel for these ops",
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


def op_record(node: ir.Node) -> Op:
    """The island rules' record of ``node``: with the outer tensors its subgraphs read, and their op types."""
    inputs = [v.name if v is not None else "" for v in node.inputs]  # as the node lists them (x * x: twice)
    outer: list[str] = []
    nested: set[str] = set()
    for attr in node.attributes.values():
        bodies = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
            list(attr.value) if attr.type == ir.AttributeType.GRAPHS else [])
        for body in bodies:
            inner = {v.name for v in body.inputs} | set(body.initializers)
            for sub in ir.traversal.RecursiveGraphIterator(body):
                nested.add(sub.op_type)
                inner.update(o.name for o in sub.outputs if o.name)
            for sub in ir.traversal.RecursiveGraphIterator(body):
                outer.extend(v.name for v in sub.inputs if v is not None and v.name and v.name not in inner)
    extra = tuple(dict.fromkeys(v for v in outer if v not in inputs))
    return Op(node.op_type, (*inputs, *extra), tuple(o.name or "" for o in node.outputs), frozenset(nested))
