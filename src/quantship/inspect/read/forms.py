"""The form of the operators whose kernels some runtimes have only in one form: Clip's bounds, a
reduction's input rank and axes (TiGrIS 0.12.1, measured with ``tigris analyze``: Clip runs as ReLU
(min 0, no max) or ReLU6 (0, 6) only; ReduceSum/Mean/Max need a rank-3 input and one constant axis,
or a rank-4 input over its two spatial axes, a global pool; ``tigris compile``: a Slice of a rank-5 input
fails, "StridedSlice supports rank at most 4" (an attention's q, k, v split in the PP-OCRv4 recognizer))."""

from __future__ import annotations

import numpy as np
import onnx

from quantship.inspect.read.view import GraphView, node_label
from quantship.targets import tigris

REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd"})
MAX_SLICE_RANK = tigris.TARGET.max_slice_rank  # the fact is the target's (its passes rewrite such a slice)


def _bound(view: GraphView, node: onnx.NodeProto, index: int, attribute: str) -> float | None | str:
    """Clip's min (index 1) or max (2): a number, None when absent, "computed" when not a constant."""
    for a in node.attribute:  # opset < 11 keeps the bounds as attributes
        if a.name == attribute:
            return float(a.f)
    if len(node.input) <= index or not node.input[index]:
        return None
    value = view.value(node.input[index])
    return "computed" if value is None or value.size != 1 else float(value.reshape(()))


def _axes(view: GraphView, node: onnx.NodeProto) -> list[int] | None:
    for a in node.attribute:
        if a.name == "axes":
            return list(a.ints)
    if len(node.input) > 1 and node.input[1]:
        value = view.value(node.input[1])
        return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]
    return []  # no axes: every axis


def operator_forms(view: GraphView) -> list[tuple[str, str]]:
    """(node label, its form) of every Clip that is not ReLU or ReLU6, every reduction that is neither over
    one constant axis of a rank-3 input nor a global pool, every Slice of an input above rank 4: what TiGrIS
    has no kernel for."""
    found = []
    for index, node in enumerate(view.nodes):
        if node.op_type == "Clip":
            low, high = _bound(view, node, 1, "min"), _bound(view, node, 2, "max")
            relu = low == 0.0 and (high is None or high == float("inf") or high == 6.0)
            if not relu:
                show = [("-inf" if low is None else f"{low:g}") if not isinstance(low, str) else low,
                        ("inf" if high is None else f"{high:g}") if not isinstance(high, str) else high]
                found.append((node_label(node, index), f"Clip {show[0]}..{show[1]}"))
        elif node.op_type == "Slice" and node.input:
            shape = view.shape.get(node.input[0])
            if shape is not None and len(shape) > MAX_SLICE_RANK:
                found.append((node_label(node, index), f"Slice of a rank-{len(shape)} input"))
        elif node.op_type in REDUCTIONS and node.input:
            shape = view.shape.get(node.input[0])
            axes = _axes(view, node)
            if shape is None:
                continue  # unknown rank: nothing to say
            spatial = len(shape) == 4 and axes is not None and sorted(a % 4 for a in axes) == [2, 3]
            if not spatial and (len(shape) != 3 or axes is None or len(axes) != 1):
                what = "computed axes" if axes is None else f"axes {axes or 'all'}"
                found.append((node_label(node, index), f"{node.op_type} of a rank-{len(shape)} input, {what}"))
    return found
