"""Bias correction, full (empirical, per layer): each quantized layer's float bias moves so that the mean
of its output per channel, in the quantized model, matches the float model's on the calibration data.

Quantizing weights and the activations before a layer shifts the mean of its output (Nagel et al. 2019,
section 4.2; NNCF's full bias correction and AIMET's empirical bias correction measure that shift on
data). Here the quantized model is run as the file will be (Q/DQ pairs of every earlier layer in place,
their biases already corrected), so the errors of earlier layers are included, and each layer's bias
(Conv, ConvTranspose, Gemm: its own bias input; MatMul: the constant of the Add that follows it) gets
``bias -= mean_quantized - mean_float``. A layer without a bias gets one (a new initializer); a MatMul
without a bias Add is left alone and counted as skipped.

Exact in few passes: a layer's output depends only on the biases of the layers upstream of it, so the
layers are grouped by depth (the longest chain of corrected layers above them); every layer of one
depth is measured in the same pass, after every shallower depth is corrected. The cost is one
calibration pass of the float model plus one of the quantized model per depth. ONNX Runtime runs every
node of a session whatever is fetched (measured), so each depth's session holds only the nodes its
layers' outputs need: a shallow depth is a short pass, and the passes together cost about half a
calibration pass per depth. The biases are inputs of those sessions, fed anew on each pass. The record,
the per-channel means, the depths and the update are ``quantize.algorithms.bias_correction``'s (shared with pt2e). Memory: per-channel sums only, accumulated batch by batch; a batch
whose fetched tensors would exceed ``calibrate.MEMORY_BUDGET`` runs in shorter slices.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from quantship.inspect.read.feeds import Feed
from quantship.quantize.algorithms.bias_correction import (
    BiasCorrection,
    ChannelMeans,
    corrected_bias,
    layer_depths,
)
from quantship.quantize_onnx.calibrate import MEMORY_BUDGET, TensorInfo, exposing_session
from quantship.quantize_onnx.normalize import fresh_initializer


@dataclass
class _Layer:
    node: ir.Node
    output: str  # the layer's output in the quantized model
    reference: str  # the same tensor's name in the float model
    axis: int  # the channel axis of the output
    bias: ir.Value | None = None  # the float initializer corrected
    divisor: float = 1.0  # Gemm's beta: the stored bias is added times beta
    depth: int = 0


def reference_name(value: ir.Value, float_names: set[str]) -> str | None:
    """The float model's name of a quantized model's tensor: the same, or (a graph output whose name
    moved to its DequantizeLinear) the name that pair's output took."""
    if value.name in float_names:
        return value.name
    for use in value.uses():
        if use.node.op_type == "QuantizeLinear":
            for dq in use.node.outputs[0].uses():
                name = dq.node.outputs[0].name
                if dq.node.op_type == "DequantizeLinear" and name in float_names:
                    return name
    return None


def _sole_reader(value: ir.Value):
    """The one use of ``value``, looking through its Q/DQ pair when it has one (None: several, or an output)."""
    for _ in range(3):  # the value, its QuantizeLinear's output, its DequantizeLinear's output
        uses = value.uses()
        if len(uses) != 1 or value.is_graph_output():
            return None
        if uses[0].node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            return uses[0]
        value = uses[0].node.outputs[0]
    return None


def _own_bias(graph: ir.Graph, node: ir.Node, index: int, channels: int) -> tuple[ir.Value | None, str | None]:
    """The float bias initializer at ``node.inputs[index]``, owned by this node only (a shared one is
    copied), or a new zero bias when there is none; (None, why) when it is not a per-channel constant."""
    value = node.inputs[index] if len(node.inputs) > index else None
    if value is None or not value.name:
        fresh = fresh_initializer(graph, f"{node.name or node.op_type}_bias", np.zeros(channels, np.float32))
        if len(node.inputs) <= index:
            node.resize_inputs(index + 1)
        node.replace_input_with(index, fresh)
        return fresh, None
    if value.const_value is None or value.const_value.dtype != ir.DataType.FLOAT:
        return None, "its bias is not a stored float tensor"
    array = value.const_value.numpy()
    if array.size != channels or array.shape[-1] != channels:
        return None, f"its bias of shape {list(array.shape)} is not one value per output channel"
    if len(value.uses()) > 1 or value.is_graph_output() or value.is_graph_input():
        fresh = fresh_initializer(graph, f"{value.name}_corrected", np.array(array, np.float32))
        node.replace_input_with(index, fresh)
        return fresh, None
    return value, None


def _layers(model: ir.Model, weighted: Sequence[ir.Node], info: dict[str, TensorInfo], float_names: set[str],
            report: BiasCorrection) -> list[_Layer]:
    graph = model.graph
    layers = []
    for node in weighted:
        label = node.name or node.op_type
        out = node.outputs[0]
        reference = reference_name(out, float_names)
        seen = info.get(reference) if reference else None
        if reference is None or seen is None or len(seen.shape) < 2:
            report.skipped[label] = "its output has no per-channel reading in the float model"
            continue
        axis = 1 if node.op_type in ("Conv", "ConvTranspose", "Gemm") else len(seen.shape) - 1
        channels = seen.shape[axis]
        divisor, why, bias = 1.0, None, None
        if node.op_type in ("Conv", "ConvTranspose"):
            added = len(node.inputs) < 3 or node.inputs[2] is None
            bias, why = _own_bias(graph, node, 2, channels)
        elif node.op_type == "Gemm":
            added = len(node.inputs) < 3 or node.inputs[2] is None
            beta = node.attributes["beta"].value if "beta" in node.attributes else 1.0
            if beta == 0:
                why = "its beta is 0 (the bias is not added)"
            else:
                divisor = float(beta)
                bias, why = _own_bias(graph, node, 2, channels)
        else:  # MatMul: the bias is the constant of the Add that reads it
            added = False
            use = _sole_reader(out)
            add = use.node if use is not None else None
            if add is None or add.op_type != "Add":
                why = "a MatMul without a bias Add after it"
            else:
                other = 1 - use.idx
                bias, why = _own_bias(graph, add, other, channels) if add.inputs[other].const_value is not None \
                    else (None, "its Add adds a computed tensor, not a stored bias")
        if bias is None:
            report.skipped[label] = why or "no bias to correct"
            continue
        report.n_added += int(added)
        layers.append(_Layer(node, out.name, reference, axis, bias, divisor))
    return layers


