"""Exact rewrites that let ONNX Runtime's CPU QDQ fusions reach patterns they would leave in float.

Both change no output of the file read literally (each pass is checked byte for byte in ORT):

- ``constants_to_uint8``: ORT fuses DequantizeLinear -> Add/Mul -> QuantizeLinear into
  QLinearAdd/QLinearMul only when both inputs and the output share one integer type (its QDQ
  ``BinaryNodeGroupSelector``). A constant operand (ViT's position embedding, ConvNeXt's layer
  scale) is stored as an int8 weight, while the activation beside it is uint8 after
  ``to_uint8_activations``. It moves like the activations: stored q + 128, zero-point z + 128, same
  scale, so it dequantizes to the same numbers.
- ``requantize_before_relu``: Conv/Gemm/MatMul -> Relu -> QuantizeLinear becomes integer only when
  ORT can drop the Relu, i.e. when the QuantizeLinear's zero-point is the type's minimum (its
  ``ReluQuantFusion``). Where the output scale is shared with tensors that go negative (DenseNet's
  stem, whose max-pooled output joins the first concatenation), it is not. A QuantizeLinear /
  DequantizeLinear pair with the Relu's own scale and zero-point is put between the product and the
  Relu: Q(relu(x)) = Q(relu(DQ(Q(x)))) for every x, since Q is monotone and Q(0) is the zero-point,
  and the product then reads DQ ... -> Q (QLinearConv, QGemm, QLinearMatMul), the Relu staying a
  cheap float op between a DequantizeLinear and a QuantizeLinear.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quantship.export.activations import SHIFT

BINARY_FUSED_OPS = ("Add", "Mul")  # the ops ORT's CPU QDQ binary selector turns into QLinearAdd/QLinearMul
PRODUCT_OPS = ("Conv", "Gemm", "MatMul")  # fused by ORT's Conv/Gemm/MatMul selectors when a Q reads them
LOWEST = {np.dtype(np.uint8): 0, np.dtype(np.int8): -128}


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


def requantize_before_relu(model: ir.Model) -> int:
    """Insert, in place, a Q/DQ pair (the Relu's QuantizeLinear parameters) between each
    Conv/Gemm/MatMul and the Relu it feeds alone, where ORT could not drop that Relu; returns how many."""
    graph = model.graph
    n = 0
    for relu in list(graph):
        if relu.op_type != "Relu" or relu.domain not in ("", "ai.onnx"):
            continue
        product = relu.inputs[0].producer() if relu.inputs[0] is not None else None
        if product is None or product.op_type not in PRODUCT_OPS or len(product.outputs[0].uses()) != 1:
            continue
        if relu.outputs[0].is_graph_output() or product.outputs[0].is_graph_output():
            continue
        uses = relu.outputs[0].uses()
        if len(uses) != 1 or uses[0].node.op_type != "QuantizeLinear" or uses[0].idx != 0:
            continue
        quantize = uses[0].node
        if len(quantize.inputs) < 3 or any(v is None or v.const_value is None for v in quantize.inputs[1:3]):
            continue
        zero_point = quantize.inputs[2].const_value.numpy()
        if zero_point.size != 1 or quantize.inputs[1].const_value.numpy().size != 1:
            continue
        if zero_point.dtype not in LOWEST or int(zero_point.reshape(-1)[0]) == LOWEST[zero_point.dtype]:
            continue  # ORT folds this Relu into its QuantizeLinear already
        scale, zp = quantize.inputs[1], quantize.inputs[2]
        attributes = [ir.Attr(a.name, a.type, a.value) for a in quantize.attributes.values()]
        q = ir.Node("", "QuantizeLinear", [product.outputs[0], scale, zp], attributes,
                    name=f"{relu.name}_requantize_q")
        dq = ir.Node("", "DequantizeLinear", [q.outputs[0], scale, zp], name=f"{relu.name}_requantize_dq")
        q.outputs[0].name = f"{product.outputs[0].name}_quantized"
        q.outputs[0].dtype = ir.DataType.UINT8 if zero_point.dtype == np.uint8 else ir.DataType.INT8
        q.outputs[0].shape = product.outputs[0].shape
        dq.outputs[0].name = f"{product.outputs[0].name}_dequantized"
        dq.outputs[0].dtype = product.outputs[0].dtype
        dq.outputs[0].shape = product.outputs[0].shape
        graph.insert_after(product, [q, dq])
        relu.replace_input_with(0, dq.outputs[0])
        n += 1
    return n
