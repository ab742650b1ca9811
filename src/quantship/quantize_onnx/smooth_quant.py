"""SmoothQuant: activation outliers moved into the weights (Xiao et al. 2022, "SmoothQuant: Accurate and
Efficient Post-Training Quantization for Large Language Models", section 4).

For a layer ``Y = X W`` (MatMul, Gemm, or a 1x1 Conv, whose weight is stored), each input channel ``j``
gets ``s_j = max|X_j| ^ alpha / max|W_j| ^ (1 - alpha)``, ``max|X_j|`` measured on the calibration
data; ``X`` is divided by ``s`` and ``W``'s input channel ``j`` multiplied by ``s_j``, so ``Y`` is
unchanged while the few channels where ``X`` is large no longer set the per-tensor activation grid.
A channel no layer reads (its weights all zero, where the formula's ``s`` is infinite) is brought to the
median range of the smoothed channels instead; that is exact too, its weights stay zero.

The division is folded where it is exact, walking back from ``X`` through ops each of whose outputs
has one reader:

- ``LayerNormalization`` over the last axis: its scale and bias are divided by ``s``;
- a MatMul / Gemm / Conv with a stored weight: its output channels (weight and bias) are divided;
- ``Mul`` or ``Div`` by a constant: the constant is divided (multiplied, for ``Div``); a ``Mul`` of
  two computed tensors carries ``1 / s`` into whichever of them can take it (a decomposed LayerNorm:
  ``(x - mean) * (rstd * gamma) + beta``);
- ``Add`` / ``Sub`` of a constant: the constant is divided and the walk goes on through the other input.

Where no such producer exists (a graph input, a Cast, a Transpose, an op that is not linear per
channel), the layer is skipped and the record says why. Inserting a ``Mul`` by ``1 / s`` instead was
not chosen: that Mul would run in float on the integer runtimes, and a target that quantizes every op
would quantize its input, which has the same outliers, so the layer would gain nothing and cost a node.
An activation read by several layers (a LayerNorm feeding the query, key and value projections) gets
one ``s`` for all of them, from the largest weight of each channel over the readers; when one of its
readers is not such a layer, it is skipped.

The pass runs on the normalised float model (``quantizer.normalise``), so its float outputs are proven
unchanged within ``normalize.FLOAT_TOLERANCE`` in ONNX Runtime before calibration. The activation
ranges come from one float run over the calibration feeds (``calibrate.exposing_session``), per channel
only, batch by batch (sliced to ``calibrate.MEMORY_BUDGET``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from quantship.inspect.read.feeds import Feed
from quantship.quantize.algorithms.smooth_quant import check_alpha, smoothing_scales
from quantship.quantize_onnx.calibrate import MEMORY_BUDGET, exposing_session
from quantship.quantize_onnx.normalize import DEFAULT_DOMAINS, Pass, fresh_initializer

MAX_WALK = 4  # ops crossed back from the activation to the op that takes 1 / s


@dataclass
class _Layer:
    node: ir.Node
    weight: ir.Value
    axis: int  # the weight axis indexed by the input channel


@dataclass
class _Edit:
    """One stored tensor that takes ``1 / s`` (or ``s``, for a Div's divisor) along one of its axes."""

    owner: ir.Node
    index: int  # the owner's input holding the tensor
    axis: int | None  # the tensor axis of the channel; None: broadcast from the end, as the activation's
    multiply: bool = False


@dataclass
class _Group:
    """An activation and the layers reading it: one ``s`` for all of them."""

    value: ir.Value
    layers: list[_Layer]
    from_end: int  # the activation's channel axis, counted from its last (-1: MatMul/Gemm, -3: Conv NCHW)
    edits: list[_Edit] = field(default_factory=list)


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None or value.is_graph_input():
        return None
    array = value.const_value.numpy()
    return array if array.dtype == np.float32 else None


def _attr(node: ir.Node, name: str, default):
    return node.attributes[name].value if name in node.attributes else default


def _layer(node: ir.Node) -> tuple[_Layer, int] | None:
    """A layer SmoothQuant can rescale: (its weight and input-channel axis, the activation's channel axis)."""
    if node.domain not in DEFAULT_DOMAINS or len(node.inputs) < 2 or node.inputs[0] is None:
        return None
    w = _const(node.inputs[1])
    if w is None:
        return None
    if node.op_type == "MatMul" and w.ndim == 2:
        return _Layer(node, node.inputs[1], 0), -1
    if node.op_type == "Gemm" and w.ndim == 2 and not _attr(node, "transA", 0):
        return _Layer(node, node.inputs[1], 1 if _attr(node, "transB", 0) else 0), -1
    if (node.op_type == "Conv" and w.ndim >= 3 and all(k == 1 for k in w.shape[2:])
            and _attr(node, "group", 1) == 1):
        return _Layer(node, node.inputs[1], 1), -(w.ndim - 1)
    return None


def _channels(layer: _Layer) -> int:
    return _const(layer.weight).shape[layer.axis]


def _label(node: ir.Node) -> str:
    return node.name or f"{node.op_type} -> {node.outputs[0].name}"


def _owned(value: ir.Value | None) -> bool:
    return value is not None and _const(value) is not None and not value.is_graph_output()


def _producer_edits(producer: ir.Node, from_end: int, channels: int) -> list[_Edit] | str:
    """The stored tensors of a layer-like producer that take 1 / s on its output channels."""
    op = producer.op_type
    if op == "LayerNormalization":
        scale = _const(producer.inputs[1]) if len(producer.inputs) > 1 else None
        if from_end != -1 or _attr(producer, "axis", -1) != -1 or scale is None or scale.shape[-1:] != (channels,):
            return "its LayerNormalization does not normalise the channel axis alone with a stored scale"
        bias = producer.inputs[2] if len(producer.inputs) > 2 else None
        if bias is not None and _const(bias) is None:
            return "its LayerNormalization's bias is computed"
        return [_Edit(producer, 1, scale.ndim - 1)] + ([_Edit(producer, 2, _const(bias).ndim - 1)] if bias else [])
    w = _const(producer.inputs[1]) if len(producer.inputs) > 1 else None
    if w is None or (op == "Gemm" and _attr(producer, "transA", 0)) or (op != "Conv" and w.ndim != 2):
        return f"its producer {op} has no stored weight to take 1 / s"
    if op == "Conv" and from_end == -(w.ndim - 1):  # grouped too: each output channel has its own weights
        out_axis = 0
    elif op in ("MatMul", "Gemm") and from_end == -1:
        out_axis = 0 if op == "Gemm" and _attr(producer, "transB", 0) else 1
    else:
        return f"its producer {op}'s output channels are not on this layer's channel axis"
    if w.shape[out_axis] != channels:
        return f"its producer {op} has {w.shape[out_axis]} output channels, not {channels}"
    edits = [_Edit(producer, 1, out_axis)]
    if len(producer.inputs) > 2 and producer.inputs[2] is not None:
        if _const(producer.inputs[2]) is None:
            return f"its producer {op}'s bias is computed"
        edits.append(_Edit(producer, 2, None if op == "Gemm" else 0))
    return edits


def _walk(value: ir.Value, from_end: int, channels: int, depth: int = 0) -> list[_Edit] | str:
    """The edits that divide ``value`` by ``s`` exactly, or why there are none."""
    producer = value.producer()
    if producer is None:
        return "it reads a graph input: no producer to fold 1 / s into"
    if depth and (len(value.uses()) != 1 or value.is_graph_output()):
        return f"an intermediate tensor {value.name} has other readers"
    if depth > MAX_WALK or producer.domain not in DEFAULT_DOMAINS:
        return f"its producer {producer.op_type} cannot take 1 / s"
    op, inputs = producer.op_type, list(producer.inputs)
    if op in ("LayerNormalization", "MatMul", "Gemm", "Conv"):
        return _producer_edits(producer, from_end, channels)
    if op in ("Mul", "Div", "Add", "Sub") and len(inputs) == 2:
        stored = [_owned(v) for v in inputs]
        if op == "Mul" and any(stored):
            return [_Edit(producer, stored.index(True), None)]
        if op == "Div" and stored[1]:
            return [_Edit(producer, 1, None, multiply=True)]
        if op in ("Add", "Sub") and stored.count(True) == 1:
            rest = _walk(inputs[stored.index(False)], from_end, channels, depth + 1)
            return rest if isinstance(rest, str) else [_Edit(producer, stored.index(True), None), *rest]
        readers = [k for k in ((0, 1) if op == "Mul" else (0,) if op == "Div" else ()) if not stored[k]]
        why = f"its producer {op} has no constant to take 1 / s"
        for k in readers:
            plan = _walk(inputs[k], from_end, channels, depth + 1)
            if not isinstance(plan, str):
                return plan
            why = plan
        return why
    return f"its producer {op} cannot take 1 / s exactly"


def find_groups(model: ir.Model) -> tuple[list[_Group], dict[str, str]]:
    """Every activation SmoothQuant can rescale with its readers and its fold, and the layers skipped (why)."""
    groups, skipped, seen = [], {}, set()
    for node in model.graph:
        found = _layer(node)
        if found is None or id(node.inputs[0]) in seen:
            continue
        value, from_end = node.inputs[0], found[1]
        seen.add(id(value))
        readers, why = [], None
        for use in value.uses():
            other = _layer(use.node) if use.idx == 0 else None
            if other is None or other[1] != from_end or _channels(other[0]) != _channels(found[0]):
                why = f"its input is also read by {use.node.op_type} {_label(use.node)}"
                break
            if len(other[0].weight.uses()) != 1:
                why = "its weight is shared with another node"
                break
            readers.append(other[0])
        if why is None and value.is_graph_output():
            why = "its input is a graph output"
        if why is None and not value.name:
            why = "its input has no name to read it by"
        plan = why or _walk(value, from_end, _channels(found[0]))
        if isinstance(plan, str):
            for layer in readers or [found[0]]:
                skipped[_label(layer.node)] = plan
            continue
        groups.append(_Group(value, readers, from_end, plan))
    return groups, skipped


def activation_ranges(model: ir.Model, names: Sequence[str], feeds: Sequence[Feed],
                      from_end: dict[str, int]) -> dict[str, np.ndarray]:
    """Largest |value| per channel of each tensor in ``names`` over every calibration feed (float model)."""
    session = exposing_session(ir.to_proto(model), names)
    ranges: dict[str, np.ndarray] = {}
    rows = None
    for feed in feeds:
        n = len(next(iter(feed.values())))
        if rows is None:  # one sample's bytes, measured, set the slice length
            first = session.run(list(names), {k: v[:1] for k, v in feed.items()})
            rows = max(1, MEMORY_BUDGET // max(1, sum(np.asarray(o).nbytes for o in first)))
        for start in range(0, n, rows):
            outs = session.run(list(names), {k: v[start:start + rows] for k, v in feed.items()})
            for name, out in zip(names, outs):
                axis = np.ndim(out) + from_end[name]
                moved = np.moveaxis(np.abs(np.asarray(out, np.float32)), axis, -1)
                peak = moved.reshape(-1, moved.shape[-1]).max(axis=0) if moved.size else np.zeros(moved.shape[-1])
                ranges[name] = peak if name not in ranges else np.maximum(ranges[name], peak)
            del outs
    return ranges


def _shaped(s: np.ndarray, ndim: int, axis: int | None, from_end: int) -> np.ndarray:
    if axis is None:  # broadcast from the end, as the activation itself
        return s.reshape((-1,) + (1,) * (-from_end - 1))
    return s.reshape((1,) * axis + (-1,) + (1,) * (ndim - axis - 1))


def _store(graph: ir.Graph, owner: ir.Node, index: int, array: np.ndarray) -> None:
    """``array`` as ``owner``'s input ``index``: in place when the owner is its one reader, else a copy."""
    value = owner.inputs[index]
    array = array.astype(np.float32)
    if len(value.uses()) == 1 and not value.is_graph_output():
        value.const_value = ir.tensor(array, name=value.name)
        value.shape = ir.Shape(array.shape)
        return
    owner.replace_input_with(index, fresh_initializer(graph, f"{value.name}_smoothed", array))


def _scales(group: _Group, x_range: np.ndarray, alpha: float) -> np.ndarray:
    w_range = np.zeros_like(x_range, dtype=np.float64)
    for layer in group.layers:
        w = np.moveaxis(np.abs(_const(layer.weight)), layer.axis, 0)
        w_range = np.maximum(w_range, w.reshape(w.shape[0], -1).max(axis=1))
    return smoothing_scales(x_range, w_range, alpha)


def _apply(graph: ir.Graph, group: _Group, s: np.ndarray) -> None:
    for layer in group.layers:
        w = _const(layer.weight)
        _store(graph, layer.node, 1, w * _shaped(s, w.ndim, layer.axis, -1))
    for edit in group.edits:
        c = _const(edit.owner.inputs[edit.index])
        factor = _shaped(s, c.ndim, edit.axis, group.from_end)
        _store(graph, edit.owner, edit.index, c * factor if edit.multiply else c / factor)
        grown = np.broadcast_shapes(c.shape, factor.shape) != c.shape
        if edit.axis is None and grown and not edit.owner.outputs[0].is_graph_output():
            edit.owner.outputs[0].shape = None  # a scalar became per channel: ONNX Runtime infers the shape


class Smoother:
    """The pass's work and its record: ``run(model)`` smooths every group ``find_groups`` returns with
    ``alpha`` on ``feeds`` and returns the layers smoothed; ``record()`` says which and what was skipped."""

    def __init__(self, alpha: float, feeds: Sequence[Feed]) -> None:
        self.alpha, self.feeds = check_alpha(alpha), list(feeds)
        self.smoothed: dict[str, str] = {}  # layer -> the range of its s
        self.skipped: dict[str, str] = {}
        self.largest_scale = 1.0
        self.seconds = 0.0

    def run(self, model: ir.Model) -> int:
        start = time.perf_counter()
        try:
            return self._smooth(model)
        finally:
            self.seconds = time.perf_counter() - start

    def _smooth(self, model: ir.Model) -> int:
        groups, self.skipped = find_groups(model)
        if not groups:
            return 0
        ranges = activation_ranges(model, [g.value.name for g in groups], self.feeds,
                                   {g.value.name: g.from_end for g in groups})
        for group in groups:
            x_range = ranges[group.value.name]
            if x_range.shape[0] != _channels(group.layers[0]):
                for layer in group.layers:
                    self.skipped[_label(layer.node)] = "its input's channel count differs from the weight's"
                continue
            s = _scales(group, x_range, self.alpha)
            _apply(model.graph, group, s)
            for layer in group.layers:
                self.smoothed[_label(layer.node)] = f"s in [{s.min():.3g}, {s.max():.3g}] over {s.size} channels"
            self.largest_scale = max(self.largest_scale, float(s.max()), float(1 / s.min()))
        return len(self.smoothed)

    def record(self) -> dict:
        return {"alpha": self.alpha, "layers_smoothed": len(self.smoothed), "layers_skipped": len(self.skipped),
                "largest_scale": self.largest_scale, "smoothed": dict(self.smoothed), "skipped": dict(self.skipped),
                "seconds": round(self.seconds, 3)}


def smoothing_pass(smoother: Smoother) -> Pass:
    return Pass("smooth_quant", smoother.run, "float",
                f"SmoothQuant (alpha {smoother.alpha:g}): activation outliers moved into the weights "
                "(the float function kept)")