def assign_depths(model: ir.Model, layers: list[_Layer]) -> int:
    """Depth of each layer: the longest chain of corrected layers above it (0: none). Returns the count of depths."""
    by_node = {id(layer.node): layer for layer in layers}
    depths = layer_depths(model.graph, lambda n: n.inputs, lambda n: n.outputs, lambda n: id(n) in by_node)
    for key, depth in depths.items():
        by_node[key].depth = depth
    return 1 + max((layer.depth for layer in layers), default=-1)


def _needed(model: onnx.ModelProto, fetched: Sequence[str]) -> list[onnx.NodeProto]:
    """The nodes ``fetched`` depends on, in graph order (what a session computing only them must hold)."""
    producer = {o: i for i, n in enumerate(model.graph.node) for o in n.output if o}
    keep, todo = set(), [producer[name] for name in fetched if name in producer]
    while todo:
        i = todo.pop()
        if i in keep:
            continue
        keep.add(i)
        todo.extend(producer[v] for v in model.graph.node[i].input if v in producer)
    return [n for i, n in enumerate(model.graph.node) if i in keep]


def subgraph_session(model: onnx.ModelProto, fetched: Sequence[str], bias_inputs: Sequence[str] = ()):
    """A session of only the nodes ``fetched`` needs, the ``bias_inputs`` fed instead of stored."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    nodes = _needed(m, fetched)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    del m.graph.output[:]
    used = {v for n in nodes for v in n.input}
    kept = [t for t in m.graph.initializer if t.name in used]
    del m.graph.initializer[:]
    m.graph.initializer.extend(kept)
    bias_inputs = [b for b in bias_inputs if b in used]
    if bias_inputs:
        moved = set(bias_inputs)
        kept = [t for t in m.graph.initializer if t.name not in moved]
        for t in m.graph.initializer:
            if t.name in moved:
                m.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        del m.graph.initializer[:]
        m.graph.initializer.extend(kept)
    return exposing_session(m, fetched)


def _channel_means(session, names: Sequence[str], axes: Sequence[int], feeds: Sequence[Feed],
                   per_sample: int, extra: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
    """Mean per channel of each fetched tensor over every sample (sums accumulated batch by batch)."""
    sums = ChannelMeans(len(names))
    rows = max(1, MEMORY_BUDGET // max(per_sample, 1))
    for feed in feeds:
        n = len(next(iter(feed.values())))
        for start in range(0, n, rows):
            part = {k: v[start:start + rows] for k, v in feed.items()}
            outs = session.run(list(names), {**part, **(extra or {})})
            for k, (value, axis) in enumerate(zip(outs, axes)):
                sums.add(k, value, axis)
            del outs
    return sums.means()


def correct(model: ir.Model, float_model: onnx.ModelProto, weighted: Sequence[ir.Node], feeds: Sequence[Feed],
            info: dict[str, TensorInfo]) -> BiasCorrection:
    """Correct the biases of ``weighted`` (nodes of the quantized ``model``, in graph order) in place,
    against ``float_model`` (the same graph before Q/DQ placement) on ``feeds``."""
    start = time.perf_counter()
    report = BiasCorrection(samples=sum(len(next(iter(f.values()))) for f in feeds))
    float_names = {o for n in float_model.graph.node for o in n.output if o}
    layers = _layers(model, weighted, info, float_names, report)
    if not layers:
        report.seconds = time.perf_counter() - start
        return report
    n_depths = assign_depths(model, layers)

    def nbytes(names: Sequence[str]) -> int:
        return sum(info[n].bytes_per_sample for n in names if n in info)

    references = [layer.reference for layer in layers]
    target = _channel_means(subgraph_session(float_model, references), references, [layer.axis for layer in layers],
                            feeds, nbytes(references))
    target_of = {id(layer): t for layer, t in zip(layers, target)}
    biases = {layer.bias.name: np.array(layer.bias.const_value.numpy(), np.float32) for layer in layers}
    quantized = ir.to_proto(model)
    for depth in range(n_depths):
        level = [layer for layer in layers if layer.depth == depth]
        if not level:
            continue
        names = [layer.output for layer in level]
        session = subgraph_session(quantized, names, list(biases))
        fed = {i.name for i in session.get_inputs()}
        means = _channel_means(session, names, [layer.axis for layer in level], feeds,
                               nbytes([layer.reference for layer in level]),
                               {k: v for k, v in biases.items() if k in fed})
        report.n_passes += 1
        for layer, mean in zip(level, means):
            biases[layer.bias.name] = corrected_bias(biases[layer.bias.name], mean, target_of[id(layer)], report,
                                                     layer.divisor)
    for layer in layers:
        layer.bias.const_value = ir.tensor(biases[layer.bias.name], name=layer.bias.name)
    report.n_corrected = len(layers)
    report.seconds = time.perf_counter() - start
    return report
