"""The dynamic-activation form (``--activations dynamic``): int8 weights stored, activations quantized at run time.

Every MatMul (and Gemm, written as a MatMul first) whose B is a stored float weight of rank 2 becomes

    DynamicQuantizeLinear(x) -> MatMulInteger(x_q, W_q, x_zero_point) -> Cast(float)
        -> Mul(., Mul(x_scale, W_scale)) -> [Add(., bias)]

with ``W_q`` int8 per output column (symmetric, the static file's weight rule: ``place._weight_qparams``)
and ``x`` quantized to uint8 by the op itself, per tensor, from its own range on each run. This is the
pattern ONNX Runtime's CPU optimizer fuses (``MatMulIntegerToFloatFusion``: the Mul must read the Cast and
a Mul of (A scale, B scale), in that order; the Add's bias a 1-D constant as its second input; then
``DynamicQuantizeMatMulFusion`` folds a DynamicQuantizeLinear read by one MatMulIntegerToFloat only into
``DynamicQuantizeMatMul``). Per-column B scales fuse; B's zero-point is left out (all zero: symmetric).
MatMuls reading one activation share its DynamicQuantizeLinear (ONNX Runtime's common-subexpression pass
merges separate ones anyway): those run as ``MatMulIntegerToFloat`` after one quantization, a MatMul that
reads its activation alone as ``DynamicQuantizeMatMul``. A stored table read by computed indices (an
embedding's word table: ``tables.read_table``) is stored int8 per tensor (``tables.TABLE_BOUND`` steps) and
its gathered rows dequantized: ``Gather(table_q) -> DequantizeLinear``, exact against dequantizing the
table first, as ``quantize_dynamic`` does (measured: the float word table cost the BERT encoder ~5% at
batch 1). Nothing else is quantized: no QuantizeLinear in the file, LayerNorm, GELU, softmax and the
activation x activation MatMuls run in float, and Convs stay float (this is the transformer serving form).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx_ir as ir

from quantship.quantize_onnx.place import _initializer, _Names, _weight_qparams
from quantship.quantize_onnx.selection import node_label
from quantship.quantize_onnx.tables import TABLE_BOUND, read_table, table_scale

ACTIVATIONS_KEY = "quantship.activations"  # the form, in the file's metadata_props: "dynamic"
WEIGHTS_KEY = "quantship.weights"  # how the stored weights are quantized (JSON)
DEFAULT_DOMAINS = ("", "ai.onnx")
MIN_OPSET = 11  # DynamicQuantizeLinear


@dataclass(frozen=True)
class DynamicLayer:
    """One MatMul/Gemm written in the dynamic form."""

    node: str
    op_type: str  # the float file's: MatMul or Gemm
    weight: str  # the float weight's initializer name
    columns: int  # output columns, one weight scale each (1 per tensor)
    bias: bool  # a constant bias is added after the scale (fused into the kernel by ONNX Runtime)


@dataclass
class DynamicPlan:
    """What the rewrite did: the layers written, and every MatMul/Gemm left float with the reason."""

    layers: list[DynamicLayer] = field(default_factory=list)
    kept_float: dict[str, str] = field(default_factory=dict)  # node label -> why it stays float
    n_quantize_nodes: int = 0  # DynamicQuantizeLinear nodes written
    tables: list[str] = field(default_factory=list)  # Gather nodes reading an int8 table (one DequantizeLinear each)

    def as_dict(self) -> dict:
        return {"layers": [asdict(x) for x in self.layers], "kept_float": self.kept_float,
                "n_layers": len(self.layers), "n_kept_float": len(self.kept_float),
                "n_quantize_nodes": self.n_quantize_nodes, "tables": self.tables}


def _attrs(node: ir.Node) -> dict:
    return {k: a.value for k, a in node.attributes.items()}


def _stored(value: ir.Value | None) -> bool:
    return value is not None and value.const_value is not None and not value.is_graph_input()


def why_float(node: ir.Node) -> str | None:
    """None when ``node`` can run in the dynamic form, else why it stays float."""
    if node.domain not in DEFAULT_DOMAINS:
        return "not an ONNX-domain op"
    x, w = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    if x is None or w is None or _stored(x):
        return "its A input is not an activation"
    if not _stored(w):
        return "its B input is an activation, not a stored weight (activation x activation: float)"
    if w.const_value.dtype != ir.DataType.FLOAT or (x.dtype is not None and x.dtype != ir.DataType.FLOAT):
        return "not float32 (DynamicQuantizeLinear reads float32)"
    if len(w.const_value.shape) != 2:
        return f"its weight has rank {len(w.const_value.shape)}; per-column int8 weights need rank 2"
    if node.op_type == "Gemm":
        attrs = _attrs(node)
        if attrs.get("transA", 0):
            return "Gemm with transA=1"
        if len(node.inputs) > 2 and node.inputs[2] is not None and not _stored(node.inputs[2]):
            return "Gemm whose C is an activation"
    return None


def _weight_and_bias(node: ir.Node) -> tuple[np.ndarray, np.ndarray | None]:
    """B as a K x N MatMul weight and the bias added after it (Gemm: transB, alpha and beta folded in)."""
    w = node.inputs[1].const_value.numpy().astype(np.float32)
    if node.op_type != "Gemm":
        return w, None
    attrs = _attrs(node)
    if attrs.get("transB", 0):
        w = w.T
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    if alpha != 1.0:
        w = (w * np.float32(alpha)).astype(np.float32)
    c = node.inputs[2] if len(node.inputs) > 2 else None
    if c is None or beta == 0.0:
        return np.ascontiguousarray(w), None
    bias = c.const_value.numpy().astype(np.float32)
    if beta != 1.0:
        bias = (bias * np.float32(beta)).astype(np.float32)
    return np.ascontiguousarray(w), bias


def _bias_first_reader(out: ir.Value) -> ir.Node | None:
    """The Add after a MatMul that adds a 1-D stored bias (its sole reader), else None."""
    uses = out.uses()
    if len(uses) != 1 or out.is_graph_output():
        return None
    add = uses[0].node
    if add.op_type != "Add" or add.domain not in DEFAULT_DOMAINS or len(add.inputs) != 2:
        return None
    other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    if not _stored(other) or len(other.const_value.shape) != 1:
        return None
    return add


def rewrite(model: ir.Model, *, weight_bound: int, per_channel: bool = True, excluded: Iterable[int] = ()
            ) -> DynamicPlan:
    """Write every eligible MatMul/Gemm of ``model`` in the dynamic form (``excluded``: node indices kept
    float, as ``selection.resolve_excludes`` gives them); returns the plan."""
    graph = model.graph
    if int(model.opset_imports.get("", 0)) < MIN_OPSET:  # normalize.upgrade_opset has run before
        raise ValueError(f"the dynamic form needs opset >= {MIN_OPSET}; upgrade the model first")
    names = _Names(model)
    nodes = list(graph)
    skip = set(excluded)
    plan = DynamicPlan()
    weights: dict[tuple[str, bool, float], tuple[ir.Value, ir.Value, int]] = {}
    quantized: dict[ir.Value, tuple[ir.Value, ir.Value, ir.Value]] = {}  # activation -> its DQL's outputs
    for index, node in enumerate(nodes):
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        label = node_label(node, index)
        reason = "excluded (--exclude)" if index in skip else why_float(node)
        if reason is not None:
            plan.kept_float[label] = reason
            continue
        x, out, weight_name = node.inputs[0], node.outputs[0], node.inputs[1].name or ""
        w, gemm_bias = _weight_and_bias(node)
        attrs = _attrs(node)
        key = (node.inputs[1].name, bool(attrs.get("transB", 0)) and node.op_type == "Gemm",
               float(attrs.get("alpha", 1.0)) if node.op_type == "Gemm" else 1.0)
        if key not in weights:
            scale = _weight_qparams(w, 1 if per_channel else None, weight_bound)
            q = np.clip(np.rint(w / scale.reshape(1, -1) if per_channel else w / scale), -weight_bound, weight_bound)
            base = weight_name or label
            weights[key] = (_initializer(graph, names, f"{base}_quantized", q.astype(np.int8)),
                            _initializer(graph, names, f"{base}_scale", scale.astype(np.float32)), w.shape[1])
        w_q, w_scale, columns = weights[key]
        new: list[ir.Node] = []
        if x in quantized:
            x_q, x_scale, x_zero = quantized[x]
        else:
            dql = ir.Node("", "DynamicQuantizeLinear", [x], name=names(f"{label}_DynamicQuantizeLinear"),
                          num_outputs=3)
            x_q, x_scale, x_zero = dql.outputs
            for v, suffix, dtype in ((x_q, "quantized", ir.DataType.UINT8), (x_scale, "scale", ir.DataType.FLOAT),
                                     (x_zero, "zero_point", ir.DataType.UINT8)):
                v.name, v.dtype = names(f"{label}_{x.name or 'x'}_{suffix}"), dtype
            x_q.shape = x.shape
            quantized[x] = (x_q, x_scale, x_zero)
            new.append(dql)
            plan.n_quantize_nodes += 1
        mm = ir.Node("", "MatMulInteger", [x_q, w_q, x_zero], name=names(f"{label}_MatMulInteger"))
        cast = ir.Node("", "Cast", [mm.outputs[0]], [ir.AttrInt64("to", ir.DataType.FLOAT.value)],
                       name=names(f"{label}_Cast"))
        scales = ir.Node("", "Mul", [x_scale, w_scale], name=names(f"{label}_scales"))
        mul = ir.Node("", "Mul", [cast.outputs[0], scales.outputs[0]], name=names(f"{label}_rescale"))
        mm.outputs[0].name, mm.outputs[0].dtype = names(f"{label}_int32"), ir.DataType.INT32
        cast.outputs[0].name, cast.outputs[0].dtype = names(f"{label}_int32_float"), ir.DataType.FLOAT
        scales.outputs[0].name, scales.outputs[0].dtype = names(f"{label}_scale_product"), ir.DataType.FLOAT
        mul.outputs[0].dtype, mul.outputs[0].shape = ir.DataType.FLOAT, out.shape
        new += [mm, cast, scales, mul]
        result = mul.outputs[0]
        if gemm_bias is not None:
            b = _initializer(graph, names, f"{label}_bias", gemm_bias)
            add = ir.Node("", "Add", [result, b], name=names(f"{label}_bias_add"))
            add.outputs[0].dtype, add.outputs[0].shape = ir.DataType.FLOAT, out.shape
            new.append(add)
            result = add.outputs[0]
        graph.insert_before(node, new)
        out.replace_all_uses_with(result, replace_graph_outputs=True)
        result.name, out.name = out.name, None
        graph.remove(node, safe=True)
        bias = gemm_bias is not None
        follower = _bias_first_reader(result) if not bias else None
        if follower is not None:
            if follower.inputs[0] is not result:  # bias + y -> y + bias: the same sum, the order ORT fuses
                stored = follower.inputs[0]
                follower.replace_input_with(0, result)
                follower.replace_input_with(1, stored)
            bias = True
        plan.layers.append(DynamicLayer(label, node.op_type, weight_name, columns if per_channel else 1, bias))
    plan.tables = _tables(model, names, nodes, skip)
    for name in [n for n, v in graph.initializers.items() if not v.uses() and not v.is_graph_output()]:
        del graph.initializers[name]
    return plan


def _tables(model: ir.Model, names: _Names, nodes: list[ir.Node], skip: set[int]) -> list[str]:
    """Each stored table read by computed indices becomes int8 (per tensor, symmetric), its gathered rows
    dequantized after the read; returns the reading nodes' labels."""
    graph = model.graph
    constant = set(graph.initializers)
    memo: dict[str, tuple[ir.Value, ir.Value]] = {}
    done = []
    for index, node in enumerate(nodes):
        table = read_table(node, constant) if index not in skip else None
        if table is None:
            continue
        label = node_label(node, index)
        if table.name not in memo:
            array = table.const_value.numpy()
            scale = np.float32(table_scale(array, TABLE_BOUND))
            q = np.clip(np.rint(array / scale), -TABLE_BOUND, TABLE_BOUND).astype(np.int8)
            memo[table.name] = (_initializer(graph, names, f"{table.name}_quantized", q),
                                _initializer(graph, names, f"{table.name}_scale", np.array(scale, np.float32)))
        stored, scale = memo[table.name]
        node.replace_input_with(0, stored)
        rows = node.outputs[0]  # now the int8 rows; its readers move to the dequantized ones
        dq = ir.Node("", "DequantizeLinear", [rows, scale], name=names(f"{label}_DequantizeLinear"))
        dequantized = dq.outputs[0]
        dequantized.dtype, dequantized.shape = ir.DataType.FLOAT, rows.shape
        graph.insert_after(node, dq)
        for use in [u for u in rows.uses() if u.node is not dq]:
            use.node.replace_input_with(use.idx, dequantized)
        for position, value in enumerate(graph.outputs):
            if value is rows:
                graph.outputs[position] = dequantized
        name = rows.name
        rows.name, rows.dtype = names(f"{name or label}_quantized"), ir.DataType.INT8
        dequantized.name = name
        done.append(label)
    return done
