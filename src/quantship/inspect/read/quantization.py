"""What a file's quantization is, read off its nodes: format, Q/DQ pairs, float leftovers.

One pass produces ``QuantFacts``; the file report prints them and the deployability rules judge
them, so both always agree about what the file contains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from quantship.inspect.read.forms import operator_forms
from quantship.inspect.read.islands import (
    Op,
    dequantized_data,
    detection_postprocess,
    normalisation_statistics,
    polynomial_interiors,
)
from quantship.inspect.read.parameters import foreign_operators, parameter_problems
from quantship.inspect.read.view import DEQUANTIZE, QUANTIZE, SHAPE_ONLY, GraphView, dtype_name, node_label
from quantship.inspect.read.weight_only import WeightOnlyFacts, weight_only_facts

# ONNX Runtime's operator-oriented format: integer kernels with the scales as inputs
QOPERATOR_OPS = frozenset({"QGemm", "QAttention", "QEmbedLayerNormalization", "QOrderedMatMul",
                           "ConvInteger", "MatMulInteger"})
# activation scales computed while the model runs
DYNAMIC_OPS = frozenset({"DynamicQuantizeLinear", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM",
                         "MatMulIntegerToFloat"})
NOT_COMPUTE = frozenset({QUANTIZE, DEQUANTIZE, "Constant"}) | SHAPE_ONLY
# "weight-only": low-bit weights (``read.weight_only``) and no activation quantized
FORMATS = ("QDQ", "QOperator", "dynamic", "float", "mixed", "weight-only")


@dataclass(frozen=True)
class QDQNode:
    """One QuantizeLinear/DequantizeLinear: what it quantizes and how it is stored."""

    node: str
    op_type: str
    tensor: str  # the float tensor (Q input, DQ output)
    role: str  # "activation", "weight" or "bias"
    dtype: str  # stored integer type
    per_channel: bool
    static: bool  # scale (and zero-point) are constants in the file
    scale: float | None  # per-tensor scale value
    zero_points: tuple[int, ...]  # distinct zero-point values (empty when not static)
    max_abs_int: int | None = None  # largest |stored integer| of a constant (weight) input


@dataclass
class QuantFacts:
    """Everything the rules and the report need to know about a file's quantization."""

    format: str
    opset: int | None
    qdq: list[QDQNode] = field(default_factory=list)
    qoperator_nodes: list[str] = field(default_factory=list)
    dynamic_nodes: list[str] = field(default_factory=list)
    float_tensors: list[str] = field(default_factory=list)
    float_islands: list[str] = field(default_factory=list)  # float on purpose (``inspect.read.islands``), not counted
    float_operators: list[str] = field(default_factory=list)
    convs_without_kernel_shape: list[str] = field(default_factory=list)
    biases: list[tuple[str, str, str]] = field(default_factory=list)  # (node, tensor, stored dtype)
    parameter_problems: list[str] = field(default_factory=list)  # broken scales, zero-points, axes, dims
    foreign_operators: list[tuple[str, str, bool]] = field(default_factory=list)  # (node, domain, local function)
    # (node, form) of ops in a form some runtimes have no kernel for (``read.forms``: Clip bounds, reductions)
    operator_forms: list[tuple[str, str]] = field(default_factory=list)
    # activation QuantizeLinear -> DequantizeLinear pairs whose two nodes hold different static parameters
    two_scale_pairs: list[str] = field(default_factory=list)
    # the low-bit weights of a weight-only file (format "weight-only"); None for every other format
    weight_only: WeightOnlyFacts | None = None

    def of_role(self, role: str) -> list[QDQNode]:
        return [q for q in self.qdq if q.role == role]

    @property
    def activation_dtypes(self) -> list[str]:
        return sorted({q.dtype for q in self.of_role("activation")})


def one_pair(scale: np.ndarray, zero: np.ndarray | None) -> bool:
    """``scale`` and ``zero`` (None: absent) each hold one value, however many times: a per-tensor pair, written per
    axis when repeated (``export.float_pairs.float_reads_per_axis``)."""
    return all(a.size >= 1 and bool(np.all(a == a.reshape(-1)[0])) for a in (scale, zero) if a is not None)


