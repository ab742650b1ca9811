"""Activation Q/DQ pairs no integer kernel reads, dropped from a QDQ file for a runtime that runs mixed graphs.

The PyTorch path's annotator quantizes every op it has a rule for; the ONNX path places a pair only where an
integer kernel reads or writes it (``roles``: weighted ops with an int8 weight, data movement, the ops ONNX
Runtime has integer kernels for when every input is quantized, a Relu/Clip folded into the integer op before
it). A pair between two ops that both run in float (a hard swish feeding a depthwise Conv a target's float
rule keeps float) only adds a rounding and two kernels: ``drop_float_pairs`` reads it through, judged by that
role table, node by node on the exported graph. Not exact: a rounding goes (``export.qdq.FloatPairsPass``).

A conv/linear whose activation input stays float (it reads a module kept float) but whose weight is dequantized
from a stored integer tensor runs as a float kernel plus a DequantizeLinear on every call: ``store_float_weights``
stores the values that DequantizeLinear computes instead (``export.qdq.FloatInputWeightPass``: exact, the same
float32 products).

ONNX Runtime (1.21 and later, at its default optimizations) quantizes the float weight of a Conv, ConvTranspose
or Gemm itself, symmetric int8 per tensor, when the op reads a per-tensor DequantizeLinear and its one output path
(through Relu or Clip) ends in a QuantizeLinear, and then runs it as an integer kernel: a conv kept float on
request, by the fidelity repair or by a target's float rule would run with per-tensor int8 weights (a 60 dB
channel span lost, a slow depthwise kernel chosen again). ``float_reads_per_axis`` gives each such op its own
DequantizeLinear with the scale and zero-point repeated along the channel axis: the same values bit for bit, no
longer a per-tensor pair that rewrite takes, so the op runs in float as the file says
(``Target.quantizes_float_convs``; ``export.qdq.FloatReadsPass``, ``quantize_onnx.quantizer``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quantship.export.ir_edit import drop_unused_initializers, fresh_initializer
from quantship.export.roles import role_of

INTEGER_ROLES = ("shared", "concat", "integer_capable")


def _dequantized(value: ir.Value | None) -> bool:
    """Read through a DequantizeLinear (of an activation's pair or of a stored integer tensor)."""
    producer = value.producer() if value is not None else None
    return producer is not None and producer.op_type == "DequantizeLinear"


def _stored_float_pays(reader: ir.Node) -> bool:
    """A weight read by ``reader`` is better stored as floats: its activation input is float, or (a MatMul) 16-bit
    (``int16``). ONNX Runtime 1.32 at its default optimizations turns DequantizeLinear(int8 weight) -> MatMul with
    a 16-bit input into MatMulNBits, which re-quantizes that input to 8 bits per block; a Conv or Gemm between a
    16-bit pair keeps its int8 weight (run in float, exactly), for ONNX Runtime would quantize a float one per
    tensor (its weight and bias quantization of a float op between a DequantizeLinear and a QuantizeLinear)."""
    value = reader.inputs[0]
    if not _dequantized(value):
        return True
    wide = (ir.DataType.INT16, ir.DataType.UINT16)
    typed = [v for v in value.producer().inputs[::2] if v is not None]  # the quantized input and the zero-point
    return reader.op_type == "MatMul" and any(
        v.dtype in wide or (v.const_value is not None and v.const_value.dtype in wide) for v in typed)


# the ops whose float weight ONNX Runtime quantizes between a per-tensor DequantizeLinear and a QuantizeLinear
WEIGHT_QUANTIZED_BY_RUNTIME = ("Conv", "ConvTranspose", "Gemm")


def _one_path_to_quantize(node: ir.Node) -> bool:
    """``node``'s one output reaches a QuantizeLinear through single-reader Relu / Clip ops only."""
    while len(node.outputs) == 1 and not node.outputs[0].is_graph_output():
        uses = list(node.outputs[0].uses())
        if len(uses) != 1:
            return False
        node = uses[0].node
        if node.op_type == "QuantizeLinear":
            return True
        if node.op_type not in ("Relu", "Clip"):
            return False
    return False


def _channels(node: ir.Node, weight: np.ndarray) -> int | None:
    """The size of axis 1 of ``node``'s activation input, read off its weight (None when it cannot be)."""
    if node.op_type == "Conv" and weight.ndim >= 3:
        return weight.shape[1] * node.attributes.get_int("group", 1)
    if node.op_type == "ConvTranspose" and weight.ndim >= 3:
        return weight.shape[0]
    if node.op_type == "Gemm" and weight.ndim == 2 and not node.attributes.get_int("transA", 0):
        return weight.shape[1] if node.attributes.get_int("transB", 0) else weight.shape[0]
    return None


def float_reads_per_axis(model: ir.Model) -> int:
    """Each float Conv / ConvTranspose / Gemm that ONNX Runtime would quantize itself (module docstring) reads its
    input through its own DequantizeLinear whose scale and zero-point are repeated along axis 1; returns how many.
    Exact: the same products as the per-tensor DequantizeLinear it replaces for that reader."""
    graph, changed = model.graph, 0
    if int(model.opset_imports.get("", 0)) < 13:  # per-axis DequantizeLinear: opset 13
        return 0
    reads: dict[str, ir.Value] = {}  # one read per tensor: its readers share it (axis 1 is the tensor's channels)
    for node in [n for n in graph if n.op_type in WEIGHT_QUANTIZED_BY_RUNTIME and n.domain in ("", "ai.onnx")]:
        x, w = (node.inputs[0], node.inputs[1]) if len(node.inputs) > 1 else (None, None)
        dq = x.producer() if x is not None else None
        if dq is None or dq.op_type != "DequantizeLinear" or w is None or w.const_value is None:
            continue  # a weight read through a DequantizeLinear is an integer kernel's, as written
        given = [v for v in dq.inputs[1:3] if v is not None]
        stored = [v.const_value.numpy() for v in given if v.const_value is not None]
        channels = _channels(node, w.const_value.numpy())
        if len(stored) != len(given) or not stored or any(a.size != 1 for a in stored) or channels is None \
                or not _one_path_to_quantize(node):
            continue
        if x.name not in reads:
            per_axis = [fresh_initializer(graph, f"{x.name}_{what}_per_axis", np.full(channels, a.item(), a.dtype),
                                          a.dtype) for what, a in zip(("scale", "zero_point"), stored)]
            read = ir.node("DequantizeLinear", [dq.inputs[0], *per_axis], attributes={"axis": 1},
                           name=f"{node.name}_float_read")
            read.outputs[0].name, read.outputs[0].type, read.outputs[0].shape = f"{x.name}_float_read", x.type, x.shape
            graph.insert_before(node, read)
            reads[x.name] = read.outputs[0]
        node.replace_input_with(0, reads[x.name])
        changed += 1
    return changed


def _integer(node: ir.Node) -> bool:
    """``node`` runs as an integer kernel when its pairs stay (the role table's rules, on a QDQ graph)."""
    role = role_of(node.op_type, node.domain)
    if role == "weighted":
        return len(node.inputs) > 1 and _dequantized(node.inputs[1])
    if role == "fused_activation":
        producer = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
        return producer is not None and role_of(producer.op_type, producer.domain) in ("weighted", "integer_capable") \
            and _integer(producer)  # the integer kernel clamps: the pair after it is the kernel's output
    if role in INTEGER_ROLES:
        return all(v is None or _dequantized(v) for v in node.inputs[:1 if role == "shared" else None])
    return False


def drop_float_pairs(model: ir.Model) -> int:
    """Read through every activation pair whose producer and readers all run in float; returns how many."""
    graph = model.graph
    dropped = []
    for q in [n for n in graph if n.op_type == "QuantizeLinear"]:
        x = q.inputs[0]
        dqs = [u.node for u in q.outputs[0].uses()]
        if x is None or q.outputs[0].is_graph_output() or not dqs or any(
                d.op_type != "DequantizeLinear" or d.outputs[0].is_graph_output() for d in dqs):
            continue
        producer = x.producer()
        if producer is None or producer.op_type == "DequantizeLinear" or _integer(producer):
            continue
        if any(_integer(u.node) for d in dqs for u in d.outputs[0].uses()):
            continue
        dropped.append((q, dqs))
    for q, dqs in dropped:  # judged on the graph as exported, then dropped
        for d in dqs:
            d.outputs[0].replace_all_uses_with(q.inputs[0])
        graph.remove([*dqs, q], safe=True)
    if dropped:
        drop_unused_initializers(graph)
    return len(dropped)


def _stored_dequantize(value: ir.Value) -> np.ndarray | None:
    """The float32 values a DequantizeLinear of stored 8-bit integers computes ((q - zero point) * scale, one
    product each, as ONNX Runtime computes it), or None when ``value`` is not such an output (blocked, another
    type, inputs computed at run time)."""
    dq = value.producer()
    if dq is None or dq.op_type != "DequantizeLinear" or dq.attributes.get_int("block_size", 0):
        return None
    arrays = [v.const_value.numpy() if v is not None and v.const_value is not None else None for v in dq.inputs]
    if len(arrays) < 2 or arrays[0] is None or arrays[1] is None or arrays[0].dtype not in (np.int8, np.uint8) \
            or arrays[1].dtype != np.float32 or (len(arrays) > 2 and dq.inputs[2] is not None and arrays[2] is None):
        return None
    q, scale = arrays[0].astype(np.int32), arrays[1]
    zp = arrays[2].astype(np.int32) if len(arrays) > 2 and arrays[2] is not None else np.zeros((), np.int32)
    if scale.ndim == 1 and scale.size > 1:
        axis = dq.attributes.get_int("axis", 1) % q.ndim
        shape = [1] * q.ndim
        shape[axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape) if zp.ndim else zp
    return (q - zp).astype(np.float32) * scale


def store_float_weights(model: ir.Model) -> int:
    """Every weight dequantized only for weighted ops whose activation input is float (or a MatMul's 16-bit input,
    ``_stored_float_pays``), stored as the float values its DequantizeLinear computes; returns how many."""
    graph, stored = model.graph, 0
    for dq in [n for n in graph if n.op_type == "DequantizeLinear"]:
        out = dq.outputs[0]
        uses = list(out.uses())
        if not uses or out.is_graph_output() or any(  # read only as the weight of ops whose input is float
                u.idx != 1 or role_of(u.node.op_type, u.node.domain) != "weighted" or not _stored_float_pays(u.node)
                for u in uses):
            continue
        values = _stored_dequantize(out)
        if values is None:
            continue
        out.replace_all_uses_with(fresh_initializer(graph, f"{out.name}_float", values))
        graph.remove(dq, safe=True)
        stored += 1
    if stored:
        drop_unused_initializers(graph)
    return stored
