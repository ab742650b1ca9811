"""The LSB an output is judged in when float ops follow the last DequantizeLinear.

A float output (Softmax, Sigmoid, Concat, a decode after the last DequantizeLinear) still comes from
quantized tensors. Its unit is the largest change one LSB at each of those tensors can make at the
output: the scale of the DequantizeLinear, carried through each float op by that op's Lipschitz
bound in max norm (Reshape/Transpose/Concat/Slice/MaxPool/Relu/Max/Min: 1; Softmax: 1/2; Sigmoid: 1/4;
Mul by a constant c: max |c|; Add of two quantized branches: the sum of their units; a softmax written
out as ``Exp(z - shift) / ReduceSum(Exp(z - shift))``, the shift whatever it is: 1/2). So an output
error of ``k`` units means the quantized tensors feeding it were at least ``k`` LSB apart: a
failure against a tolerance is proven, a pass is necessary, not sufficient. An output whose path
holds anything else (a product of two activations, an unquantized Conv) has no unit (None).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from quantship.inspect.read.facts import facts_of
from quantship.inspect.read.view import DEQUANTIZE, QUANTIZE, GraphView

if TYPE_CHECKING:
    from quantship.inspect.read.facts import FileFacts

# float ops whose output values are a selection, a max or a clamp of their value inputs' values
_ONE = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose", "Slice", "Gather",
                  "Split", "Concat", "Expand", "Tile", "MaxPool", "GlobalMaxPool", "ReduceMax", "Relu", "Clip",
                  "Cast", "Max", "Min"})
# every input carries values (elementwise Max/Min: |max(a, b) - max(a', b')| <= max(|a - a'|, |b - b'|));
# the others: input 0 only
_ALL_INPUTS = frozenset({"Concat", "Max", "Min"})
# fixed Lipschitz bounds (max norm): |d out_i| <= gain * max_j |d in_j|
_GAIN = {"Softmax": 0.5, "Sigmoid": 0.25, "Tanh": 1.0, "LogSoftmax": 2.0, "HardSwish": 1.5, "Neg": 1.0,
         "Abs": 1.0, "AveragePool": 1.0, "GlobalAveragePool": 1.0, "ReduceMean": 1.0}
_MAX_DEPTH = 64  # a decode longer than this is not followed
# what carries a ReduceSum back to its input's shape in a written-out softmax (keepdims=0 exports)
_BROADCAST = frozenset({"Reshape", "Unsqueeze", "Expand", "Identity"})


@dataclass(frozen=True)
class OutputUnit:
    """One output's LSB: ``unit`` (None: not comparable in LSB) and the ops that shaped it."""

    unit: float | np.ndarray | None  # an array (broadcast to the output) for a Concat of parts in different units
    rule: str  # "" when the output is the DequantizeLinear itself (through shape-only ops); else the ops
    reason: str = ""  # why there is no unit

    def __str__(self) -> str:
        return self.rule


class _NoUnit(Exception):
    pass


def output_units(path: str | Path | onnx.ModelProto | FileFacts) -> dict[str, OutputUnit]:
    """For each graph output, the LSB it is compared in (module docstring: the rule)."""
    facts = facts_of(path)
    view = facts.view
    units: dict[str, OutputUnit] = {}
    for name in view.outputs:
        scale = facts.output_scales.get(name)
        if scale:
            units[name] = _requantized(view, name, scale)
            continue
        ops: list[str] = []
        try:
            sliced = _concat_slices(view, name, ops)
            if sliced is not None:
                units[name] = sliced
                continue
            unit = _unit(view, name, ops, 0, {})
        except _NoUnit as exc:
            units[name] = OutputUnit(None, "", str(exc))
            continue
        if not unit:
            units[name] = OutputUnit(None, "", "it does not depend on a quantized activation")
            continue
        seen = list(dict.fromkeys(reversed(ops)))  # in the order the file computes them
        units[name] = OutputUnit(unit, "the quantized tensors feeding it, through " + ", ".join(seen)
                                 + " after the last DequantizeLinear")
    return units


