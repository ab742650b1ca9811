"""Rewrites a target needs: what its runtime cannot read (or reads slowly), put in a form it can.

The ONNX path runs them on the float file after ``normalize.PASSES``, through the same proof
(``quantizer.normalise``), for the targets that need them (``passes_for``, reading the ``Target``'s fields).
The PyTorch path runs the exact ones that also apply to a quantized graph on the file ``export_qdq``
produced (``exported_forms``; proven byte-identical by ``export.qdq.TargetFormsPass``):

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
- ``hard_swish_one_op``, for ONNX Runtime (CPU): a hard swish written out (``x * Clip(x + 3, 0, 6) / 6``,
  Paddle's export, or ``x * HardSigmoid(x)``) becomes one ``HardSwish`` (opset 14; the file is converted
  when it is older). Written out, it is four float ops between a QLinearConv's DequantizeLinear and the
  next QuantizeLinear, and ONNX Runtime gives each reader of a DequantizeLinear its own copy; as one op
  it reads one DequantizeLinear, and ONNX Runtime lowers it after its QDQ fusion. A float pass.
- ``prelu_written_out``, for ONNX Runtime (CPU): ``PRelu(x, slope)`` on a tensor of at least
  ``PRELU_MIN_VALUES`` values per sample (or of unknown size) becomes ``Relu(x) + Min(x, 0) * slope``,
  the same values bit for bit. ONNX Runtime 1.32's PRelu kernel spent 46% of MTCNN ONet's time (FP32
  and INT8 alike); written out, the INT8 files of RNet and ONet ran at or above FP32's speed (they
  were 0.80x and 0.86x). An exact pass.
- ``spatial_mean_as_global_pool``, for TiGrIS: ``ReduceMean`` over H and W of an NCHW tensor (keepdims)
  becomes ``GlobalAveragePool``, the same op. TiGrIS 0.12.1 compiled a plan for the PP-OCR classifier's
  PyTorch-path file only this way: as ReduceMean, its squeeze-excitation means after a written-out hard
  swish were refused ("needs one rank-3 input"), though such means elsewhere compile. The same mean summed in
  another order: a float pass on the float graph, kept on a QDQ graph only where it reads byte for byte.
- ``clip_as_relu6``, for a QDQ graph and a runtime without ``HardSigmoid`` whose only Clip is Relu6
  (TiGrIS): the PyTorch path exports a hard sigmoid as ``Clip(a x + b, 0, 1)`` between a
  DequantizeLinear and a QuantizeLinear; multiplied by 6 into a pair at 6 times the scale, through
  ``Clip(0, 6)``, and back by a sixth into the reader's pair, the same integers come out. An exact pass.
- ``hard_swish_one_op_quantized``, for a QDQ graph and ONNX Runtime: the PyTorch path exports a hard swish
  written out with a Q/DQ pair after its ops; found with ``hard_swish_one_op``'s matcher on a view of the
  graph without its activation pairs, it becomes one ``HardSwish`` between x's pair and the output's, as
  the ONNX path writes it. The inner roundings go: not exact (``export.qdq.PlacementPass`` says how it is held).
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
from onnxscript.rewriter.rules.fusion._layer_norm import fuse_layer_normalization  # no public name in 0.7.2

from quantship.export.ir_edit import (
    DEFAULT_DOMAINS,
    Pass,
    batch_norm_statistics,
    convert_opset,
    default_opset,
    drop_unused_initializers,
    fresh_initializer,
    lift_constants,
    replace_model,
)
from quantship.export.opset import constant_axes
from quantship.targets import Target

Feed = dict[str, np.ndarray]
# below this many values per sample the four ops cost more than PRelu's slowness: MTCNN PNet's 1,000
# (10 x 10 x 10) ran 0.69x -> 0.58x FP32 written out, RNet's 13,552 0.80x -> 1.01x (batch 1, one thread)
PRELU_MIN_VALUES = 4096
HARD_SWISH_OPSET = 14
LAYER_NORM_OPSET = 18  # LayerNormalization is 17; ReduceMean reads its axes as an input from 18
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
        lift_constants(model)  # onnxscript folds a computed shape into a Constant node
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


def _take_over(old: ir.Value, new: ir.Value) -> None:
    """``new`` replaces ``old`` for every reader, graph outputs included, under ``old``'s name, type and shape
    (every rewrite here computes the same tensor; a graph output without a type is not a valid file)."""
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    new.name, old.name = old.name, None
    new.type = new.type or old.type
    new.shape = new.shape or old.shape


def _replace(graph: ir.Graph, at: ir.Node, nodes: list[ir.Node], removed: ir.Node | list[ir.Node]) -> None:
    """``nodes`` inserted before ``at``; the last one's output takes over ``at``'s (its readers, its name);
    ``removed`` (``at``, or the whole pattern it ends) leaves the graph."""
    graph.insert_before(at, nodes)
    _take_over(at.outputs[0], nodes[-1].outputs[0])
    graph.remove(removed, safe=True)


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
            _replace(graph, partner, [swish], [partner, node])
            n += 1
            continue
        alpha, beta = _attr(node, "alpha", 0.2), _attr(node, "beta", 0.5)
        scale, shift, six, zero, sixth = (fresh_initializer(graph, f"{node.name}/{label}", v) for label, v in (
            ("scale", 6.0 * alpha), ("shift", 6.0 * beta), ("six", 6.0), ("zero", 0.0), ("sixth", 1.0 / 6.0)))
        mul = ir.node("Mul", [x, scale], name=f"{node.name}/mul")
        add = ir.node("Add", [mul.outputs[0], shift], name=f"{node.name}/add")
        relu6 = ir.node("Clip", [add.outputs[0], zero, six], name=f"{node.name}/relu6")
        back = ir.node("Mul", [relu6.outputs[0], sixth], name=f"{node.name}/div6")
        _replace(graph, node, [mul, add, relu6, back], node)
        n += 1
    return n


def _scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element constant (None for anything else)."""
    if value is None or value.const_value is None:
        return None
    array = value.const_value.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 and array.dtype.kind == "f" else None


