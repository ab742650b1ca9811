"""Cross-layer equalization (data-free): Conv -> (ReLU | PReLU | pooling | nothing) -> Conv pairs rescaled so that each
channel between them has the same weight range on both sides (Nagel et al. 2019, "Data-Free
Quantization Through Weight Equalization and Bias Correction", section 4.1).

For a channel ``i`` between two convolutions, scaling the first conv's output channel by ``1 / s_i``
(its weights and bias) and the second conv's input channel by ``s_i`` leaves the float model's
function unchanged when the activation between them is positively homogeneous (``f(x / s) = f(x) /
s`` for ``s > 0``): ReLU, PReLU (its slope applies per channel, whatever the scale), max and average
pooling are, and so is an identity; up to ``MAX_BETWEEN`` of them may sit between the convs. With ``s_i = sqrt(r1_i * r2_i) / r2_i`` (``r`` the
largest absolute weight of the channel on each side), both sides end with range ``sqrt(r1_i * r2_i)``,
so a per-tensor or per-channel int8 grid loses less of the smaller channels. Pairs that share a conv
interact, so the sweep repeats until no scale moves more than ``TOLERANCE``.

Treated as not homogeneous, so a pair through them is left alone: ``Clip`` with a finite max (ReLU6:
``min(x / s, 6) != min(x, 6) / s``; rescaling would move the clipping point per channel, which one
Clip attribute cannot express), ``Clip`` with a nonzero min, HardSwish, Sigmoid and every other op.
A ``Clip(min=0)`` without a max is ReLU and is equalized. The first conv's output and each op's output
between must have exactly one reader (another reader would see the rescaled channels).

The pass runs on the normalised float model (BatchNormalization already folded into the convs) as one
more float pass of ``quantizer.normalise``, so its float outputs are proven unchanged within
``normalize.FLOAT_TOLERANCE`` in ONNX Runtime before any calibration. The channel arithmetic (ranges,
scales) is ``quantize.algorithms.equalize``'s, shared with the pt2e path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from quantship.quantize.algorithms.equalize import (
    MAX_BETWEEN,
    MAX_SWEEPS,
    TOLERANCE,
    equalizing_scales,
    input_channel_ranges,
    scale_input_channels,
)
from quantship.quantize_onnx.normalize import Pass


@dataclass
class ConvPair:
    """Two convolutions with a homogeneous activation (or nothing) between them."""

    first: ir.Node
    second: ir.Node
    between: tuple[ir.Node, ...]  # the homogeneous ops between them, in order (empty: conv straight into conv)


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    array = value.const_value.numpy()
    return array if array.dtype == np.float32 else None


def _single_reader(value: ir.Value) -> ir.Node | None:
    uses = value.uses()
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0].node if uses[0].idx == 0 else None


def _homogeneous(node: ir.Node) -> bool:
    """ReLU, a Clip that is ReLU (min 0, no max), PReLU with a stored slope, max and average pooling:
    ops with ``f(x / s) = f(x) / s`` per channel for ``s > 0``. ReLU6 and every other activation are not."""
    if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
        return False
    if node.op_type in ("Relu", "MaxPool", "AveragePool"):
        return True
    if node.op_type == "PRelu":
        return len(node.inputs) == 2 and _const(node.inputs[1]) is not None
    if node.op_type != "Clip":
        return False
    if "min" in node.attributes or "max" in node.attributes:  # opset < 11 spelling
        low = node.attributes["min"].value if "min" in node.attributes else -np.inf
        high = node.attributes["max"].value if "max" in node.attributes else np.inf
    else:
        bounds = []
        for v in (list(node.inputs[1:3]) + [None, None])[:2]:
            if v is None or not v.name:
                bounds.append(None)
                continue
            b = _const(v)
            if b is None or b.size != 1:
                return False  # a bound computed at run time
            bounds.append(float(b.reshape(-1)[0]))
        low = -np.inf if bounds[0] is None else bounds[0]
        high = np.inf if bounds[1] is None else bounds[1]
    return low == 0.0 and high == np.inf


def _weights_of(conv: ir.Node) -> tuple[np.ndarray, np.ndarray | None] | None:
    """A conv's stored float weight and bias (None when either is computed or shared with another node)."""
    if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or len(conv.inputs) < 2:
        return None
    w = _const(conv.inputs[1])
    if w is None or w.ndim < 3 or len(conv.inputs[1].uses()) != 1:
        return None
    b_value = conv.inputs[2] if len(conv.inputs) > 2 else None
    b = _const(b_value)
    if b_value is not None and b_value.name and (b is None or len(b_value.uses()) != 1):
        return None
    return w, b


def find_pairs(model: ir.Model) -> list[ConvPair]:
    """Every Conv -> (homogeneous activation) -> Conv pair the rescaling keeps exact, in graph order."""
    pairs = []
    for node in model.graph:
        if _weights_of(node) is None:
            continue
        reader = _single_reader(node.outputs[0])
        between: list[ir.Node] = []
        while reader is not None and reader.op_type != "Conv" and len(between) < MAX_BETWEEN and _homogeneous(reader):
            between.append(reader)
            reader = _single_reader(reader.outputs[0])
        if reader is None or reader.op_type != "Conv" or _weights_of(reader) is None or reader is node:
            continue
        w1 = _weights_of(node)[0]
        w2 = _weights_of(reader)[0]
        group = reader.attributes["group"].value if "group" in reader.attributes else 1
        if w2.shape[1] * group != w1.shape[0]:
            continue
        pairs.append(ConvPair(node, reader, tuple(between)))
    return pairs


def channel_ranges(pair: ConvPair) -> tuple[np.ndarray, np.ndarray]:
    """(first conv's range per output channel, second conv's range per input channel)."""
    w1, _ = _weights_of(pair.first)
    w2, _ = _weights_of(pair.second)
    group = pair.second.attributes["group"].value if "group" in pair.second.attributes else 1
    return np.abs(w1).reshape(w1.shape[0], -1).max(axis=1), input_channel_ranges(w2, group)


def _set(value: ir.Value, array: np.ndarray) -> None:
    value.const_value = ir.tensor(array.astype(np.float32), name=value.name)


def _rescale(pair: ConvPair) -> float:
    """One equalization step of a pair; returns the largest |s - 1| it applied."""
    w1, b1 = _weights_of(pair.first)
    w2, _ = _weights_of(pair.second)
    group = pair.second.attributes["group"].value if "group" in pair.second.attributes else 1
    s = equalizing_scales(*channel_ranges(pair))
    shape = (-1,) + (1,) * (w1.ndim - 1)
    _set(pair.first.inputs[1], w1 / s.reshape(shape))
    if b1 is not None:
        _set(pair.first.inputs[2], b1 / s)
    _set(pair.second.inputs[1], scale_input_channels(w2, group, s))
    return float(np.abs(s - 1).max()) if s.size else 0.0


def equalize(model: ir.Model) -> int:
    """Equalize every pair ``find_pairs`` returns, sweeping until converged; returns the pairs changed."""
    pairs = find_pairs(model)
    moved = [_rescale(p) for p in pairs]
    changed = sum(m >= TOLERANCE for m in moved)
    for _ in range(MAX_SWEEPS - 1):
        if max(moved, default=0.0) < TOLERANCE:
            break
        moved = [_rescale(p) for p in pairs]
    return changed


PASS = Pass("equalize", equalize, "float",
            "cross-layer equalization: Conv -> ReLU -> Conv channel ranges balanced (the float function kept)")
