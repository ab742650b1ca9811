"""Placement: which tensors get a Q/DQ pair and who reads it (``plan``), then the pairs written with
onnx_ir (``insert``).

``plan`` reads the role table (``roles``) node by node and grows the set of quantized tensors to a
fixed point: the inputs and outputs of weighted ops first, then data-movement ops whose output is
quantized (their input joins, tied to the same scale), then ops with integer kernels whose output
is quantized (their inputs join: a float op's value unless another float reader would dequantize it,
and an Add's or a Mul's stored operand, kept per tensor: ``_operands``). A tensor produced by an op
that now runs on integers exists only quantized (every consumer reads its DequantizeLinear); one
produced by a float op keeps its float value for float consumers. ``full`` placement quantizes every float activation except its float
islands (``ISLAND_RULES``: each named, applied node by node and listed in the plan with its reason).
A Gather reading a stored table by computed indices is a table read (``tables``): its output is
quantized under the table's own scale, and the table stored in 8 bits.
A detector's post-processing (``detection_postprocess``) is an island in either placement: no pair joins it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from quantship.export.roles import Placement, data_inputs, role_of, runs_faster_in_float, weight_axis
from quantship.inspect.read.islands import Op, detection_postprocess, normalisation_statistics, polynomial_interiors
from quantship.quantize_onnx.calibrate import QMIN, TensorInfo, TensorObserver, shared_qparams
from quantship.quantize_onnx.float_islands import (
    CONCAT_TIE_RATIO,
    ISLAND_RULES,
    op_record,
    range_ratio,
    release_split_range_outputs,
)
from quantship.quantize_onnx.selection import node_label
from quantship.quantize_onnx.tables import TABLE_BOUND, read_table, tie_to_tables, write_tables

FLOAT_DTYPES = (np.dtype(np.float32),)  # activations the int8 grid replaces (float16/64 stay as they are)
@dataclass
class Plan:
    """The Q/DQ layout: quantized tensors, the edges that read them quantized, tied tensors, weights."""

    tensors: list[str] = field(default_factory=list)  # in graph order
    readers: set[tuple[int, int]] = field(default_factory=set)  # (node index, input index)
    integer_nodes: set[int] = field(default_factory=set)  # nodes that run on quantized inputs and output
    weighted: list[int] = field(default_factory=list)  # nodes whose stored weight is quantized
    tables: list[int] = field(default_factory=list)  # Gathers whose stored table is quantized (``tables``)
    operands: list[tuple[int, int]] = field(default_factory=list)  # stored Add/Mul operands, per tensor
    ties: list[tuple[str, ...]] = field(default_factory=list)  # tensors that share one scale
    concat_ties: list[tuple[str, ...]] = field(default_factory=list)  # tied only when ranges are close
    roles: collections.Counter = field(default_factory=collections.Counter)
    kept_float: dict[str, str] = field(default_factory=dict)  # weighted node -> why it stays float
    islands: dict[str, str] = field(default_factory=dict)  # tensor left float in a full placement -> rule id
    output_concats: dict[str, tuple[str, ...]] = field(default_factory=dict)  # graph-output Concat: out -> ins
    forced_ties: dict[str, tuple[str, ...]] = field(default_factory=dict)  # Concat given one scale on request -> tied
    nodes: list[ir.Node] = field(default_factory=list, repr=False)  # the graph's nodes when planned

    def as_dict(self) -> dict:
        return {"n_tensors": len(self.tensors), "n_reads": len(self.readers), "n_weighted": len(self.weighted),
                "weighted_nodes": [node_label(self.nodes[i], i) for i in self.weighted] if self.nodes else [],
                "n_tables": len(self.tables), "n_operands": len(self.operands),
                "n_integer_nodes": len(self.integer_nodes), "roles": dict(self.roles),
                "kept_float": dict(self.kept_float), "float_islands": self.islands_by_rule(),
                "shared_scale": list(self.forced_ties)}

    def islands_by_rule(self) -> dict[str, dict]:
        """Each island rule that applied: why, and the tensors it left float."""
        found: dict[str, list[str]] = collections.defaultdict(list)
        for tensor, rule in self.islands.items():
            found[rule].append(tensor)
        return {rule: {"why": ISLAND_RULES[rule], "tensors": tensors} for rule, tensors in found.items()}


class _Graph:
    """Indexes over the model for the planner: node positions, constants, float activations."""

    def __init__(self, model: ir.Model, info: dict[str, TensorInfo]):
        self.graph = model.graph
        self.nodes = list(model.graph)
        self.index = {id(n): i for i, n in enumerate(self.nodes)}
        self.info = info
        constant = {v.name for v in model.graph.initializers.values()}
        for node in self.nodes:
            ins = [v for v in node.inputs if v is not None]
            if ins and all(v.name in constant for v in ins) or (not ins and node.op_type == "Constant"):
                constant.update(o.name for o in node.outputs)
        self.constant = constant

    def is_activation_name(self, name: str) -> bool:
        seen = self.info.get(name)
        return bool(name) and name not in self.constant and seen is not None and seen.dtype in FLOAT_DTYPES

    def ops(self) -> list[Op]:
        return [op_record(n) for n in self.nodes]

    def is_activation(self, value: ir.Value | None) -> bool:
        """A float tensor computed from the inputs (not a weight, not shape arithmetic on constants)."""
        if value is None or not value.name or value.name in self.constant:
            return False
        seen = self.info.get(value.name)
        return seen is not None and seen.dtype in FLOAT_DTYPES

    def consumers(self, value: ir.Value) -> list[tuple[int, int]]:
        return [(self.index[id(u.node)], u.idx) for u in value.uses() if id(u.node) in self.index]

    def producer_index(self, value: ir.Value) -> int | None:
        producer = value.producer()
        return None if producer is None else self.index.get(id(producer))


def _output_point(g: _Graph, node: ir.Node, excluded: set[int]) -> ir.Value:
    """Where a weighted op's result is quantized: past a Relu/Clip that is its only consumer."""
    out = node.outputs[0]
    uses = out.uses()
    if len(uses) == 1 and not out.is_graph_output():
        nxt = uses[0].node
        i = g.index.get(id(nxt))
        if i is not None and i not in excluded and role_of(nxt.op_type, nxt.domain) == "fused_activation" \
                and uses[0].idx == 0 and all(v is None or v.name in g.constant for v in nxt.inputs[1:]):
            return nxt.outputs[0]
    return out


