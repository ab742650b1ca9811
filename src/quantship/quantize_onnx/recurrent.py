"""Recurrent layers in integer form, where the target's runtime has a kernel for them.

ONNX Runtime's CPU has one integer recurrent kernel, ``com.microsoft`` ``DynamicQuantizeLSTM``: int8
input and recurrence weights with their scales (per tensor or per output column) stored in the file, the
activations quantized inside the kernel at each run. Static Q/DQ pairs around an ``LSTM`` leave it float,
so each float ``LSTM`` whose W and R are stored becomes that node, weights symmetric int8 within the
placement's bound (``place._weight_qparams``'s rule), the same outputs under the same names. Its layout
differs from ONNX's: W is ``[directions, input_size, 4 * hidden]`` and R ``[directions, hidden, 4 * hidden]``
(ONNX's transposed), the scales ``[directions]`` or ``[directions, 4 * hidden]``. A GRU or RNN, an LSTM the
user keeps float (``--exclude``), an LSTM the target's speed rules keep float (``Target.float_rules``: ONNX
Runtime's integer kernel loses below 64 hidden units), and every LSTM of a target whose runtime has no such
kernel (``Target.integer_recurrent_ops``) stay float, each with its reason in the plan.

``FOLD_PASS`` first turns a W, R or B computed from stored tensors only (the dynamo exporter reorders
PyTorch's gates with Slice and Concat) into one stored tensor, proven like every normalisation pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from quantship.quantize_onnx.normalize import DEFAULT_DOMAINS, Pass
from quantship.quantize_onnx.place import _initializer, _Names, _weight_qparams
from quantship.quantize_onnx.selection import node_label
from quantship.targets import Target

RECURRENT_OPS = ("LSTM", "GRU", "RNN")
INTEGER_FORM = {"LSTM": "DynamicQuantizeLSTM"}  # ONNX op -> ONNX Runtime's com.microsoft integer form
DOMAIN = "com.microsoft"
WEIGHT_INPUTS = (1, 2, 3)  # W, R, B of LSTM, GRU and RNN
MAX_FOLDED_NODES = 64  # a W/R/B computed by more stored-only nodes than this is left as it is


@dataclass(frozen=True)
class RecurrentLayer:
    """One LSTM written as ``DynamicQuantizeLSTM``."""

    node: str
    direction: str
    hidden_size: int
    input_size: int
    per_channel: bool
    weight_bound: int


@dataclass
class RecurrentPlan:
    """The recurrent nodes of a file: those written in integer form, and each one left float with why."""

    layers: list[RecurrentLayer] = field(default_factory=list)
    kept_float: dict[str, str] = field(default_factory=dict)  # node label -> why it stays float
    ops: dict[str, str] = field(default_factory=dict)  # node label -> op type, for every recurrent node

    def as_dict(self) -> dict:
        return {"integer": [layer.node for layer in self.layers], "form": sorted(set(INTEGER_FORM.values())),
                "kept_float": dict(self.kept_float),
                "per_channel": sorted({layer.per_channel for layer in self.layers}),
                "weight_bound": sorted({layer.weight_bound for layer in self.layers}), "summary": self.describe()}

    def describe(self) -> str:
        """One line: how many run as integer kernels, and each one left float with its reason."""
        parts = [f"{len(self.layers)} LSTM as {INTEGER_FORM['LSTM']}"] if self.layers else []
        parts += [f"{label} ({self.ops[label]}) float: {why}" for label, why in self.kept_float.items()]
        return "; ".join(parts)


def _stored(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain in DEFAULT_DOMAINS:
        attr = producer.attributes.get("value")
        return attr.value.numpy() if attr is not None and isinstance(attr.value, ir.TensorProtocol) else None
    return None


def _fold(value: ir.Value, opset: int, budget: list[int]) -> np.ndarray | None:
    """``value`` computed from stored tensors only, in numpy via ONNX's reference kernels (None: it reads an
    input, or takes more than ``MAX_FOLDED_NODES`` nodes)."""
    from onnx.reference import ReferenceEvaluator

    stored = _stored(value)
    if stored is not None:
        return stored
    producer = value.producer()
    if producer is None or producer.domain not in DEFAULT_DOMAINS or any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in producer.attributes.values()):
        return None
    budget[0] -= 1
    if budget[0] < 0:
        return None
    feeds = {}
    for v in producer.inputs:
        if v is None:
            continue
        folded = _fold(v, opset, budget)
        if folded is None:
            return None
        feeds[v.name] = folded
    node = ir.serde.serialize_node(producer)
    outputs = ReferenceEvaluator(node, opsets={"": opset}).run(None, feeds)
    return np.asarray(outputs[[o.name for o in producer.outputs].index(value.name)])


def fold_recurrent_weights(model: ir.Model) -> int:
    """Each W, R or B of a recurrent node computed from stored tensors only becomes a stored tensor."""
    graph = model.graph
    opset = int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1)))
    names = _Names(model)
    changes = 0
    for node in list(graph):
        if node.op_type not in RECURRENT_OPS or node.domain not in DEFAULT_DOMAINS:
            continue
        for k in WEIGHT_INPUTS:
            value = node.inputs[k] if k < len(node.inputs) else None
            if value is None or value.const_value is not None:
                continue
            array = _fold(value, opset, [MAX_FOLDED_NODES])
            if array is None:
                continue
            node.replace_input_with(k, _initializer(graph, names, f"{node.name or node.op_type}_{'WRB'[k - 1]}", array))
            changes += 1
    if changes:
        _drop_unused(graph)
    return changes


def _drop_unused(graph: ir.Graph) -> None:
    """Remove nodes none of whose outputs is read or is a graph output (the folded chains)."""
    outputs = {id(v) for v in graph.outputs}
    removed = True
    while removed:
        removed = False
        for node in reversed(list(graph)):
            if all(not v.uses() and id(v) not in outputs for v in node.outputs):
                graph.remove(node, safe=True)
                removed = True
    for name, value in list(graph.initializers.items()):
        if not value.uses() and value not in graph.inputs:
            del graph.initializers[name]


# "float", not "exact": the folded values are the same bits, but ONNX Runtime pre-packs a stored W and R and
# sums in another order than with computed ones (measured: 2e-8 on a dynamo-exported LSTM)
FOLD_PASS = Pass("fold_recurrent_weights", fold_recurrent_weights, "float",
                 "an LSTM's W and R computed from stored tensors are stored weights the integer form can hold")


def plan(nodes: Sequence[ir.Node], excluded: Iterable[int], p: Target) -> RecurrentPlan:
    """Which recurrent nodes of ``nodes`` (the graph's, in order) run in integer form for ``p``, and why
    each other one stays float; ``excluded``: indices kept float on request."""
    kept = set(excluded)
    result = RecurrentPlan()
    for i, node in enumerate(nodes):
        if node.op_type not in RECURRENT_OPS or node.domain not in DEFAULT_DOMAINS:
            continue
        label = node_label(node, i)
        result.ops[label] = node.op_type
        why = _why_float(node, i in kept, p)
        if why:
            result.kept_float[label] = why
    return result


def _why_float(node: ir.Node, excluded: bool, p: Target) -> str | None:
    op = node.op_type
    if op not in p.integer_recurrent_ops:
        has = ", ".join(INTEGER_FORM[o] for o in p.integer_recurrent_ops)
        return f"{p.consumer} has no integer {op} kernel" + (f" (its only integer recurrent kernel: {has})" if has else "")
    if excluded:
        return "kept float on request (--exclude)"
    if any(_stored(node.inputs[k] if k < len(node.inputs) else None) is None for k in (1, 2)):
        return "its W or R is computed while the model runs, not stored"
    if len(node.inputs) > 3 and node.inputs[3] is not None and _stored(node.inputs[3]) is None:
        return "its bias B is computed while the model runs, not stored"
    w = _stored(node.inputs[1])
    attributes = {k: a.value for k, a in node.attributes.items()}
    slower = next((rule.why for rule in p.float_rules if rule.applies(op, attributes, tuple(w.shape))), None)
    if slower:
        return slower
    if node.inputs[0].dtype not in (None, ir.DataType.FLOAT):
        return f"it reads {node.inputs[0].dtype.name.lower()}: {INTEGER_FORM[op]} reads float32 only"
    if node.attributes.get_int("layout", 0) != 0:
        return f"layout=1 (batch first): {INTEGER_FORM[op]} reads the time-major layout only"
    return None


def integer_indices(nodes: Sequence[ir.Node], plan_: RecurrentPlan) -> list[int]:
    """Indices of the nodes ``plan_`` writes in integer form (before ``rewrite``)."""
    return [i for i, n in enumerate(nodes) if node_label(n, i) in plan_.ops and node_label(n, i) not in plan_.kept_float]


def _quantized(w: np.ndarray, per_channel: bool, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """ONNX's ``[directions, 4 * hidden, k]`` weight as the integer form's ``[directions, k, 4 * hidden]`` int8,
    with its scales (``[directions, 4 * hidden]`` per output column, else ``[directions]``)."""
    columns = np.ascontiguousarray(np.asarray(w, np.float32).transpose(0, 2, 1))
    scales = np.stack([_weight_qparams(d, 1 if per_channel else None, bound) for d in columns]).astype(np.float32)
    shaped = scales[:, None, :] if per_channel else scales.reshape(-1, 1, 1)
    q = np.clip(np.round(columns / shaped), -bound, bound).astype(np.int8)
    return q, scales


def rewrite(model: ir.Model, nodes: Sequence[ir.Node], plan_: RecurrentPlan, *, per_channel: bool,
            weight_bound: int) -> RecurrentPlan:
    """Write each LSTM ``plan_`` keeps integer as ``DynamicQuantizeLSTM`` (``nodes``: the graph's nodes as
    planned, their labels ``plan_``'s); returns ``plan_`` with the layers written."""
    graph = model.graph
    names = _Names(model)
    for i in integer_indices(nodes, plan_):
        old = nodes[i]
        label = node_label(old, i)
        w, r = _stored(old.inputs[1]), _stored(old.inputs[2])
        wq, ws = _quantized(w, per_channel, weight_bound)
        rq, rs = _quantized(r, per_channel, weight_bound)
        base = old.name or old.op_type
        stored = [_initializer(graph, names, f"{base}_{what}", array) for what, array in
                  (("W_quantized", wq), ("R_quantized", rq), ("W_scale", ws), ("W_zero_point", np.zeros_like(ws, np.int8)),
                   ("R_scale", rs), ("R_zero_point", np.zeros_like(rs, np.int8)))]
        optional = [old.inputs[k] if k < len(old.inputs) else None for k in range(3, 8)]  # B, lens, h0, c0, P
        attributes = [a for a in old.attributes.values() if a.name != "layout"]
        new = ir.Node(DOMAIN, INTEGER_FORM[old.op_type], [old.inputs[0], stored[0], stored[1], *optional, *stored[2:]],
                      attributes, num_outputs=len(old.outputs), name=old.name or None)
        ir.convenience.replace_nodes_and_values(graph, old, [old], [new], list(old.outputs), list(new.outputs))
        hidden = old.attributes.get_int("hidden_size", w.shape[1] // 4)
        plan_.layers.append(RecurrentLayer(label, old.attributes.get_string("direction", "forward"), hidden,
                                           int(w.shape[2]), per_channel, weight_bound))
    if plan_.layers:
        model.opset_imports.setdefault(DOMAIN, 1)
        _drop_unused(graph)
    return plan_
