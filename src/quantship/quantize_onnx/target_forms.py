"""Rewrites a target needs before quantization: what its runtime cannot read, put in a form it can.

They run after ``normalize.PASSES``, through the same proof (``quantizer.normalise``), and only for
the targets that need them (``passes_for``):

- ``static_shapes``, for a preset whose file serves one batch (``Preset.dynamic_batch`` False:
  TiGrIS plans a fixed memory layout and refuses a symbolic dim). Every dynamic dim of a graph input
  takes the calibration sample's size with batch 1; the shape arithmetic that then reads constants
  (``Shape``, ``Range``, ``ConstantOfShape``... of an anchor grid) is folded into initializers; graph
  outputs get the shapes one run gives. Proven exact on batch-1 feeds.
- ``hard_sigmoid_written_out``, for a runtime without ``HardSigmoid`` (TiGrIS's operator contract
  has ``HardSwish`` and ``Clip`` but not ``HardSigmoid``): ``x * HardSigmoid(x)`` with ONNX's
  hard-swish constants (alpha 1/6, beta 1/2) becomes ``HardSwish(x)``; any other ``HardSigmoid``
  (Paddle's squeeze-excite gate, alpha 0.2) becomes ``Clip(6 alpha x + 6 beta, 0, 6) / 6``: TiGrIS runs
  ``Clip(0, 6)`` as its Relu6 kernel and no other Clip. A float pass.
- ``batch_norm_written_out``, for a runtime that runs BatchNormalization only folded into a Conv
  (TiGrIS): one that follows something else (PP-OCRv4's detector has one after a residual Add)
  becomes a per-channel ``Mul`` and ``Add``. A float pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.optimizer

from quantship.precision import Preset
from quantship.quantize_onnx.normalize import (
    DEFAULT_DOMAINS,
    Pass,
    batch_norm_statistics,
    default_opset,
    drop_unused_initializers,
    replace_model,
)

Feed = dict[str, np.ndarray]
TARGETS_WITHOUT_HARD_SIGMOID = ("tigris",)  # from each runtime's operator list
TARGETS_WITHOUT_BATCH_NORM = ("tigris",)  # TiGrIS folds Conv -> BatchNormalization and has no kernel for one alone
HARD_SWISH_OPSET = 14
MAX_FOLDS = 8  # rounds of shape inference + constant folding (a shape chain folds in one or two)
_HARD_SWISH = (1.0 / 6.0, 0.5)


def one_sample_feeds(feeds: Sequence[Feed]) -> list[Feed]:
    """The same samples, one per feed (what a batch-1 file is calibrated and proven on)."""
    out = []
    for feed in feeds:
        rows = len(next(iter(feed.values())))
        out += [{k: v[i:i + 1] for k, v in feed.items()} for i in range(rows)]
    return out


def _fold_all(node: ir.Node) -> bool | None:
    """Fold every node whose inputs are constants, ``ConstantOfShape`` included (onnxscript keeps it by
    default: small to store, but a runtime without the op cannot run it)."""
    return True if node.op_type == "ConstantOfShape" else None


def static_shapes(sample: Feed, run_outputs) -> Pass:
    """The pass that freezes the graph's dims to ``sample`` (batch 1); ``run_outputs(model)`` gives the
    output arrays of one run of the rewritten model, read for the outputs' shapes."""

    def run(model: ir.Model) -> int:
        n = 0
        for value in model.graph.inputs:
            if value.name not in sample or value.shape is None:
                continue
            dims = tuple(int(d) for d in sample[value.name].shape)
            if tuple(value.shape.dims) != dims:
                value.shape = ir.Shape(dims)
                n += 1
        if not n:
            return 0
        for node in model.graph:
            for value in node.outputs:
                if value.shape is not None and not all(isinstance(d, int) for d in value.shape.dims):
                    value.shape = None  # inferred anew from the frozen inputs
        for _ in range(MAX_FOLDS):  # each round: shapes inferred from the frozen inputs, then what they make constant folded
            inferred = ir.from_proto(onnx.shape_inference.infer_shapes(ir.to_proto(model), data_prop=True))
            replace_model(model, inferred)
            before = len(model.graph)
            onnxscript.optimizer.fold_constants(model, onnx_shape_inference=True, should_fold=_fold_all)
            onnxscript.optimizer.remove_unused_nodes(model)
            if len(model.graph) == before:
                break
        drop_unused_initializers(model.graph)
        for value, array in zip(model.graph.outputs, run_outputs(model)):
            value.shape = ir.Shape(tuple(int(d) for d in np.shape(array)))
        return n

    return Pass("static_shapes", run, "exact", "the target plans one fixed batch-1 shape (no symbolic dim)")


