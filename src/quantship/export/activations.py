"""``activation_dtype='uint8'``: activation Q/DQ pairs move to uint8 with zero-point z + 128, same scale (a
16-bit pair, ``int16``, to uint16 with z + 32768).

Weight pairs (a DequantizeLinear reading a stored tensor) keep their int8 zero-point. The move is
exact: saturate(round(x/s) + z + 128, 0, 255) is saturate(round(x/s) + z, -128, 127) + 128, the same
integers read unsigned, and DequantizeLinear subtracts the shifted zero-point back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from quantship.errors import ActivationDtypeRefused
from quantship.inspect.read.counts import QDQ_OPS
from quantship.inspect.read.view import GraphView

SHIFT = 128
# signed activation type -> its unsigned form and the shift between them
UNSIGNED = {np.dtype(np.int8): (np.uint8, SHIFT, ir.DataType.UINT8),
            np.dtype(np.int16): (np.uint16, 32768, ir.DataType.UINT16)}


def _is_stored(value: ir.Value) -> bool:
    producer = value.producer()
    return value.const_value is not None or (producer is not None and producer.op_type == "Constant")


def _signed_zero_point(node: ir.Node) -> np.ndarray:
    zp = node.inputs[2] if len(node.inputs) > 2 else None
    if zp is None or zp.const_value is None:
        raise ActivationDtypeRefused(f"{node.op_type} {node.name!r} has no constant zero-point to shift")
    array = zp.const_value.numpy()
    if array.dtype not in UNSIGNED:
        raise ActivationDtypeRefused(f"{node.op_type} {node.name!r} has a {array.dtype} zero-point; only "
                                     "int8 (and 16-bit int16) activation pairs are moved to uint8 (uint16)")
    return array


def to_uint8_activations(model: ir.Model) -> int:
    """Rewrite every activation Q/DQ pair in place; returns the number of nodes moved."""
    graph = model.graph
    shifted: dict[str, ir.Value] = {}
    old_zero_points: list[ir.Value] = []

    def uint8_of(node: ir.Node) -> ir.Value:
        zp = node.inputs[2]
        if zp.name not in shifted:
            signed = _signed_zero_point(node)
            unsigned, shift, _ = UNSIGNED[signed.dtype]
            array = (signed.astype(np.int32) + shift).astype(unsigned)
            name = f"{zp.name}_{array.dtype.name}"  # _uint8, or _uint16 for a 16-bit pair
            new = ir.Value(name=name, const_value=ir.tensor(array, name=name))
            graph.register_initializer(new)
            shifted[zp.name] = new
            old_zero_points.append(zp)
        return shifted[zp.name]

    n_moved = 0
    for node in list(graph):
        if node.op_type == "QuantizeLinear":
            if _is_stored(node.inputs[0]):
                raise ActivationDtypeRefused(f"QuantizeLinear {node.name!r} quantizes a stored tensor; "
                                             "weights are expected stored as int8 already")
            old = node.inputs[2]
            node.replace_input_with(2, uint8_of(node))
            out = node.outputs[0]
            if out.is_graph_output():
                raise ActivationDtypeRefused(f"QuantizeLinear {node.name!r} feeds a graph output directly")
            out.dtype = UNSIGNED[old.const_value.numpy().dtype][2]
            n_moved += 1
            for consumer in {use.node for use in out.uses()}:
                if consumer.op_type != "DequantizeLinear":
                    raise ActivationDtypeRefused(
                        f"{consumer.op_type} {consumer.name!r} reads the int8 output of QuantizeLinear "
                        f"{node.name!r} directly; only DequantizeLinear consumers can be moved to uint8")
                dq_zp = consumer.inputs[2]
                if dq_zp is not old and not np.array_equal(_signed_zero_point(consumer), old.const_value.numpy()):
                    raise ActivationDtypeRefused(f"DequantizeLinear {consumer.name!r} does not use the zero-point "
                                                 f"of its QuantizeLinear {node.name!r}")
                consumer.replace_input_with(2, node.inputs[2])
                n_moved += 1
        elif node.op_type == "DequantizeLinear":
            source = node.inputs[0].producer()
            if not _is_stored(node.inputs[0]) and (source is None or source.op_type != "QuantizeLinear"):
                raise ActivationDtypeRefused(f"DequantizeLinear {node.name!r} reads neither a stored weight nor a "
                                             "QuantizeLinear; its dtype cannot be moved safely")
    for zp in old_zero_points:
        if not zp.uses() and zp.name in graph.initializers:
            del graph.initializers[zp.name]
    return n_moved


@dataclass(frozen=True)
class GraphState:
    """What the read-back compares of one graph state: its nodes in order, which tensors are stored (initializers,
    ``Constant`` outputs) and the values of the Q/DQ nodes' scales and zero-points, and nothing else: no decoded
    copy of the weights (a large model's read-back held two, one per state, beside the graphs)."""

    nodes: list[onnx.NodeProto]
    stored: frozenset[str]
    parameters: dict[str, np.ndarray]

    @classmethod
    def of_proto(cls, model: onnx.ModelProto) -> GraphState:
        graph = model.graph
        view = GraphView(model=model, nodes=list(graph.node))
        view.initializers = {t.name: t for t in graph.initializer}
        view.producer = {out: index for index, node in enumerate(view.nodes) for out in node.output if out}
        stored = {*view.initializers, *(n.output[0] for n in view.nodes if n.op_type == "Constant" and n.output)}
        names = {i for n in view.nodes if n.op_type in QDQ_OPS for i in n.input[1:3] if i}
        return cls(view.nodes, frozenset(stored), {k: v for k in names if (v := view.value(k)) is not None})

    @classmethod
    def of_ir(cls, model: ir.Model) -> GraphState:
        """The state of ``model`` read off the in-memory graph, without serialising it (its weights)."""
        nodes = list(model.graph)
        stored = {*model.graph.initializers, *(v.name for n in nodes if n.op_type == "Constant" for v in n.outputs)}
        parameters: dict[str, np.ndarray] = {}
        for node in nodes:
            if node.op_type in QDQ_OPS:
                for value in node.inputs[1:3]:
                    if value is not None and (array := _constant(value)) is not None:
                        parameters[value.name] = array
        return cls([ir.serde.serialize_node(n) for n in nodes], frozenset(stored), parameters)


def _constant(value: ir.Value) -> np.ndarray | None:
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].as_tensor().numpy()
    return None