def _concat_slices(view: GraphView, name: str, ops: list[str]) -> OutputUnit | None:
    """An output that is a Concat of parts at different units (YOLO's boxes in pixels beside class
    scores in [0, 1]): each slice is judged in its own part's unit, an array over the Concat axis (None
    when the output is no such Concat, or the parts' sizes along the axis are not known)."""
    node = view.node_of(name)
    if node is None or node.op_type != "Concat":
        return None
    shapes = [view.shape.get(t) for t in node.input]
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    if not shapes or any(s is None for s in shapes) or len({len(s) for s in shapes}) != 1:
        return None
    parts = [_unit(view, t, ops, 1, {}) for t in node.input]
    if len(set(parts)) < 2:
        return None
    rank = len(shapes[0])
    axis %= rank
    unit = np.concatenate([np.full(s[axis], u, np.float64) for s, u in zip(shapes, parts)])
    if not np.all(unit > 0):
        raise _NoUnit("a part of its Concat does not depend on a quantized activation")
    shape = [1] * rank
    shape[axis] = unit.size
    return OutputUnit(unit.reshape(shape), f"each part of its Concat in its own unit ({min(parts):.4g} .. "
                      f"{max(parts):.4g}, along axis {axis})")


def _requantized(view: GraphView, name: str, scale: float) -> OutputUnit:
    """An output read off a DequantizeLinear; when its QuantizeLinear requantizes a Softmax, Sigmoid or
    shape op of quantized tensors, the larger of its own step and one LSB of those carried through it
    (a Softmax from logits at 0.07 to probabilities at 0.008 turns one logit LSB into 4 output LSB)."""
    ops: list[str] = []
    try:
        carried = _unit(view, view.through_shape_ops_up(name), ops, 0, {}, look_back=True)
    except _NoUnit:
        return OutputUnit(scale, "")
    if carried <= scale * (1 + 1e-6):
        return OutputUnit(scale, "")
    seen = list(dict.fromkeys(reversed(ops)))
    return OutputUnit(carried, f"the quantized tensors feeding {', '.join(seen)} (one LSB of them carried through: "
                               f"{carried / scale:.1f}x the output's own step {scale:.4g})")