def _only_reader(value: ir.Value) -> ir.Node | None:
    uses = value.uses()
    return uses[0].node if len(uses) == 1 and not value.is_graph_output() else None


def _is_sixth(node: ir.Node) -> ir.Value | None:
    """What ``node`` divides by 6 (``Div(v, 6)`` or ``Mul(v, 1/6)``), or None."""
    if node.domain not in DEFAULT_DOMAINS or len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if node.op_type == "Div" and _scalar(b) == 6.0:
        return a
    if node.op_type == "Mul":
        for v, c in ((a, b), (b, a)):
            k = _scalar(c)
            if k is not None and np.isclose(k, 1.0 / 6.0, rtol=1e-6, atol=0.0):
                return v
    return None


def _relu6_of_x_plus_3(gate: ir.Value, x: ir.Value) -> list[ir.Node] | None:
    """``[Add, Clip]`` when ``gate`` is ``Clip(x + 3, 0, 6)`` read only on its way to the hard swish."""
    clip = gate.producer()
    if clip is None or clip.op_type != "Clip" or clip.domain not in DEFAULT_DOMAINS or len(clip.inputs) != 3:
        return None
    if _scalar(clip.inputs[1]) != 0.0 or _scalar(clip.inputs[2]) != 6.0:
        return None
    add = clip.inputs[0].producer()
    if add is None or add.op_type != "Add" or add.domain not in DEFAULT_DOMAINS or len(add.inputs) != 2:
        return None
    a, b = add.inputs
    if not ((a is x and _scalar(b) == 3.0) or (b is x and _scalar(a) == 3.0)):
        return None
    if _only_reader(add.outputs[0]) is not clip:
        return None
    return [add, clip]