def default_opset(model: onnx.ModelProto) -> int | None:
    """The declared version of the default ONNX domain (None when the file declares none)."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return None


def _qdq_node(view: GraphView, node: onnx.NodeProto, index: int) -> QDQNode:
    x = node.input[0]
    scale_name = node.input[1] if len(node.input) > 1 else ""
    zp_name = node.input[2] if len(node.input) > 2 else ""
    def in_file(name: str) -> bool:  # a constant, or rows of a stored table (a quantized embedding's row scales)
        return name in view.constant or view.gathered_from_constant(name)

    static = in_file(scale_name) and (not zp_name or in_file(zp_name))
    if node.op_type == DEQUANTIZE:
        stored = view.elem_type.get(x, 0) or (view.elem_type.get(zp_name, 0) if zp_name else 0)
        tensor, dtype = node.output[0], dtype_name(stored)
    else:
        tensor = x
        out_dtype = next((a.i for a in node.attribute if a.name == "output_dtype"), 0)
        dtype = dtype_name(view.elem_type.get(zp_name, 0) if zp_name else out_dtype or onnx.TensorProto.UINT8)
    if x in view.constant or view.gathered_from_constant(x):  # a stored weight, or rows of a stored table
        users = view.consumer_nodes(node.output[0])
        is_bias = node.op_type == DEQUANTIZE and any(
            u.op_type in ("Conv", "Gemm", "ConvTranspose") and len(u.input) > 2 and u.input[2] == node.output[0]
            for u in users)
        role = "bias" if is_bias else "weight"
    else:
        role = "activation"
    scale = view.value(scale_name) if scale_name else None
    if scale is not None and scale.dtype.kind != "f":
        scale = None  # not a scale at all: the parameter rule names it
    zero = view.value(zp_name) if zp_name else np.zeros(1, dtype=np.int64)
    if zero is not None and zero.dtype.kind not in "iub":
        zero = None
    if scale is not None and one_pair(scale, zero):
        scale, zero = scale.reshape(-1)[:1], zero.reshape(-1)[:1] if zero is not None else None
    per_channel = scale is not None and scale.size > 1 or (scale is None and bool(view.shape.get(scale_name)))
    stored = view.passing(x) if node.op_type == DEQUANTIZE and x in view.initializers else None
    max_abs = None
    if stored is not None and stored.size and np.issubdtype(stored.dtype, np.integer):
        offset = int(zero.reshape(-1)[0]) if zero is not None and zero.size == 1 else 0
        max_abs = max(abs(int(stored.min()) - offset), abs(int(stored.max()) - offset))
    return QDQNode(
        node=node_label(node, index), op_type=node.op_type, tensor=tensor, role=role, dtype=dtype,
        per_channel=bool(per_channel), static=static,
        scale=float(scale.reshape(-1)[0]) if scale is not None and scale.size == 1 else None,
        zero_points=tuple(sorted({int(v) for v in zero.reshape(-1)})) if zero is not None else (),
        max_abs_int=max_abs,
    )


def op_record(node: onnx.NodeProto) -> Op:
    """The island rules' record of ``node``: with the outer tensors its subgraphs read, and their op types."""
    inputs = list(node.input)  # as the node lists them (x * x: twice)
    outer: list[str] = []
    nested: set[str] = set()
    bodies = [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    bodies += [g for a in node.attribute if a.type == onnx.AttributeProto.GRAPHS for g in a.graphs]
    for body in bodies:
        inner = {v.name for v in body.input} | {t.name for t in body.initializer}
        inner.update(o for n in body.node for o in n.output)
        for sub in body.node:
            nested.add(sub.op_type)
            record = op_record(sub)
            nested |= record.nested
            outer.extend(v for v in record.inputs if v and v not in inner)
    return Op(node.op_type, (*inputs, *dict.fromkeys(v for v in outer if v not in inputs)), tuple(node.output),
              frozenset(nested))


def _float_leftovers(view: GraphView) -> tuple[list[str], list[str], list[str]]:
    """Activations computed in float outside any Q/DQ pair, the operators that compute on them, and the
    float islands (``inspect.read.islands``: a normalisation's statistics, a polynomial's interior, dequantized
    values moved), which
    a fully integer target runs in float on purpose and which are not leftovers."""
    tensors: dict[str, None] = {}
    operators: dict[str, None] = {}
    ops = [op_record(n) for n in view.nodes]

    def activation(name: str) -> bool:
        return name not in view.constant and view.is_float(name)

    statistics = (normalisation_statistics(ops, activation) | polynomial_interiors(ops, activation)
                  | detection_postprocess(ops, activation))
    exact = dequantized_data(ops, activation)
    islands: dict[str, None] = {}
    for index, node in enumerate(view.nodes):
        if node.op_type in NOT_COMPUTE or all(o in view.constant for o in node.output if o):
            continue
        label = node_label(node, index)
        for name in ([] if view.fused_into_producer(node) else node.input):
            if not name or name in view.constant or not view.is_float(name):
                continue
            origin = view.through_shape_ops_up(name)
            source = view.node_of(origin)
            if origin in statistics or origin in exact:
                continue
            if source is None or source.op_type != DEQUANTIZE:
                tensors[origin] = None
                operators[label] = None
        for name in node.output:
            if not name or not view.is_float(name):
                continue
            for _, consumer in view.through_shape_ops_down(name):
                if consumer is None or consumer.op_type != QUANTIZE:
                    if name in statistics or name in exact:
                        islands[name] = None
                    else:
                        tensors[name] = None
                        operators[label] = None
    return list(tensors), list(operators), list(islands)


def _two_scale_pairs(view: GraphView, qdq: list[QDQNode]) -> list[str]:
    """Each activation Q -> DQ pair whose DequantizeLinear reads the integers at another static scale or zero-point
    than its QuantizeLinear wrote them with (a requantization written as one pair): "Q -> DQ (scale a vs b)"."""
    by_label = {q.node: q for q in qdq}
    position = {id(n): i for i, n in enumerate(view.nodes)}
    found = []
    for index, node in enumerate(view.nodes):
        q = by_label.get(node_label(node, index)) if node.op_type == QUANTIZE else None
        if q is None or q.role != "activation" or not q.static or q.scale is None:
            continue
        for reader in view.consumer_nodes(node.output[0]):
            dq = by_label.get(node_label(reader, position[id(reader)])) if reader.op_type == DEQUANTIZE else None
            if dq is not None and dq.static and (dq.scale != q.scale or dq.zero_points != q.zero_points):
                found.append(f"{q.node} -> {dq.node} (scale {q.scale:.6g} vs {dq.scale})")
    return found


def quant_facts(view: GraphView) -> QuantFacts:
    """Read the quantization of the graph in ``view``."""
    facts = QuantFacts(format="float", opset=default_opset(view.model))
    for index, node in enumerate(view.nodes):
        label = node_label(node, index)
        if node.op_type in (QUANTIZE, DEQUANTIZE) and node.input and node.output:
            facts.qdq.append(_qdq_node(view, node, index))
        elif node.op_type in DYNAMIC_OPS:
            facts.dynamic_nodes.append(label)
        elif node.op_type.startswith("QLinear") or node.op_type in QOPERATOR_OPS:
            facts.qoperator_nodes.append(label)
        if node.op_type in ("Conv", "ConvTranspose") and not any(a.name == "kernel_shape" for a in node.attribute):
            facts.convs_without_kernel_shape.append(label)
        if node.op_type in ("Conv", "Gemm", "ConvTranspose") and len(node.input) > 2 and node.input[2]:
            bias = view.through_shape_ops_up(node.input[2])
            source = view.node_of(bias)
            stored = (dtype_name(view.elem_type.get(source.input[0], 0))
                      if source is not None and source.op_type == DEQUANTIZE
                      else dtype_name(view.elem_type.get(bias, 0)))
            facts.biases.append((label, bias, stored))
    facts.float_tensors, facts.float_operators, facts.float_islands = _float_leftovers(view)
    facts.parameter_problems = parameter_problems(view)
    facts.foreign_operators = foreign_operators(view)
    facts.operator_forms = operator_forms(view)
    facts.two_scale_pairs = _two_scale_pairs(view, facts.qdq)
    if facts.dynamic_nodes and not facts.of_role("activation"):  # a QDQ file with integer LSTMs stays QDQ/mixed
        facts.format = "dynamic"
    elif facts.qoperator_nodes:
        facts.format = "QOperator"
    elif not facts.qdq:
        facts.format = "float"
    elif facts.float_tensors or not facts.of_role("activation"):
        facts.format = "mixed"
    else:
        facts.format = "QDQ"
    low_bit = weight_only_facts(view)
    if low_bit is not None and not (facts.of_role("activation") or facts.qoperator_nodes or facts.dynamic_nodes):
        facts.format, facts.weight_only = "weight-only", low_bit
    return facts
