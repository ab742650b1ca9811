"""Activation Q/DQ pairs no integer kernel reads, dropped from a QDQ file for a runtime that runs mixed graphs.

The PyTorch path's annotator quantizes every op it has a rule for; the ONNX path places a pair only where an
integer kernel reads or writes it (``roles``: weighted ops with an int8 weight, data movement, the ops ONNX
Runtime has integer kernels for when every input is quantized, a Relu/Clip folded into the integer op before
it). A pair between two ops that both run in float (a hard swish feeding a depthwise Conv a target's float
rule keeps float) only adds a rounding and two kernels: ``drop_float_pairs`` reads it through, judged by that
role table, node by node on the exported graph. Not exact: a rounding goes (``export.qdq.FloatPairsPass``).
"""

from __future__ import annotations

import onnx_ir as ir

from quantship.export.ir_edit import drop_unused_initializers
from quantship.export.roles import role_of

INTEGER_ROLES = ("shared", "concat", "integer_capable")


def _dequantized(value: ir.Value | None) -> bool:
    """Read through a DequantizeLinear (of an activation's pair or of a stored integer tensor)."""
    producer = value.producer() if value is not None else None
    return producer is not None and producer.op_type == "DequantizeLinear"


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