def _written_out_hard_swish(end: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    """``(x, nodes)`` when ``end`` closes ``x * Clip(x + 3, 0, 6) / 6`` (the product divided, or the gate)."""
    product = _is_sixth(end)
    if product is not None:  # (x * relu6(x + 3)) / 6
        mul = product.producer()
        if mul is None or mul.op_type != "Mul" or mul.domain not in DEFAULT_DOMAINS or _only_reader(product) is not end:
            return None
        for x, gate in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            found = _relu6_of_x_plus_3(gate, x)
            if found is not None and _only_reader(gate) is mul:
                return x, [*found, mul, end]
    if end.op_type == "Mul" and end.domain in DEFAULT_DOMAINS and len(end.inputs) == 2:  # x * (relu6(x + 3) / 6)
        for x, gate in ((end.inputs[0], end.inputs[1]), (end.inputs[1], end.inputs[0])):
            divide = gate.producer()
            inner = _is_sixth(divide) if divide is not None else None
            if inner is None or _only_reader(gate) is not end:
                continue
            found = _relu6_of_x_plus_3(inner, x)
            if found is not None and _only_reader(inner) is divide:
                return x, [*found, divide, end]
    return None


def _hard_swishes(graph: ir.Graph) -> list[tuple[ir.Node, ir.Value, list[ir.Node]]]:
    """Every hard swish the graph writes out: (its last node, x, the nodes)."""
    found, taken = [], set()
    for node in graph:
        if node.op_type == "HardSigmoid" and node.domain in DEFAULT_DOMAINS:
            partner = _hard_swish_partner(node)
            if partner is not None:
                found.append((partner, node.inputs[0], [node, partner]))
        elif node.op_type in ("Div", "Mul"):
            match = _written_out_hard_swish(node)
            if match is not None:
                found.append((node, *match))
    out = []
    for end, x, nodes in found:  # a node belongs to one match at most
        if not taken.intersection(id(n) for n in nodes):
            taken.update(id(n) for n in nodes)
            out.append((end, x, nodes))
    return out


def hard_swish_one_op(model: ir.Model) -> int:
    found = _hard_swishes(model.graph)
    if not found:
        return 0
    if convert_opset(model, HARD_SWISH_OPSET):  # a new graph: match again in it
        found = _hard_swishes(model.graph)
    graph = model.graph
    for end, x, nodes in found:
        swish = ir.node("HardSwish", [x], name=f"{end.name}/hardswish")
        _replace(graph, end, [swish], nodes)
    drop_unused_initializers(graph)
    return len(found)


def _written_out_layer_norms(model: ir.Model) -> bool:
    """Whether the graph may hold a layer normalisation written out (a ReduceMean and a Sqrt): the matcher decides;
    this keeps a file without either at its own opset."""
    ops = {n.op_type for n in model.graph if n.domain in DEFAULT_DOMAINS}
    return {"ReduceMean", "Sqrt"} <= ops


def layer_norm_one_op(model: ir.Model) -> int:
    """A layer normalisation over the last axis written out (its mean, the deviation, its square or ``Pow`` 2, their
    mean, ``+ eps``, ``Sqrt``, divided or times the reciprocal, times the scale, plus the bias) becomes one
    ``LayerNormalization``: onnxscript's fusion rules match it, at opset ``LAYER_NORM_OPSET`` (where ReduceMean reads
    its axes as an input, the form they match; the file is converted when older)."""
    if not _written_out_layer_norms(model):
        return 0
    before = ir.to_proto(model)
    convert_opset(model, LAYER_NORM_OPSET)
    for node in model.graph:  # the matcher asks for keepdims=1 stated; absent means the same (Paddle's export)
        if node.op_type == "ReduceMean" and node.domain in DEFAULT_DOMAINS and "keepdims" not in node.attributes:
            node.attributes["keepdims"] = ir.AttrInt64("keepdims", 1)
    n = fuse_layer_normalization(model)
    if not n:  # nothing of that form: the file as it came, at its own opset
        replace_model(model, ir.from_proto(before))
        return 0
    onnxscript.optimizer.remove_unused_nodes(model)
    drop_unused_initializers(model.graph)
    return n


def _values_per_sample(value: ir.Value) -> int | None:
    """How many values one sample of ``value`` holds (None when a dim past the batch is not a number)."""
    if value.shape is None:
        return None
    dims = value.shape.dims[1:]
    return int(np.prod(dims)) if all(isinstance(d, int) for d in dims) else None


def _prelus(graph: ir.Graph) -> list[ir.Node]:
    return [p for p in graph if p.op_type == "PRelu" and p.domain in DEFAULT_DOMAINS and len(p.inputs) == 2]


def _slopes_at_most_one(slope: ir.Value) -> bool:
    const = slope.const_value
    return const is not None and bool(np.all(const.numpy() <= 1.0))


def prelu_written_out(model: ir.Model) -> int:
    """PRelu on a tensor of at least ``PRELU_MIN_VALUES`` values per sample, exactly: ``Max(x, x * slope)``
    when every slope is at most 1 (two kernels), else ``Relu(x) + Min(x, 0) * slope`` (four)."""
    if not _prelus(model.graph):
        return 0
    if any(p.inputs[0].shape is None for p in _prelus(model.graph)):  # the size of what each one reads
        replace_model(model, ir.from_proto(onnx.shape_inference.infer_shapes(ir.to_proto(model))))
    graph = model.graph
    found = [p for p in _prelus(graph) if (_values_per_sample(p.inputs[0]) or PRELU_MIN_VALUES) >= PRELU_MIN_VALUES]
    if not found:
        return 0
    zero = None
    for node in found:
        x, slope = node.inputs
        if _slopes_at_most_one(slope):  # x >= a*x for x >= 0 and a*x >= x for x < 0 when every a <= 1
            scaled = ir.node("Mul", [x, slope], name=f"{node.name}/slope")
            nodes = [scaled, ir.node("Max", [x, scaled.outputs[0]], name=f"{node.name}/max")]
        else:
            if zero is None:
                zero = fresh_initializer(graph, "prelu/zero", 0.0)
            relu = ir.node("Relu", [x], name=f"{node.name}/relu")
            negative = ir.node("Min", [x, zero], name=f"{node.name}/min")
            scaled = ir.node("Mul", [negative.outputs[0], slope], name=f"{node.name}/slope")
            nodes = [relu, negative, scaled, ir.node("Add", [relu.outputs[0], scaled.outputs[0]], name=f"{node.name}/add")]
        _replace(graph, node, nodes, node)
    return len(found)


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
        scale = fresh_initializer(graph, f"{bn.name}/factor", factor.reshape(per_channel))
        shift = fresh_initializer(graph, f"{bn.name}/shift", (beta - mean * factor).reshape(per_channel))
        mul = ir.node("Mul", [x, scale], name=f"{bn.name}/mul")
        add = ir.node("Add", [mul.outputs[0], shift], name=f"{bn.name}/add")
        _replace(graph, bn, [mul, add], bn)
        n += 1
    if n:
        drop_unused_initializers(graph)
    return n


def _slice_constants(node: ir.Node) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """A Slice's starts, ends, axes and steps when stored (opset 10+ inputs; axes and steps filled in)."""
    values = []
    for index in range(1, 5):
        value = node.inputs[index] if len(node.inputs) > index else None
        if value is None:
            values.append(None)
            continue
        axes = constant_axes(value)
        if axes is None:
            return None
        values.append(axes)
    starts, ends, axes, steps = values
    if starts is None or ends is None:
        return None
    axes = list(range(len(starts))) if axes is None else axes
    return starts, ends, axes, [1] * len(starts) if steps is None else steps


def slice_rank_lowered(limit: int):
    """The pass body: a ``Slice`` of a rank-``R`` input (``R > limit``, a static shape) along one axis ``a`` becomes
    ``Reshape`` to ``[d0 * .. * d(a-1), da, d(a+1) * .. * d(R-1)]``, the same ``Slice`` on axis 1 of that rank-3
    view, and ``Reshape`` back to the slice's shape: the same elements in the same order (row-major), so the same
    bytes. One view per input and axis, however many slices read it (an attention's q, k and v)."""

    def run(model: ir.Model) -> int:
        found = [s for s in model.graph if s.op_type == "Slice" and s.domain in DEFAULT_DOMAINS and s.inputs
                 and s.inputs[0] is not None]
        if any(s.inputs[0].shape is None for s in found):
            replace_model(model, ir.from_proto(onnx.shape_inference.infer_shapes(ir.to_proto(model))))
        graph = model.graph
        views: dict[tuple[str, int], ir.Value] = {}
        n = 0
        for node in [s for s in graph if s.op_type == "Slice" and s.domain in DEFAULT_DOMAINS and s.inputs]:
            x = node.inputs[0]
            dims = None if x is None or x.shape is None else tuple(x.shape.dims)
            constants = _slice_constants(node)
            if (dims is None or len(dims) <= limit or not all(isinstance(d, int) for d in dims) or constants is None
                    or len(constants[2]) != 1):  # one sliced axis: the form of a q, k, v split
                continue
            (start,), (end,), (axis,), (step,) = constants
            axis %= len(dims)
            kept = len(range(*slice(start, end, step).indices(dims[axis])))
            before, after = int(np.prod(dims[:axis], dtype=np.int64)), int(np.prod(dims[axis + 1:], dtype=np.int64))
            key = (x.name, axis)
            made = []
            if key not in views:
                shape = fresh_initializer(graph, f"{node.name}/view_shape", np.array([before, dims[axis], after]), np.int64)
                view = ir.node("Reshape", [x, shape], name=f"{node.name}/view")
                view.outputs[0].dtype, view.outputs[0].shape = x.dtype, ir.Shape((before, dims[axis], after))
                made.append(view)
                views[key] = view.outputs[0]
            ints = {k: fresh_initializer(graph, f"{node.name}/{k}", np.array([v]), np.int64)
                    for k, v in (("starts", start), ("ends", end), ("axes", 1), ("steps", step))}
            part = ir.node("Slice", [views[key], ints["starts"], ints["ends"], ints["axes"], ints["steps"]],
                           name=f"{node.name}/rank3")
            part.outputs[0].dtype, part.outputs[0].shape = x.dtype, ir.Shape((before, kept, after))
            out_dims = dims[:axis] + (kept,) + dims[axis + 1:]
            back_shape = fresh_initializer(graph, f"{node.name}/back_shape", np.array(out_dims), np.int64)
            back = ir.node("Reshape", [part.outputs[0], back_shape], name=f"{node.name}/back")
            back.outputs[0].dtype, back.outputs[0].shape = x.dtype, ir.Shape(out_dims)
            if made:  # the shared view, before the first slice that reads it
                graph.insert_before(node, made)
            _replace(graph, node, [part, back], node)
            n += 1
        if n:
            drop_unused_initializers(graph)
        return n

    return run


def passes_for(target: Target, sample: Feed | None, run_outputs) -> tuple[Pass, ...]:
    """The rewrites ``target`` needs, in order (none for a runtime that reads the file as is)."""
    passes = []
    if not target.dynamic_batch and sample is not None:
        passes.append(static_shapes(sample, run_outputs))
    if not target.runs_lone_batch_norm:
        passes.append(Pass("batch_norm_written_out", batch_norm_written_out, "float",
                           f"{target.name} runs BatchNormalization only folded into a Conv: per-channel Mul/Add"))
    if target.hard_swish_faster_as_one_op:
        passes.append(Pass("hard_swish_one_op", hard_swish_one_op, "float",
                           f"{target.name} runs a hard swish faster as one HardSwish than written out"))
    if target.prelu_slower_than_written_out:
        passes.append(_prelu_pass(target))
    if not target.has_hard_sigmoid:
        passes.append(Pass("hard_sigmoid_written_out", hard_sigmoid_written_out, "float",
                           f"{target.name} has no HardSigmoid: HardSwish where it is one, else Mul/Add/Relu6/Mul"))
    if target.spatial_mean_as_global_pool:
        passes.append(_mean_pass(target, "float"))
    if not target.runs_written_out_layer_norm:
        passes.append(Pass("layer_norm_one_op", layer_norm_one_op, "float",
                           f"{target.name} normalises a layer in one LayerNormalization kernel, not written out"))
    if target.max_slice_rank is not None:
        passes.append(Pass("slice_rank_lowered", slice_rank_lowered(target.max_slice_rank), "exact",
                           f"{target.name} slices tensors of rank {target.max_slice_rank} at most: a rank-3 view"))
    return tuple(passes)


def _scalar_scale(q_or_dq: ir.Node) -> float | None:
    """The per-tensor scale of a QuantizeLinear/DequantizeLinear stored as a constant (None otherwise)."""
    if len(q_or_dq.inputs) < 2 or q_or_dq.inputs[1] is None or q_or_dq.inputs[1].const_value is None:
        return None
    scale = q_or_dq.inputs[1].const_value.numpy()
    return float(scale.reshape(-1)[0]) if scale.size == 1 else None


def _clip_bounds(clip: ir.Node) -> tuple[float, float] | None:
    if clip.op_type != "Clip" or clip.domain not in DEFAULT_DOMAINS or len(clip.inputs) != 3:
        return None
    low, high = _scalar(clip.inputs[1]), _scalar(clip.inputs[2])
    return None if low is None or high is None else (low, high)


def _pair(graph: ir.Graph, x: ir.Value, like: ir.Node, scale: float, name: str) -> tuple[list[ir.Node], ir.Value]:
    """``x`` through a QuantizeLinear -> DequantizeLinear pair of one ``scale``, with ``like``'s zero point
    (its dtype: the integers' type) and attributes: (the two nodes, the pair's output)."""
    s = fresh_initializer(graph, f"{name}/scale", scale)
    attributes = {a.name: a.value for a in like.attributes.values()}
    q = ir.node("QuantizeLinear", [x, s, *like.inputs[2:]], attributes=attributes, name=f"{name}/quantize")
    dq = ir.node("DequantizeLinear", [q.outputs[0], s, *like.inputs[2:]], attributes=attributes, name=f"{name}/dequantize")
    zero = like.inputs[2] if len(like.inputs) > 2 and like.inputs[2] is not None else None
    q.outputs[0].dtype = zero.dtype if zero is not None else ir.DataType.UINT8
    q.outputs[0].shape = dq.outputs[0].shape = x.shape
    dq.outputs[0].dtype = ir.DataType.FLOAT
    return [q, dq], dq.outputs[0]


def clip_as_relu6(model: ir.Model) -> int:
    """In a QDQ graph, ``DQ(q; s, z) -> Clip(0, c) -> Q(s', z')`` with ``c`` other than 6 becomes ``DQ(q; s, z) ->
    Mul(k) -> Q/DQ(k s, z) -> Clip(0, 6) -> Q/DQ(k s', z') -> Mul(1 / k) -> Q(s', z')`` with ``k = 6 / c``: the same
    integers in and out, through a Relu6, each pair of one scale. (Read at ``k`` times the scale by the
    DequantizeLinear alone, a pair of two scales, TiGrIS 0.12.1 read the Clip's input at the QuantizeLinear's
    scale: a hard sigmoid's gate off by up to 161 steps in the PP-OCRv4 detector's PyTorch-path file.)"""
    graph = model.graph
    n = 0
    for clip in list(graph):
        bounds = _clip_bounds(clip)
        if bounds is None or bounds[0] != 0.0 or bounds[1] <= 0.0 or bounds[1] == 6.0:
            continue
        dq, out = clip.inputs[0].producer(), clip.outputs[0]
        readers = [u.node for u in out.uses()]
        if dq is None or dq.op_type != "DequantizeLinear" or _scalar_scale(dq) is None or out.is_graph_output() \
                or not readers or any(r.op_type != "QuantizeLinear" or _scalar_scale(r) is None for r in readers):
            continue
        k = 6.0 / bounds[1]
        up = ir.node("Mul", [clip.inputs[0], fresh_initializer(graph, f"{clip.name}/times", k)], name=f"{clip.name}/x{k:g}")
        up.outputs[0].dtype, up.outputs[0].shape = ir.DataType.FLOAT, clip.inputs[0].shape
        pair, wide = _pair(graph, up.outputs[0], dq, k * _scalar_scale(dq), f"{clip.name}/in_x{k:g}")
        graph.insert_before(clip, [up, *pair])
        clip.replace_input_with(0, wide)
        clip.replace_input_with(2, fresh_initializer(graph, f"{clip.name}/six", 6.0))
        for j, q in enumerate(readers):
            name = f"{clip.name}/out{j}_x{k:g}"
            pair, wide = _pair(graph, out, q, k * _scalar_scale(q), name)
            down = ir.node("Mul", [wide, fresh_initializer(graph, f"{name}/back", 1.0 / k)], name=f"{name}/back")
            down.outputs[0].dtype, down.outputs[0].shape = ir.DataType.FLOAT, out.shape
            graph.insert_before(q, [*pair, down])
            q.replace_input_with(0, down.outputs[0])
        n += 1
    if n:
        drop_unused_initializers(graph)
    return n


def _without_activation_pairs(model: ir.Model) -> ir.Model:
    """A copy of a QDQ graph with every activation Q -> DQ pair read through and every DequantizeLinear of a
    stored tensor replaced by its float values (what a float matcher reads); node names are kept."""
    view = ir.from_proto(ir.to_proto(model))
    graph = view.graph
    for dq in [n for n in graph if n.op_type == "DequantizeLinear" and not n.outputs[0].is_graph_output()]:
        q = dq.inputs[0].producer()
        if q is not None and q.op_type == "QuantizeLinear":
            dq.outputs[0].replace_all_uses_with(q.inputs[0])
        elif all(v is None or v.const_value is not None for v in dq.inputs) and len(dq.inputs) == 3:
            stored, scale, zero = (v.const_value.numpy() for v in dq.inputs)
            if stored.size == 1 and scale.size == 1:  # a scalar operand (a weight keeps its DequantizeLinear)
                values = (stored.astype(np.int32) - zero.astype(np.int32)).astype(np.float32) * scale
                dq.outputs[0].replace_all_uses_with(fresh_initializer(graph, f"{dq.name}/value", values))
    graph.remove([n for n in graph if n.op_type in ("QuantizeLinear", "DequantizeLinear")
                  and not any(o.uses() or o.is_graph_output() for o in n.outputs)], safe=True)
    graph.remove([n for n in graph if n.op_type == "QuantizeLinear"
                  and not any(o.uses() or o.is_graph_output() for o in n.outputs)], safe=True)
    return view


def hard_swish_one_op_quantized(model: ir.Model) -> int:
    """Each hard swish ``hard_swish_one_op`` finds in the graph read without its activation pairs becomes one
    ``HardSwish`` reading the DequantizeLinear its first op read, writing the value its last op wrote (read
    by that op's QuantizeLinear); the pairs between its ops are dropped."""
    if default_opset(model) < HARD_SWISH_OPSET:
        return 0
    found = _hard_swishes(_without_activation_pairs(model).graph)
    if not found:
        return 0
    graph = model.graph
    by_name = {n.name: n for n in graph}
    n = 0
    for end, x, nodes in found:
        real = [by_name.get(v.name) for v in nodes]
        first = next((r for r, v in zip(real, nodes) if r is not None and x in v.inputs), None)
        if any(r is None for r in real) or first is None:
            continue
        x_real = first.inputs[list(next(v for v in nodes if v.name == first.name).inputs).index(x)]
        last = by_name[end.name]
        inner = {id(o) for r in real if r is not last for o in r.outputs}
        pairs = [u.node for r in real if r is not last for o in r.outputs for u in o.uses()
                 if u.node.op_type == "QuantizeLinear"]
        pairs += [u.node for q in pairs for u in q.outputs[0].uses() if u.node.op_type == "DequantizeLinear"]
        readers = {id(u.node) for r in real if r is not last for o in r.outputs for u in o.uses()}
        if readers - {id(r) for r in real} - {id(q) for q in pairs} or any(id(o) in inner for o in graph.outputs):
            continue  # an inner value is read outside the hard swish: left as it is
        if any(u.node not in real for q in pairs if q.op_type == "DequantizeLinear" for u in q.outputs[0].uses()):
            continue
        swish = ir.node("HardSwish", [x_real], name=f"{last.name}/hardswish")
        _replace(graph, last, [swish], [*real, *pairs])
        n += 1
    if n:
        graph.remove([d for d in graph if d.op_type == "DequantizeLinear" and not any(o.uses() for o in d.outputs)
                      and not any(o.is_graph_output() for o in d.outputs)], safe=True)
        drop_unused_initializers(graph)
    return n


def _reduce_axes(node: ir.Node) -> list[int] | None:
    """A ReduceMean's axes: its attribute (opset < 18) or its constant second input (opset 18); None when
    they are computed, [] when absent (every axis)."""
    attribute = node.attributes.get("axes")
    if attribute is not None:
        return [int(a) for a in attribute.value]
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        return constant_axes(node.inputs[1])
    return []


def spatial_mean_as_global_pool(model: ir.Model) -> int:
    """``ReduceMean(x, axes=[2, 3], keepdims=1)`` of a rank-4 (NCHW) ``x`` becomes ``GlobalAveragePool(x)``: the
    mean of each channel's H x W values, the same op, which ONNX Runtime's kernels sum in another order (floats an
    ulp or two apart: ``_mean_pass`` says how each graph proves it)."""
    graph = model.graph
    n = 0
    for node in list(graph):
        if node.op_type != "ReduceMean" or node.domain not in DEFAULT_DOMAINS or not node.inputs:
            continue
        x = node.inputs[0]
        keepdims = node.attributes.get("keepdims")
        axes = _reduce_axes(node)
        if (x is None or x.shape is None or len(x.shape) != 4 or (keepdims is not None and int(keepdims.value) != 1)
                or axes is None or sorted(a % 4 for a in axes) != [2, 3]):
            continue
        pool = ir.node("GlobalAveragePool", [x], name=f"{node.name}/global_pool")
        pool.outputs[0].dtype, pool.outputs[0].shape = node.outputs[0].dtype, node.outputs[0].shape
        _replace(graph, node, [pool], node)
        n += 1
    if n:
        drop_unused_initializers(graph)
    return n


def _mean_pass(target: Target, proof: str = "exact") -> Pass:
    """The one mean rewrite, on the float graph (ONNX path) and on the exported QDQ graph (PyTorch path). The same
    mean, but ONNX Runtime's two kernels sum in another order (float results an ulp or two apart): on the float
    graph it is proven within the float tolerance; on a QDQ graph by bytes, and left out where a rounding moves
    (``export.qdq.SAME_OP_FORMS``)."""
    return Pass("spatial_mean_as_global_pool", spatial_mean_as_global_pool, proof,
                f"{target.name} runs a mean over H and W as a global average pool")


def _prelu_pass(target: Target) -> Pass:
    """The one PRelu rewrite, on the float graph (ONNX path) and on the exported QDQ graph (PyTorch path)."""
    return Pass("prelu_written_out", prelu_written_out, "exact",
                f"{target.name}'s PRelu kernel is slower than Max(x, x * slope) or Relu(x) + Min(x, 0) * slope")


def exported_forms(target: Target) -> tuple[Pass, ...]:
    """The exact rewrites ``target`` needs that also apply to a quantized (QDQ) graph, in order: what
    ``export_qdq`` runs on the PyTorch path's file (the float passes need the float graph: the ONNX path's)."""
    passes = []
    if target.prelu_slower_than_written_out:
        passes.append(_prelu_pass(target))
    if not target.has_hard_sigmoid:
        passes.append(Pass("clip_as_relu6", clip_as_relu6, "exact",
                           f"{target.name} runs Clip(0, 6) (Relu6) and no other Clip: a hard sigmoid's Clip(0, 1) at 6x scale"))
    if target.spatial_mean_as_global_pool:
        passes.append(_mean_pass(target))
    return tuple(passes)