INTEGER_READER_ROLES = ("weighted", "shared", "concat", "integer_capable", "fused_activation", "table")


def _stored_operand(node: ir.Node, value: ir.Value | None) -> bool:
    """A float initializer an Add or a Mul reads (``x * a + b``): stored per tensor beside its integer kernel."""
    return (node.op_type in ("Add", "Mul") and value is not None and value.const_value is not None
            and not value.is_graph_input() and value.const_value.dtype == ir.DataType.FLOAT)


def _read_in_float(g: _Graph, value: ir.Value, reader: int) -> bool:
    """Another consumer of ``value`` than ``reader`` computes in float (or the value is a graph output): a pair
    on it would make that consumer read it through a DequantizeLinear."""
    if value.is_graph_output():
        return True
    return any(j != reader and role_of(g.nodes[j].op_type, g.nodes[j].domain) not in INTEGER_READER_ROLES
               for j, _ in g.consumers(value))


def _adds_bias(value: ir.Value, constant: set[str]) -> bool:
    """A constant is added to ``value``: ONNX Runtime then folds the MatMul and its Add into a Gemm
    before its QDQ fusions run (2-D, and N-D with static shapes: a BERT encoder's projections at batch 1),
    and that Gemm, with a float result, stays float: it runs on dequantized weights."""
    return any(u.node.op_type == "Add" and any(v is not None and v.name in constant for v in u.node.inputs)
               for u in value.uses())