def _constant(view: GraphView, tensor: str) -> np.ndarray | None:
    """A constant's value, a dequantized constant's too (both runtimes read it exactly alike)."""
    value = view.value(tensor)
    if value is not None:
        return value
    node = view.node_of(tensor)
    if node is not None and node.op_type == DEQUANTIZE:
        q = view.value(node.input[0])
        scale = view.value(node.input[1]) if len(node.input) > 1 else None
        zero = view.value(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if q is not None and scale is not None and scale.size == 1:
            return (q.astype(np.float64) - (0 if zero is None else zero.astype(np.float64))) * float(scale.reshape(()))
    return None


def _unit(view: GraphView, tensor: str, ops: list[str], depth: int, memo: dict[str, float],
          look_back: bool = False) -> float:
    """The largest output change of one LSB at every quantized tensor feeding ``tensor`` (0: constant)."""
    if tensor in memo:
        return memo[tensor]
    if _constant(view, tensor) is not None:
        return 0.0
    node = view.node_of(tensor)
    if node is None:
        raise _NoUnit(f"graph input {tensor!r} reaches it in float")
    if depth > _MAX_DEPTH:
        raise _NoUnit(f"more than {_MAX_DEPTH} float ops follow the last DequantizeLinear")
    op = node.op_type
    if op == DEQUANTIZE:
        scale = view.value(node.input[1]) if len(node.input) > 1 else None
        if scale is None or scale.size != 1:
            raise _NoUnit(f"DequantizeLinear {node.name!r} has no single scale")
        unit = float(scale.reshape(()))
        q = view.node_of(node.input[0])
        if look_back and q is not None and q.op_type == QUANTIZE and view.node_of(q.input[0]) is not None:
            seen = len(ops)
            try:  # a requantized Softmax/Sigmoid/shape op: one LSB of what feeds it, carried through
                unit = max(unit, _unit(view, q.input[0], ops, depth + 1, memo, look_back))
            except _NoUnit:  # a Conv or another op without a rule: this tensor's own step
                del ops[seen:]
    else:
        ops.append(op)
        if op in ("Add", "Sub", "Mul", "Div") and len(node.input) == 2:
            unit = _binary(view, node, ops, depth, memo, look_back)
            memo[tensor] = unit
            return unit
        value_inputs = [t for t in (node.input if op in _ALL_INPUTS else node.input[:1]) if t]
        inner = [_unit(view, t, ops, depth + 1, memo, look_back) for t in value_inputs]
        if op in _ONE:
            unit = max(inner)
        elif op in _GAIN:
            unit = _GAIN[op] * inner[0]
        elif op == "HardSigmoid":
            alpha = next((a.f for a in node.attribute if a.name == "alpha"), 0.2)
            unit = abs(alpha) * inner[0]
        elif op == "LeakyRelu":
            alpha = next((a.f for a in node.attribute if a.name == "alpha"), 0.01)
            unit = max(1.0, abs(alpha)) * inner[0]
        else:
            raise _NoUnit(f"{op} {node.name!r} follows the last DequantizeLinear (no Lipschitz rule for it)")
    memo[tensor] = unit
    return unit


def _binary(view: GraphView, node: onnx.NodeProto, ops: list[str], depth: int, memo: dict[str, float],
            look_back: bool) -> float:
    a, b = node.input
    ca, cb = _constant(view, a), _constant(view, b)
    op = node.op_type
    if op in ("Add", "Sub"):
        return (0.0 if ca is not None else _unit(view, a, ops, depth + 1, memo, look_back)) + \
            (0.0 if cb is not None else _unit(view, b, ops, depth + 1, memo, look_back))
    if ca is not None and cb is not None:
        return 0.0
    if op == "Mul" and (ca is not None or cb is not None):
        constant, other = (ca, b) if ca is not None else (cb, a)
        return float(np.abs(constant).max(initial=0.0)) * _unit(view, other, ops, depth + 1, memo, look_back)
    if op == "Div":
        logits = _written_softmax(view, node)
        if logits is not None:  # softmax(z) whatever the shift: 1/2-Lipschitz in max norm, as Softmax
            ops[-1] = "Softmax (written out)"  # in place of the Div _unit listed
            return _GAIN["Softmax"] * _unit(view, logits, ops, depth + 1, memo, look_back)
    if op == "Div" and cb is not None:
        smallest = float(np.abs(cb).min(initial=np.inf))
        if smallest > 0:
            return _unit(view, a, ops, depth + 1, memo, look_back) / smallest
    raise _NoUnit(f"{op} {node.name!r} of two computed tensors follows the last DequantizeLinear "
                  "(its error bound depends on the values)")


def _written_softmax(view: GraphView, div: onnx.NodeProto) -> str | None:
    """The logits ``z`` when ``div`` is ``Exp(z [- shift]) / ReduceSum(that Exp)`` (the sum carried back to
    the Exp's shape by Reshape/Unsqueeze/Expand), the softmax a TensorFlow/JAX export writes op by op; the
    shift (the max, usually) cancels exactly, so only ``z`` carries units. None for any other Div."""
    numerator, denominator = div.input
    exp = view.node_of(numerator)
    if exp is None or exp.op_type != "Exp":
        return None
    total = view.node_of(denominator)
    while total is not None and total.op_type in _BROADCAST:
        total = view.node_of(total.input[0])
    if total is None or total.op_type != "ReduceSum" or total.input[0] != numerator:
        return None
    shifted = view.node_of(exp.input[0])
    if shifted is not None and shifted.op_type == "Sub":
        return shifted.input[0]
    return exp.input[0]
