"""Quantization parameters and declarations no runtime can honour, named node by node.

A scale must be a finite, positive, normal float; a zero-point must have the stored integer type
and lie in its range; ``axis`` must name a dimension of the quantized tensor and the per-channel
scales must match it; a declared input dimension must not be 0 (negative ones are dynamic, as
ONNX Runtime reads them). Runtimes differ in what they do with
such a file (some reject it, some run it and return NaN or garbage), so every target refuses it.
Also lists the operators outside the default ONNX domain, for the per-target domain rule.
"""

from __future__ import annotations

import numpy as np
import onnx

from quantship.inspect.read.view import DEQUANTIZE, QUANTIZE, GraphView, dtype_name, node_label

DEFAULT_DOMAINS = ("", "ai.onnx")
_SCALE_TYPES = ("float32", "float16", "bfloat16", "float64")


def _attr(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def _bad_scale(values: np.ndarray) -> str | None:
    """Why a scale array is unusable (None when every element is a finite, positive, normal float)."""
    if values.size == 0:
        return "is empty"
    if values.dtype.kind != "f":
        return f"is {values.dtype}, not a float"
    flat = values.astype(np.float64).reshape(-1)
    tiny = float(np.finfo(values.dtype).tiny)
    for why, bad in (("not finite", ~np.isfinite(flat)), ("not positive", np.isfinite(flat) & (flat <= 0)),
                     (f"denormal (below {tiny:.3g})", np.isfinite(flat) & (flat > 0) & (flat < tiny))):
        if bad.any():
            index = int(np.argmax(bad))
            where = f"[{index}]" if flat.size > 1 else ""
            return f"{where} = {float(flat[index])!r}: {why}"
    return None


def _stored_type(view: GraphView, node: onnx.NodeProto, zero_point: np.ndarray | None) -> str:
    """The integer type the node stores (DQ: its input; Q: output_dtype, else the zero-point, else uint8)."""
    if node.op_type == DEQUANTIZE:
        return dtype_name(view.elem_type.get(node.input[0], 0))
    declared = _attr(node, "output_dtype")
    if declared is not None and declared.i:
        return dtype_name(declared.i)
    return str(zero_point.dtype) if zero_point is not None else "uint8"


def _zero_point_problem(zero_point: np.ndarray, stored: str, scale: np.ndarray | None) -> str | None:
    if stored != "undefined" and str(zero_point.dtype) != stored:
        return f"is {zero_point.dtype} but the node stores {stored}; they must be the same type"
    if scale is not None and zero_point.shape != scale.shape and zero_point.size != scale.size:
        return f"has {zero_point.size} element(s) for {scale.size} scale(s)"
    if zero_point.dtype.kind in "iu" and stored not in ("undefined", "int32"):
        info = np.iinfo(zero_point.dtype)
        if zero_point.size and (zero_point.min() < info.min or zero_point.max() > info.max):
            return f"holds values outside [{info.min}, {info.max}]"
    return None


def _axis_problem(view: GraphView, node: onnx.NodeProto, scale: np.ndarray | None) -> str | None:
    attr = _attr(node, "axis")
    shape = view.shape.get(node.input[0])
    if attr is None or shape is None:
        return None
    rank, axis = len(shape), attr.i
    per_channel = scale is not None and scale.ndim >= 1 and scale.size > 1
    if not per_channel and (axis == 1 or rank == 0):  # exporters write the default axis=1 on per-tensor nodes
        return None
    if not -rank <= axis < rank:
        return f"axis {axis} is out of range for a tensor of rank {rank} (valid: {-rank}..{rank - 1})"
    if per_channel and scale.ndim == 1 and shape[axis] != scale.size:
        return f"axis {axis} has {shape[axis]} channels but the node has {scale.size} scales"
    return None


def _qdq_problems(view: GraphView, node: onnx.NodeProto, index: int) -> list[str]:
    label = node_label(node, index)
    if len(node.input) < 2 or not node.input[1]:
        return [f"{label}: no scale input"]
    scale_name = node.input[1]
    zp_name = node.input[2] if len(node.input) > 2 else ""
    scale = view.value(scale_name)
    zero_point = view.value(zp_name) if zp_name else None
    problems = []
    if scale is not None and (why := _bad_scale(scale)):
        problems.append(f"{label}: scale {scale_name!r}{why if why.startswith(('[', ' =')) else ' ' + why}")
    if zero_point is not None:
        why = _zero_point_problem(zero_point, _stored_type(view, node, zero_point), scale)
        if why:
            problems.append(f"{label}: zero-point {zp_name!r} {why}")
    if (why := _axis_problem(view, node, scale)) is not None:
        problems.append(f"{label}: {why}")
    return problems


def _dimension_problems(view: GraphView) -> list[str]:
    graph = view.model.graph
    problems = []
    # as ONNX Runtime reads a declaration: a negative dim (Paddle's -1) is dynamic; an input dim of 0
    # accepts only empty tensors; an output's declared dims are merged leniently with what it computes
    for value in graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value == 0:
                problems.append(f"input {value.name!r}: dimension {axis} is 0 (must be positive, or dynamic)")
    for tensor in graph.initializer:
        dims = list(tensor.dims)
        if any(d < 0 for d in dims) or (0 in dims and len(dims) > 1):  # [0] is ONNX's "empty" (e.g. roi)
            problems.append(f"initializer {tensor.name!r}: dimensions {dims} (must be positive)")
    return problems


def parameter_problems(view: GraphView) -> list[str]:
    """Every broken quantization parameter and non-positive declared dimension, as ``node: what`` lines."""
    problems = []
    for index, node in enumerate(view.nodes):
        if node.op_type in (QUANTIZE, DEQUANTIZE) and node.domain in DEFAULT_DOMAINS and node.input:
            problems += _qdq_problems(view, node, index)
    return problems + _dimension_problems(view)


def foreign_operators(view: GraphView) -> list[tuple[str, str, bool]]:
    """(``node (domain::op)``, domain, defined by a model-local function) for each node outside the default domain."""
    local = {(f.domain, f.name) for f in view.model.functions}
    return [(f"{node_label(node, index)} ({node.domain}::{node.op_type})", node.domain, (node.domain, node.op_type) in local)
            for index, node in enumerate(view.nodes) if node.domain not in DEFAULT_DOMAINS]