def plan(model: ir.Model, info: dict[str, TensorInfo], placement: Placement, excluded: set[int],
         shared: set[int] = frozenset()) -> Plan:
    """Decide the layout for ``placement`` (see the module docstring). ``shared``: Concat nodes whose
    inputs and output are quantized with one scale whatever their ranges (``shared_scale``)."""
    g = _Graph(model, info)
    quantized: dict[str, None] = {}
    result = Plan(nodes=g.nodes)
    ties: list[tuple[str, ...]] = []

    def want(value: ir.Value) -> None:
        quantized.setdefault(value.name, None)

    def join(i: int, ins: list[tuple[int, ir.Value]], outs: list[ir.Value]) -> tuple[str, ...]:
        """Node ``i`` moves integers: its data inputs (read quantized) and outputs join, as one tie."""
        for k, v in ins:
            want(v)
            result.readers.add((i, k))
        for o in outs:
            want(o)
        result.integer_nodes.add(i)
        return tuple(dict.fromkeys([v.name for _, v in ins] + [o.name for o in outs]))

    fused_relu: set[int] = set()
    for i, node in enumerate(g.nodes):
        if i in excluded:
            continue
        role = role_of(node.op_type, node.domain)
        if role != "weighted" or not node.outputs or not g.is_activation(node.outputs[0]):
            continue
        x = node.inputs[0] if node.inputs else None
        w = node.inputs[1] if len(node.inputs) > 1 else None
        if not g.is_activation(x) or w is None:
            continue
        if w.const_value is not None and w.const_value.dtype == ir.DataType.FLOAT:
            attrs = {k: a.value for k, a in node.attributes.items()}
            why = runs_faster_in_float(placement, node.op_type, attrs, tuple(w.const_value.shape))
            if why is not None:
                result.kept_float[node_label(node, i)] = why
                continue
            result.weighted.append(i)
            result.roles[f"weighted:{node.op_type}"] += 1
            reads = [0]
        elif node.op_type == "MatMul" and g.is_activation(w):
            result.roles["matmul"] += 1
            reads = [0, 1]
        else:
            continue
        for k in reads:
            want(node.inputs[k])
            result.readers.add((i, k))
        point = _output_point(g, node, excluded)
        if point is not node.outputs[0]:
            fused_relu.add(g.index[id(point.producer())])
        float_result = node.op_type in placement.float_output_ops and placement.mode != "full"
        if not float_result or _adds_bias(point, g.constant):
            want(point)  # otherwise quantized only if a reader needs it (the fixed point below decides)
        result.integer_nodes.add(i)
    result.integer_nodes |= fused_relu
    for i, node in enumerate(g.nodes):
        if i not in excluded and read_table(node, g.constant) is not None and g.is_activation(node.outputs[0]):
            result.tables.append(i)
            want(node.outputs[0])
            result.integer_nodes.add(i)
            result.roles[f"table:{node.op_type}"] += 1

    ops = g.ops()
    postprocess = {n for n in detection_postprocess(ops, g.is_activation_name) if n not in quantized}
    result.islands.update(dict.fromkeys(sorted(postprocess), "detection_postprocess"))
    statistics: set[str] = set(postprocess)  # in either placement: no pair joins it
    if placement.mode == "full":
        norms = normalisation_statistics(ops, g.is_activation_name) - statistics
        result.islands.update(dict.fromkeys(sorted(norms), "normalisation_statistics"))
        statistics |= norms
        interiors = polynomial_interiors(ops, g.is_activation_name) - statistics
        result.islands.update(dict.fromkeys(sorted(interiors), "polynomial_interior"))
        statistics |= interiors
        for i, node in enumerate(g.nodes):
            if i in excluded:
                continue
            if node.op_type == "Concat" and any(o.is_graph_output() for o in node.outputs):
                result.output_concats[node.outputs[0].name] = tuple(v.name for v in node.inputs
                                                                    if g.is_activation(v))
            for k, v in enumerate(node.inputs):
                if not g.is_activation(v) or v.name in statistics:
                    continue
                producer = g.producer_index(v)
                if producer in result.weighted and i in fused_relu:
                    continue  # the weighted op's Relu: the point is after it
                want(v)
                result.readers.add((i, k))
        for v in g.graph.outputs:
            if g.is_activation(v) and v.name not in statistics:
                want(v)

    for i in sorted(shared - excluded):
        node = g.nodes[i]
        ins = [(k, v) for k, v in enumerate(node.inputs) if g.is_activation(v) and v.name not in statistics]
        outs = [o for o in node.outputs if g.is_activation(o)]
        members = join(i, ins, outs)
        ties.append(members)
        result.roles["concat:shared_scale"] += 1
        result.forced_ties[node_label(node, i)] = members

    changed = True
    while changed:
        changed = False
        for i, node in enumerate(g.nodes):
            if i in excluded or i in result.integer_nodes:
                continue
            role = role_of(node.op_type, node.domain)
            ins = [(k, node.inputs[k]) for k in data_inputs(node.op_type, len(node.inputs))
                   if g.is_activation(node.inputs[k])]
            outs = [o for o in node.outputs if g.is_activation(o)]
            if not ins or not outs or any(o.name in statistics for o in outs):
                continue
            if role in ("shared", "concat"):
                if not any(o.name in quantized for o in outs) and placement.mode != "full":
                    continue
                (result.concat_ties if role == "concat" else ties).append(join(i, ins, outs))
                result.roles[role] += 1
                changed = True
            elif role == "integer_capable":
                all_inputs = [v for v in node.inputs if v is not None]
                stored = [(k, v) for k, v in enumerate(node.inputs) if _stored_operand(node, v)]
                if placement.mode == "full":
                    stored = []  # every value is paired there already: the file's layout stays as it was
                if len(all_inputs) != len(ins) + len(stored):
                    continue  # another operand: ONNX Runtime fuses only when every input is quantized
                point = _output_point(g, node, excluded)
                if point.name not in quantized:
                    continue
                # an input without a pair gets one when no other float reader would then dequantize it (the
                # PyTorch path's rule: ``QuantshipQuantizer._pairs_where_integer_kernels_read``)
                if not all(v.name in quantized or (placement.mode != "full" and not _read_in_float(g, v, i))
                           for _, v in ins):
                    continue
                for k, v in ins:
                    want(v)
                    result.readers.add((i, k))
                result.operands.extend((i, k) for k, _ in stored)
                result.integer_nodes.add(i)
                if point is not node.outputs[0]:
                    result.integer_nodes.add(g.index[id(point.producer())])
                result.roles[f"integer:{node.op_type}"] += 1
                changed = True

    # a tensor produced by an integer node exists only quantized: every consumer reads the pair
    for name in quantized:
        value = _value(g, name)
        producer = g.producer_index(value) if value is not None else None
        if value is not None and (placement.mode == "full" or producer in result.integer_nodes):
            for edge in g.consumers(value):
                result.readers.add(edge)
    result.tensors = [n for n in quantized if _value(g, n) is not None]
    result.ties = ties
    return result


