"""Normalisation passes: the float file rewritten into the form the quantizer reads, each a small pass.

Every pass has one job and says how it is proven (``Pass.proof``): ``"exact"`` passes must give
byte-identical outputs in ONNX Runtime before and after on the calibration data; ``"float"`` passes
(folding a BatchNormalization or a bias Add into the Conv before it, what every quantizer does
before it quantizes a weight) change float rounding only and must agree to ``FLOAT_TOLERANCE`` (relative), or
to ``NOISE_FACTOR`` times what ONNX Runtime's own optimizations move the outputs by (the float rounding the
model amplifies), whichever is larger.
``quantizer.normalise`` runs the list on onnx-ir's pass manager (``quantizer.ProvenPass``: the proof is
each pass's ``ensures()``) and refuses a pass that fails it. None of them renames a
graph input or output, drops a dynamic dimension or removes an output.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quantship.export.ir_edit import (  # noqa: F401  (the passes' shared edits; front-end modules import them from here)
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

MIN_OPSET = 13  # per-channel QuantizeLinear/DequantizeLinear (`axis`) arrived in opset 13
FLOAT_TOLERANCE = 1e-4  # relative to the output's largest magnitude, for the "float" passes
NOISE_FACTOR = 4.0  # or this many times what ONNX Runtime's own optimizations move the float outputs by (a chaotic
# network amplifies two last-bit perturbations to amounts 2-3x apart: measured 0.172 vs 0.082 on EfficientNet-B0)
# data-movement ops a constant can be pushed through with numpy, bit for bit
_FOLDABLE = ("Reshape", "Unsqueeze", "Squeeze", "Transpose", "Identity", "Flatten")


def initializers_out_of_inputs(model: ir.Model) -> int:
    """Initializers also listed as graph inputs (old exporters) stop being inputs: they are weights."""
    graph = model.graph
    if model.ir_version < 4:
        return 0
    kept = [v for v in graph.inputs if not v.is_initializer()]
    dropped = len(graph.inputs) - len(kept)
    if dropped:
        graph.inputs.clear()
        graph.inputs.extend(kept)
    return dropped


def fold_constant_moves(model: ir.Model) -> int:
    """Data-movement ops (Reshape, Unsqueeze...) whose every input is a constant become an initializer
    holding their result (computed by numpy: the same bytes rearranged)."""
    graph = model.graph
    n = 0
    for node in list(graph):
        if node.op_type not in _FOLDABLE or node.domain not in DEFAULT_DOMAINS or len(node.outputs) != 1:
            continue
        values = [v.const_value.numpy() if v is not None and v.const_value is not None else None for v in node.inputs]
        if not values or any(v is None for v in values) or node.outputs[0].is_graph_output():
            continue
        folded = _move(node, values)
        if folded is None:
            continue
        out = node.outputs[0]
        name = out.name
        fresh = ir.Value(name=None, shape=ir.Shape(folded.shape), type=ir.TensorType(ir.DataType.from_numpy(folded.dtype)),
                         const_value=ir.tensor(folded))
        out.replace_all_uses_with(fresh)
        graph.remove(node, safe=True)
        fresh.name = name if name not in graph.initializers else f"{name}_folded"
        fresh.const_value.name = fresh.name
        graph.register_initializer(fresh)
        n += 1
    drop_unused_initializers(graph)
    return n


def _move(node: ir.Node, values: list[np.ndarray]) -> np.ndarray | None:
    x = values[0]
    op = node.op_type
    if op == "Identity":
        return x.copy()
    if op == "Reshape":
        shape = [int(d) for d in values[1]]
        allowzero = node.attributes.get("allowzero")
        if not (allowzero is not None and allowzero.value):
            shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return x.reshape(shape)
    if op == "Transpose":
        perm = node.attributes.get("perm")
        return np.transpose(x, list(perm.value) if perm is not None else None).copy()
    if op == "Flatten":
        axis = node.attributes.get("axis")
        a = int(axis.value) if axis is not None else 1
        a = a + x.ndim if a < 0 else a
        return x.reshape(int(np.prod(x.shape[:a], dtype=np.int64)), -1)
    axes_attr = node.attributes.get("axes")
    axes = [int(a) for a in (values[1] if len(values) > 1 else (axes_attr.value if axes_attr is not None else []))]
    if op == "Unsqueeze":
        out = x
        rank = x.ndim + len(axes)
        for a in sorted(a + rank if a < 0 else a for a in axes):
            out = np.expand_dims(out, a)
        return out
    if op == "Squeeze":
        return np.squeeze(x, axis=tuple(axes) if axes else None)
    return None


def dynamic_dims(model: ir.Model) -> int:
    """Graph input/output dims declared ``-1`` or ``0`` become named symbolic dims (ONNX Runtime reads
    a negative dim as dynamic already; ``0`` would only take empty tensors)."""
    n = 0
    for values in (model.graph.inputs, model.graph.outputs):
        for value in values:
            if value.shape is None:
                continue
            dims = list(value.shape.dims)
            fixed = [d if not (isinstance(d, int) and d <= 0) else ir.SymbolicDim(f"{value.name}_dim{i}")
                     for i, d in enumerate(dims)]
            if fixed != dims:
                value.shape = ir.Shape(fixed)
                n += 1
    for node in model.graph:
        for value in node.outputs:
            if value.shape is not None and any(isinstance(d, int) and d <= 0 for d in value.shape.dims):
                value.shape = None  # an intermediate's recorded shape is only a hint; drop a wrong one
    return n


def upgrade_opset(model: ir.Model) -> int:
    """Files below opset 13 are converted to 13 (``onnx.version_converter``): per-channel Q/DQ needs it."""
    return convert_opset(model, MIN_OPSET)


def _single_use(value: ir.Value) -> bool:
    return len(value.uses()) == 1 and not value.is_graph_output()


def _conv_weight(node: ir.Node) -> np.ndarray | None:
    if node.op_type != "Conv" or len(node.inputs) < 2 or node.inputs[1] is None:
        return None
    const = node.inputs[1].const_value
    return None if const is None else const.numpy()


def _set_conv_params(graph: ir.Graph, conv: ir.Node, weight: np.ndarray, bias: np.ndarray) -> None:
    base = conv.name or conv.outputs[0].name
    for index, array, suffix in ((1, weight, "weight_folded"), (2, bias, "bias_folded")):
        name, k = f"{base}_{suffix}", 0
        while name in graph.initializers:
            k += 1
            name = f"{base}_{suffix}_{k}"
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.FLOAT),
                         const_value=ir.tensor(array.astype(np.float32), name=name))
        graph.register_initializer(value)
        if index < len(conv.inputs):
            conv.replace_input_with(index, value)
        else:
            conv.resize_inputs(3)
            conv.replace_input_with(2, value)


def _conv_bias(conv: ir.Node, channels: int) -> np.ndarray | None:
    if len(conv.inputs) > 2 and conv.inputs[2] is not None:
        const = conv.inputs[2].const_value
        return None if const is None else const.numpy().astype(np.float64)
    return np.zeros(channels, dtype=np.float64)


def fold_batch_norm(model: ir.Model) -> int:
    """Conv -> BatchNormalization (inference form, constant statistics) becomes one Conv with scaled
    weights and bias: the weights the integer kernel will run are the folded ones."""
    graph = model.graph
    n = 0
    for bn in list(graph):
        if bn.op_type != "BatchNormalization" or bn.domain not in DEFAULT_DOMAINS or len(bn.outputs) != 1:
            continue
        conv = bn.inputs[0].producer() if bn.inputs[0] is not None else None
        if conv is None or not _single_use(bn.inputs[0]) or len(conv.outputs) != 1:
            continue
        weight = _conv_weight(conv)
        stats = batch_norm_statistics(bn)
        if weight is None or stats is None or weight.dtype != np.float32:
            continue
        bias = _conv_bias(conv, weight.shape[0])
        if bias is None:
            continue
        factor, beta, mean = stats
        shape = (-1,) + (1,) * (weight.ndim - 1)
        _set_conv_params(graph, conv, weight.astype(np.float64) * factor.reshape(shape), (bias - mean) * factor + beta)
        _bypass(graph, bn, conv)
        n += 1
    drop_unused_initializers(graph)
    return n


def _bypass(graph: ir.Graph, node: ir.Node, producer: ir.Node) -> None:
    """Remove ``node`` (whose input is ``producer``'s only output): its consumers read ``producer``,
    which takes over the name of ``node``'s output (graph outputs keep their names)."""
    out, mid = node.outputs[0], producer.outputs[0]
    name = out.name
    was_output = out.is_graph_output()
    out.replace_all_uses_with(mid)
    if was_output:
        index = list(graph.outputs).index(out)
        graph.outputs[index] = mid
    graph.remove(node, safe=True)  # its inputs forget it as a user: placement counts uses
    mid.name = name
    if out.shape is not None and mid.shape is None:
        mid.shape = out.shape


def fold_bias_add(model: ir.Model) -> int:
    """Conv -> Add(constant of one value per output channel) becomes the Conv's bias (Paddle writes a
    Conv without bias, then an Add of the bias reshaped to [1, C, 1, 1])."""
    graph = model.graph
    n = 0
    for add in list(graph):
        if add.op_type != "Add" or add.domain not in DEFAULT_DOMAINS or len(add.inputs) != 2:
            continue
        for data_index in (0, 1):
            data, const = add.inputs[data_index], add.inputs[1 - data_index]
            conv = data.producer() if data is not None else None
            if conv is None or const is None or const.const_value is None or not _single_use(data):
                continue
            weight = _conv_weight(conv)
            if weight is None or len(conv.outputs) != 1:
                continue
            addend = const.const_value.numpy()
            channels = weight.shape[0]
            rank = weight.ndim  # the Conv output has the weight's rank
            per_channel = (addend.ndim == rank and addend.shape[1] == channels) or (
                addend.ndim == rank - 1 and addend.shape[0] == channels)  # [1, C, 1, 1] or [C, 1, 1]
            if addend.dtype != np.float32 or addend.size != channels or not per_channel:
                continue
            bias = _conv_bias(conv, channels)
            if bias is None:
                continue
            _set_conv_params(graph, conv, weight, bias + addend.reshape(-1).astype(np.float64))
            _bypass(graph, add, conv)
            n += 1
            break
    drop_unused_initializers(graph)
    return n


def name_nodes(model: ir.Model) -> int:
    """Every node without a name, or with a name another node already holds, named ``{op_type}_{n}`` (a name no
    other node of the model holds). ONNX allows unnamed nodes (torch's exporter writes some), but the rewrites
    name their nodes after the node they replace, and ONNX Runtime refuses two nodes of one name."""
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    taken = {n.name for n in nodes if n.name}
    seen: set[str] = set()
    counter = 0
    renamed = 0
    for node in nodes:
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        while f"{node.op_type}_{counter}" in taken:
            counter += 1
        node.name = f"{node.op_type}_{counter}"
        taken.add(node.name)
        seen.add(node.name)
        renamed += 1
    return renamed


PASSES: tuple[Pass, ...] = (
    Pass("name_nodes", name_nodes, "exact", "every node has a name of its own (the rewrites name theirs after it)"),
    Pass("lift_constants", lift_constants, "exact", "weights held in Constant nodes are read as weights"),
    Pass("initializers_out_of_inputs", initializers_out_of_inputs, "exact",
         "an initializer listed as an input is a weight, not something to feed"),
    Pass("fold_constant_moves", fold_constant_moves, "exact",
         "a reshaped constant (a Paddle bias) is a constant"),
    Pass("dynamic_dims", dynamic_dims, "exact", "-1 and 0 dims are dynamic, as ONNX Runtime reads them"),
    # an opset conversion keeps the ops' meaning, but ONNX Runtime may run another kernel for the newer version of
    # an op, which rounds in another order (AveragePool from 19: the PP-OCRv4 recognizer converted to 21 for 16-bit
    # activations moved 7.6e-6 on values of 60, int16.OPSET_PASS): "float"
    Pass("upgrade_opset", upgrade_opset, "float", "per-channel Q/DQ needs opset 13"),
    Pass("fold_batch_norm", fold_batch_norm, "float", "the integer kernel runs the folded weights"),
    Pass("fold_bias_add", fold_bias_add, "float", "a bias added after the Conv is the Conv's bias"),
)