def _attr(node: ir.Node, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return float(attr.value) if attr is not None else default


def _hard_swish_partner(graph_node: ir.Node) -> ir.Node | None:
    """The ``Mul`` that multiplies a hard-swish-constant HardSigmoid by its own input, if any."""
    if not np.allclose((_attr(graph_node, "alpha", 0.2), _attr(graph_node, "beta", 0.5)), _HARD_SWISH, rtol=1e-5):
        return None
    x, out = graph_node.inputs[0], graph_node.outputs[0]
    if len(out.uses()) != 1 or out.is_graph_output():
        return None
    user = out.uses()[0].node
    if user.op_type == "Mul" and user.domain in DEFAULT_DOMAINS and {user.inputs[0], user.inputs[1]} == {x, out}:
        return user
    return None


def _constant(graph: ir.Graph, name: str, value: float | np.ndarray) -> ir.Value:
    """A float32 initializer named ``name`` (a scalar, or an array as given)."""
    array = np.asarray(value, dtype=np.float32)
    v = ir.Value(name=name, const_value=ir.tensor(array, name=name), shape=ir.Shape(array.shape),
                 type=ir.TensorType(ir.DataType.FLOAT))
    graph.register_initializer(v)
    return v


def _take_over(old: ir.Value, new: ir.Value) -> None:
    """``new`` replaces ``old`` for every reader, graph outputs included, under ``old``'s name."""
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    new.name, old.name = old.name, None


def hard_sigmoid_written_out(model: ir.Model) -> int:
    graph = model.graph
    found = [n for n in graph if n.op_type == "HardSigmoid" and n.domain in DEFAULT_DOMAINS]
    if not found:
        return 0
    swish_ok = default_opset(model) >= HARD_SWISH_OPSET
    n = 0
    for node in found:
        x = node.inputs[0]
        partner = _hard_swish_partner(node) if swish_ok else None
        if partner is not None:
            swish = ir.node("HardSwish", [x], name=f"{node.name}/hardswish")
            graph.insert_before(partner, swish)
            _take_over(partner.outputs[0], swish.outputs[0])
            graph.remove([partner, node], safe=True)
            n += 1
            continue
        alpha, beta = _attr(node, "alpha", 0.2), _attr(node, "beta", 0.5)
        scale, shift, six, zero, sixth = (_constant(graph, f"{node.name}/{label}", v) for label, v in (
            ("scale", 6.0 * alpha), ("shift", 6.0 * beta), ("six", 6.0), ("zero", 0.0), ("sixth", 1.0 / 6.0)))
        mul = ir.node("Mul", [x, scale], name=f"{node.name}/mul")
        add = ir.node("Add", [mul.outputs[0], shift], name=f"{node.name}/add")
        relu6 = ir.node("Clip", [add.outputs[0], zero, six], name=f"{node.name}/relu6")
        back = ir.node("Mul", [relu6.outputs[0], sixth], name=f"{node.name}/div6")
        graph.insert_before(node, [mul, add, relu6, back])
        _take_over(node.outputs[0], back.outputs[0])
        graph.remove(node, safe=True)
        n += 1
    return n


def batch_norm_written_out(model: ir.Model) -> int:
    """A BatchNormalization no Conv precedes (``normalize.fold_batch_norm`` folded the others; this one
    follows an Add) becomes ``x * factor + shift`` per channel, for a runtime without the op."""
    found = [b for b in model.graph if b.op_type == "BatchNormalization" and b.domain in DEFAULT_DOMAINS]
    if any(b.inputs[0].shape is None for b in found):  # the rank of what it normalises, for the constants
        replace_model(model, ir.from_proto(onnx.shape_inference.infer_shapes(ir.to_proto(model))))
    graph = model.graph
    n = 0
    for bn in [b for b in graph if b.op_type == "BatchNormalization" and b.domain in DEFAULT_DOMAINS]:
        stats = batch_norm_statistics(bn)
        x = bn.inputs[0]
        rank = len(x.shape) if x.shape is not None else None
        if len(bn.outputs) != 1 or stats is None or rank is None or rank < 2:
            continue
        factor, beta, mean = stats
        per_channel = (1, -1) + (1,) * (rank - 2)  # at the activation's rank: TiGrIS broadcasts no lower rank
        scale = _constant(graph, f"{bn.name}/factor", factor.reshape(per_channel))
        shift = _constant(graph, f"{bn.name}/shift", (beta - mean * factor).reshape(per_channel))
        mul = ir.node("Mul", [x, scale], name=f"{bn.name}/mul")
        add = ir.node("Add", [mul.outputs[0], shift], name=f"{bn.name}/add")
        graph.insert_before(bn, [mul, add])
        _take_over(bn.outputs[0], add.outputs[0])
        graph.remove(bn, safe=True)
        n += 1
    if n:
        drop_unused_initializers(graph)
    return n


def passes_for(preset: Preset, sample: Feed | None, run_outputs) -> tuple[Pass, ...]:
    """The rewrites ``preset``'s target needs, in order (none for a runtime that reads the file as is)."""
    passes = []
    if not preset.dynamic_batch and sample is not None:
        passes.append(static_shapes(sample, run_outputs))
    if preset.target in TARGETS_WITHOUT_BATCH_NORM:
        passes.append(Pass("batch_norm_written_out", batch_norm_written_out, "float",
                           f"{preset.target} runs BatchNormalization only folded into a Conv: per-channel Mul/Add"))
    if preset.target in TARGETS_WITHOUT_HARD_SIGMOID:
        passes.append(Pass("hard_sigmoid_written_out", hard_sigmoid_written_out, "float",
                           f"{preset.target} has no HardSigmoid: HardSwish where it is one, else Mul/Add/Relu6/Mul"))
    return tuple(passes)