def sixteen_bit_values(model: onnx.ModelProto) -> list[str]:
    """The values a QuantizeLinear with a 16-bit zero-point reads, in graph order (the file's 16-bit activations)."""
    state = GraphState.of_proto(model)
    return [n.input[0] for n in state.nodes if n.op_type == "QuantizeLinear" and len(n.input) > 2
            and getattr(state.parameters.get(n.input[2]), "dtype", None) in (np.int16, np.uint16)]


def check_read_back(before: GraphState, after: GraphState) -> int:
    """Node by node: only activation zero-points changed, each to z + 128 as uint8; returns nodes moved."""
    a_nodes, b_nodes = before.nodes, after.nodes
    if [n.op_type for n in a_nodes] != [n.op_type for n in b_nodes]:
        raise ActivationDtypeRefused("uint8 read-back: the operator sequence changed")
    a_consts, b_consts = before.parameters, after.parameters
    moved = 0
    for old, new in zip(a_nodes, b_nodes):
        same_io = list(old.output) == list(new.output) and old.attribute == new.attribute
        if old.op_type not in QDQ_OPS:
            if not same_io or list(old.input) != list(new.input):
                raise ActivationDtypeRefused(f"uint8 read-back: {old.op_type} {old.name!r} changed")
            continue
        if not same_io or list(old.input[:2]) != list(new.input[:2]):
            raise ActivationDtypeRefused(f"uint8 read-back: {old.op_type} {old.name!r} changed beyond its zero-point")
        if not np.array_equal(a_consts[old.input[1]], b_consts[new.input[1]]):
            raise ActivationDtypeRefused(f"uint8 read-back: the scale of {old.op_type} {old.name!r} changed")
        zp_old, zp_new = a_consts[old.input[2]], b_consts[new.input[2]]
        if zp_new.dtype == np.int8:
            if old.input[0] not in before.stored or not np.array_equal(zp_old, zp_new):
                raise ActivationDtypeRefused(f"uint8 read-back: activation {old.op_type} {old.name!r} is still int8")
            continue
        unsigned, shift, _ = UNSIGNED.get(zp_old.dtype, (None, 0, None))
        if zp_new.dtype != unsigned or not np.array_equal(zp_old.astype(np.int32) + shift, zp_new.astype(np.int32)):
            raise ActivationDtypeRefused(f"uint8 read-back: {old.op_type} {old.name!r} zero-point is not z + {shift or 128} "
                                         "in its unsigned type")
        moved += 1
    return moved