def _value(g: _Graph, name: str) -> ir.Value | None:
    for v in g.graph.inputs:
        if v.name == name:
            return v
    cache = getattr(g, "_values", None)
    if cache is None:
        cache = {o.name: o for n in g.nodes for o in n.outputs if o.name}
        g._values = cache
    return cache.get(name)


def group_qparams(p: Plan, observers: dict[str, TensorObserver], symmetric: bool) -> dict[str, tuple[float, int]]:
    """(scale, int8 zero-point) per quantized tensor; tied tensors share the union of their ranges. A
    full placement's split-range output Concats are released first (``release_split_range_outputs``);
    a table read's output group takes the table's scale where it fits (``tables.tie_to_tables``)."""
    release_split_range_outputs(p, observers, symmetric)
    parent = {n: n for n in p.tensors}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def union(members: Iterable[str]) -> None:
        members = [m for m in members if m in parent]
        for m in members[1:]:
            parent[find(m)] = find(members[0])

    for members in p.ties:
        union(members)
    for members in p.concat_ties:
        ratio = range_ratio(members, observers, symmetric)
        if ratio is not None and ratio <= CONCAT_TIE_RATIO:
            union(members)
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for n in p.tensors:
        groups[find(n)].append(n)
    out: dict[str, tuple[float, int]] = {}
    for members in groups.values():
        qp = shared_qparams([observers[m] for m in members], symmetric)
        for m in members:
            out[m] = qp
    if p.tables:
        tie_to_tables(p.nodes, p.tables, list(groups.values()), out, observers, TABLE_BOUND)
    return out


