"""In a uint8-activation file, the stored constant an Add or Mul reads moves to uint8 as well.

ONNX Runtime fuses DequantizeLinear -> Add/Mul -> QuantizeLinear into QLinearAdd/QLinearMul only
when both inputs and the output share one integer type (its QDQ ``BinaryNodeGroupSelector``). The
annotator stores a constant operand (ViT's position embedding, ConvNeXt's layer scale) as an int8
weight, while the activation beside it is uint8 after ``to_uint8_activations``: ORT then runs the op
in float between a dequantize and a quantize. The move is the activations' one, applied to a stored
tensor: stored value q + 128 with zero-point z + 128, same scale, so the dequantized values are the
same numbers and the file's outputs do not change.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quantship.export.activations import SHIFT

BINARY_FUSED_OPS = ("Add", "Mul")  # the ops ORT's CPU QDQ binary selector turns into QLinearAdd/QLinearMul


def _dequantize_of(value: ir.Value | None) -> ir.Node | None:
    producer = value.producer() if value is not None else None
    return producer if producer is not None and producer.op_type == "DequantizeLinear" else None


def _zero_point_dtype(dq: ir.Node) -> np.dtype | None:
    zp = dq.inputs[2] if len(dq.inputs) > 2 else None
    return zp.const_value.numpy().dtype if zp is not None and zp.const_value is not None else None


def _stored_int8(dq: ir.Node) -> bool:
    """A DequantizeLinear reading a stored int8 tensor with a stored int8 zero-point."""
    data = dq.inputs[0]
    return (data is not None and data.const_value is not None and data.const_value.numpy().dtype == np.int8
            and _zero_point_dtype(dq) == np.int8)


def _activation_uint8(dq: ir.Node) -> bool:
    """A DequantizeLinear reading a computed (not stored) tensor with a uint8 zero-point."""
    return dq.inputs[0] is not None and dq.inputs[0].const_value is None and _zero_point_dtype(dq) == np.uint8


def _only_binary_consumers(dq: ir.Node) -> bool:
    uses = dq.outputs[0].uses()
    return bool(uses) and not dq.outputs[0].is_graph_output() and all(
        use.node.op_type in BINARY_FUSED_OPS for use in uses)


def _shifted(graph: ir.Graph, value: ir.Value, memo: dict[str, ir.Value]) -> ir.Value:
    """A new initializer holding ``value`` + 128 as uint8 (one per original tensor)."""
    if value.name in memo:
        return memo[value.name]
    array = (value.const_value.numpy().astype(np.int16) + SHIFT).astype(np.uint8)
    name, n = f"{value.name}_uint8", 0
    while name in graph.initializers:  # the activation move may have made this very tensor already
        existing = graph.initializers[name].const_value
        if existing is not None and existing.dtype == ir.DataType.UINT8 and np.array_equal(existing.numpy(), array) \
                and existing.numpy().shape == array.shape:
            memo[value.name] = graph.initializers[name]
            return memo[value.name]
        n += 1
        name = f"{value.name}_uint8_{n}"
    new = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    graph.register_initializer(new)
    memo[value.name] = new
    return new


def constants_to_uint8(model: ir.Model) -> int:
    """Move, in place, each stored int8 operand of an Add/Mul whose other operand is a uint8
    activation; returns the number of DequantizeLinear nodes moved."""
    graph = model.graph
    memo: dict[str, ir.Value] = {}
    moved: list[ir.Node] = []
    for node in graph:
        if node.op_type not in BINARY_FUSED_OPS or len(node.inputs) != 2:
            continue
        dqs = [_dequantize_of(v) for v in node.inputs]
        if any(dq is None for dq in dqs):
            continue
        for mine, other in ((dqs[0], dqs[1]), (dqs[1], dqs[0])):
            if (mine not in moved and _stored_int8(mine) and _activation_uint8(other)
                    and _only_binary_consumers(mine)):
                moved.append(mine)
    old_values: list[ir.Value] = []
    for dq in moved:
        for index in (0, 2):
            old_values.append(dq.inputs[index])
            dq.replace_input_with(index, _shifted(graph, dq.inputs[index], memo))
    for value in old_values:
        if not value.uses() and value.name in graph.initializers:
            del graph.initializers[value.name]
    return len(moved)