# --- writing the pairs -----------------------------------------------------------------------

class _Names:
    """Fresh, readable names: ``{tensor}_{suffix}``, numbered only on a clash."""

    def __init__(self, model: ir.Model):
        self.used = {v.name for v in model.graph.initializers.values()} | {v.name for v in model.graph.inputs}
        for node in model.graph:
            self.used.update(o.name for o in node.outputs if o.name)
            if node.name:
                self.used.add(node.name)

    def __call__(self, base: str) -> str:
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return name


def _initializer(graph: ir.Graph, names: _Names, base: str, array: np.ndarray) -> ir.Value:
    name = names(base)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def _stored_zero(zero: int, dtype: str) -> np.ndarray:
    if dtype == "uint8":
        return np.array(zero - QMIN, dtype=np.uint8)  # same scale, zero-point + 128
    return np.array(zero, dtype=np.int8)


def insert(model: ir.Model, p: Plan, qparams: dict[str, tuple[float, int]], placement: Placement) -> dict[str, int]:
    """Write the activation pairs, the weight and bias DequantizeLinear nodes; returns counts."""
    graph = model.graph
    names = _Names(model)
    nodes = p.nodes
    dq_of: dict[str, ir.Value] = {}
    by_value = {o.name: o for n in nodes for o in n.outputs if o.name}
    by_value.update({v.name: v for v in graph.inputs})
    qtype = ir.DataType.UINT8 if placement.activation_dtype == "uint8" else ir.DataType.INT8
    outputs = list(graph.outputs)
    for name in p.tensors:
        value = by_value[name]
        scale, zero = qparams[name]
        s = _initializer(graph, names, f"{name}_scale", np.array(scale, dtype=np.float32))
        z = _initializer(graph, names, f"{name}_zero_point", _stored_zero(zero, placement.activation_dtype))
        q = ir.Node("", "QuantizeLinear", [value, s, z], name=names(f"{name}_QuantizeLinear"))
        dq = ir.Node("", "DequantizeLinear", [q.outputs[0], s, z], name=names(f"{name}_DequantizeLinear"))
        q.outputs[0].name, q.outputs[0].dtype, q.outputs[0].shape = names(f"{name}_quantized"), qtype, value.shape
        dq.outputs[0].name = names(f"{name}_dequantized")
        dq.outputs[0].dtype, dq.outputs[0].shape = ir.DataType.FLOAT, value.shape
        producer = value.producer()
        if producer is None:
            graph.insert_before(nodes[0], [q, dq])
        else:
            graph.insert_after(producer, [q, dq])
        dq_of[name] = dq.outputs[0]
    n_reads = 0
    for i, k in sorted(p.readers):
        value = nodes[i].inputs[k]
        if value is not None and value.name in dq_of:
            nodes[i].replace_input_with(k, dq_of[value.name])
            n_reads += 1
    for position, value in enumerate(outputs):  # a quantized graph output is read through its pair, name kept
        if value.name in dq_of and _read_quantized_everywhere(value, dq_of[value.name]):
            dq_out, name = dq_of[value.name], value.name
            value.name = names(f"{name}_float")
            dq_out.name = name
            graph.outputs[position] = dq_out
    n_tables = write_tables(nodes, p.tables, qparams, TABLE_BOUND,
                            lambda zero: _stored_zero(zero, placement.activation_dtype),
                            lambda base, array: _initializer(graph, names, base, array), names, graph)
    n_operands = _operands(model, p, placement, names)
    n_weights = _weights(model, p, placement, names)
    return {"activation_pairs": len(p.tensors), "reads": n_reads, "weights": n_weights, "tables": n_tables,
            "operands": n_operands}


def _read_quantized_everywhere(value: ir.Value, dq_out: ir.Value) -> bool:
    """Every consumer but the pair's own QuantizeLinear reads the DequantizeLinear (an integer producer)."""
    return all(u.node.op_type == "QuantizeLinear" for u in value.uses())


def _weight_qparams(w: np.ndarray, axis: int | None, bound: int) -> np.ndarray:
    """Symmetric scales (per channel on ``axis``, or one), the PyTorch path's weight observer rule."""
    import torch
    from torchao.quantization.pt2e import MinMaxObserver, PerChannelMinMaxObserver

    if axis is None:
        obs = MinMaxObserver(dtype=torch.int8, quant_min=-bound, quant_max=bound, qscheme=torch.per_tensor_symmetric)
    else:
        obs = PerChannelMinMaxObserver(ch_axis=axis, dtype=torch.int8, quant_min=-bound, quant_max=bound,
                                       qscheme=torch.per_channel_symmetric)
    obs(torch.from_numpy(np.array(w, dtype=np.float32)))  # a writable copy
    scale, _ = obs.calculate_qparams()
    return scale.numpy().astype(np.float32).reshape(-1 if axis is not None else ())


def _operands(model: ir.Model, p: Plan, placement: Placement, names: _Names) -> int:
    """Each stored Add/Mul operand of an integer node through its own DequantizeLinear: per tensor, symmetric on
    the weights' bound, in the activations' type (ONNX Runtime's QLinearAdd/QLinearMul read both inputs in one
    type: uint8 with zero-point 128 beside uint8 activations, as the PyTorch path stores them)."""
    graph = model.graph
    for i, k in p.operands:
        node = p.nodes[i]
        value = node.inputs[k]
        array = value.const_value.numpy()
        scale = _weight_qparams(array, None, placement.weight_bound)
        q = np.clip(np.rint(array / scale), -placement.weight_bound, placement.weight_bound)
        shift = 128 if placement.activation_dtype == "uint8" else 0
        dtype = np.uint8 if shift else np.int8
        qv = _initializer(graph, names, f"{value.name}_quantized", (q + shift).astype(dtype))
        sv = _initializer(graph, names, f"{value.name}_scale", scale)
        zv = _initializer(graph, names, f"{value.name}_zero_point", np.array(shift, dtype=dtype))
        dq = ir.Node("", "DequantizeLinear", [qv, sv, zv], name=names(f"{value.name}_DequantizeLinear"))
        dq.outputs[0].name = names(f"{value.name}_dequantized")
        dq.outputs[0].dtype, dq.outputs[0].shape = ir.DataType.FLOAT, value.shape
        graph.insert_before(node, dq)
        node.replace_input_with(k, dq.outputs[0])
    return len(p.operands)


def _weights(model: ir.Model, p: Plan, placement: Placement, names: _Names) -> int:
    graph = model.graph
    memo: dict[tuple[str, int | None], tuple[ir.Value, ir.Value, ir.Value, np.ndarray]] = {}
    n_weights = 0
    for node in (p.nodes[i] for i in p.weighted):
        w = node.inputs[1]
        array = w.const_value.numpy()
        attrs = {k: a.value for k, a in node.attributes.items()}
        axis = weight_axis(node.op_type, attrs, array.ndim) if placement.per_channel else None
        key = (w.name, axis)
        if key not in memo:
            scale = _weight_qparams(array, axis, placement.weight_bound)
            shape = [1] * array.ndim
            if axis is not None:
                shape[axis] = -1
            q = np.clip(np.rint(array / scale.reshape(shape)), -placement.weight_bound, placement.weight_bound)
            zero = np.zeros(scale.shape, dtype=np.int8)
            memo[key] = (_initializer(graph, names, f"{w.name}_quantized", q.astype(np.int8)),
                         _initializer(graph, names, f"{w.name}_scale", scale),
                         _initializer(graph, names, f"{w.name}_zero_point", zero), scale)
        qw, sw, zw, _ = memo[key]
        attributes = [ir.AttrInt64("axis", axis)] if axis is not None else []
        dq = ir.Node("", "DequantizeLinear", [qw, sw, zw], attributes, name=names(f"{w.name}_DequantizeLinear"))
        dq.outputs[0].name = names(f"{w.name}_dequantized")
        dq.outputs[0].dtype, dq.outputs[0].shape = ir.DataType.FLOAT, w.shape
        graph.insert_before(node, dq)
        node.replace_input_with(1, dq.outputs[0])
        n_weights += 1
    for name in [n for n, v in graph.initializers.items() if not v.uses() and not v.is_graph_output()]:
        del graph.initializers[name]
    return n_weights
