"""The quantized layers whose integer weights a rounding algorithm (``seq_mse``, ``adaround``) rewrites,
their computation in torch, and the sequential pass that feeds each one its real inputs.

A layer is a Conv, Gemm or MatMul of the quantized model whose weight is read through its own
DequantizeLinear (int8 initializer, scale initializer). Its torch reading (``forward``) is checked
against ONNX Runtime's output of the same layer on the same inputs before anything is changed: a layer
it does not reproduce is skipped, with the reason.

Sequential: the layers are grouped by depth (``bias_correction.assign_depths``: the longest chain of
such layers above them). Each depth's inputs are read from the quantized model as it stands after every
shallower depth was rewritten (the Q/DQ pairs of the activations in place), so each layer sees the
inputs the already-quantized layers before it produce; its target is the float model's output of the
same layer (the asymmetric reconstruction of Nagel et al. 2020). A Relu that is the layer's only reader
is applied to both sides (negative outputs it zeroes cost nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
import torch
import torch.nn.functional as F

from quantship.inspect.read.feeds import Feed
from quantship.quantize.algorithms import rounding as rounding_math
from quantship.quantize_onnx.bias_correction import assign_depths, reference_name, subgraph_session
from quantship.quantize_onnx.calibrate import MEMORY_BUDGET, TensorInfo

SAMPLES = 64  # calibration samples each layer is fitted on (the leading batches)
CHECK_TOLERANCE = 1e-3  # torch reading vs ONNX Runtime's, relative to the output's largest magnitude


@dataclass
class WeightLayer:
    """One layer to rewrite: the node, its int8 weight and scale initializers, the float weight."""

    node: ir.Node
    label: str
    quantized: ir.Value  # the int8 initializer its DequantizeLinear reads
    scale: ir.Value  # the scale initializer (one value, or one per output channel)
    weight: np.ndarray  # the float weight, as before quantization
    axis: int | None  # the weight's channel axis (None: per tensor)
    bound: int  # integers lie in [-bound, bound]
    input: str  # the layer's input in the quantized model (a DequantizeLinear's output)
    output: str  # its output in the quantized model
    reference: str  # the same output's name in the float model
    relu: bool  # a Relu is its only reader
    depth: int = 0

    @property
    def out_axis(self) -> int:
        return 1 if self.node.op_type == "Conv" else -1

    def broadcast(self, per_channel: torch.Tensor) -> torch.Tensor:
        """A per-channel (or scalar) tensor shaped to multiply the weight."""
        return rounding_math.along_axis(per_channel, self.weight.ndim, self.axis)

    # the surface ``quantize.algorithms.rounding`` reads (its RoundingLayer)
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return forward(self, x, w)

    def integers_and_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        return integers_and_scale(self)

    def write(self, integers: np.ndarray, scale: np.ndarray | None = None) -> None:
        write(self, integers, scale)


def _attrs(node: ir.Node) -> dict:
    return {k: a.value for k, a in node.attributes.items()}


def _why_not(node: ir.Node, weight: np.ndarray) -> str | None:
    """Why the torch reading cannot compute this layer (None: it can)."""
    attrs = _attrs(node)
    if node.op_type == "Conv":
        if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            return f"its auto_pad {attrs['auto_pad']} is not read (explicit pads only)"
        if weight.ndim not in (3, 4, 5):
            return f"a Conv of weight rank {weight.ndim}"
        return None
    if node.op_type == "Gemm":
        if attrs.get("transA", 0):
            return "a Gemm with transA (its samples are not its rows)"
        return None if weight.ndim == 2 else "a Gemm weight that is not 2-D"
    if node.op_type == "MatMul":
        return None if weight.ndim == 2 else "a MatMul weight that is not 2-D"
    return f"{node.op_type} is not rewritten (Conv, Gemm, MatMul only)"


def _bias(node: ir.Node) -> torch.Tensor | None:
    value = node.inputs[2] if len(node.inputs) > 2 else None
    if value is None or value.const_value is None:
        return None
    return torch.from_numpy(np.array(value.const_value.numpy(), np.float32))


def forward(layer: WeightLayer, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The layer's output on ``x`` with weight ``w`` (its bias, strides, pads, groups as the node says)."""
    node, attrs = layer.node, _attrs(layer.node)
    if node.op_type == "Conv":
        rank = w.ndim - 2
        pads = list(attrs.get("pads", [0] * 2 * rank)) if attrs.get("auto_pad", "NOTSET") == "NOTSET" else [0] * 2 * rank
        begin, end = pads[:rank], pads[rank:]
        if begin != end:
            x = F.pad(x, [p for d in reversed(range(rank)) for p in (begin[d], end[d])])
            begin = [0] * rank
        conv = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
        return conv(x, w, _bias(node), stride=list(attrs.get("strides", [1] * rank)), padding=begin,
                    dilation=list(attrs.get("dilations", [1] * rank)), groups=int(attrs.get("group", 1)))
    if node.op_type == "Gemm":
        b = w.T if attrs.get("transB", 0) else w
        y = float(attrs.get("alpha", 1.0)) * (x @ b)
        bias = _bias(node)
        return y if bias is None else y + float(attrs.get("beta", 1.0)) * bias
    return x @ w


def _weight_dq(node: ir.Node) -> ir.Node | None:
    value = node.inputs[1] if len(node.inputs) > 1 else None
    producer = value.producer() if value is not None else None
    return producer if producer is not None and producer.op_type == "DequantizeLinear" else None


def collect(model: ir.Model, float_model: onnx.ModelProto, weighted: Sequence[ir.Node], bound: int,
            skipped: dict[str, str]) -> list[WeightLayer]:
    """The layers of ``weighted`` (nodes of the quantized ``model``) a rounding algorithm can rewrite;
    the others land in ``skipped`` with why."""
    float_names = {o for n in float_model.graph.node for o in n.output if o}
    producer = {o: n for n in float_model.graph.node for o in n.output if o}
    stored = {t.name: t for t in float_model.graph.initializer}
    layers = []
    for node in weighted:
        label = node.name or node.op_type
        dq = _weight_dq(node)
        reference = reference_name(node.outputs[0], float_names)
        if dq is None or dq.inputs[0].const_value is None or dq.inputs[1].const_value is None:
            skipped[label] = "its weight is not read through a DequantizeLinear of stored integers"
            continue
        quantized, scale = dq.inputs[0], dq.inputs[1]
        if len(quantized.uses()) > 1 or len(scale.uses()) > 1:
            skipped[label] = "its quantized weight is shared with another layer"
            continue
        float_node = producer.get(reference) if reference else None
        name = float_node.input[1] if float_node is not None and len(float_node.input) > 1 else None
        if name not in stored:
            skipped[label] = "its float weight is not a stored initializer of the float model"
            continue
        weight = onnx.numpy_helper.to_array(stored[name]).astype(np.float32)
        why = _why_not(node, weight)
        if why is not None:
            skipped[label] = why
            continue
        scales = scale.const_value.numpy()
        axis = None
        if scales.size > 1:
            axis = int(dq.attributes["axis"].value) if "axis" in dq.attributes else 1
            axis %= weight.ndim
        uses = node.outputs[0].uses()
        relu = len(uses) == 1 and uses[0].node.op_type == "Relu" and not node.outputs[0].is_graph_output()
        layers.append(WeightLayer(node, label, quantized, scale, weight, axis, bound, node.inputs[0].name,
                                  node.outputs[0].name, reference, relu))
    return layers


def write(layer: WeightLayer, integers: np.ndarray, scale: np.ndarray | None = None) -> None:
    """Store new integer weights (and, if given, new scales) in the layer's initializers."""
    layer.quantized.const_value = ir.tensor(integers.astype(np.int8), name=layer.quantized.name)
    if scale is not None:
        stored = layer.scale.const_value.numpy()
        layer.scale.const_value = ir.tensor(scale.astype(np.float32).reshape(stored.shape), name=layer.scale.name)


def integers_and_scale(layer: WeightLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's stored integer weight (float tensor) and scale (shaped to the weight)."""
    q = torch.from_numpy(np.array(layer.quantized.const_value.numpy(), np.float32))
    s = torch.from_numpy(np.array(layer.scale.const_value.numpy(), np.float32).reshape(-1))
    return q, layer.broadcast(s)


def _read(session, names: Sequence[str], feeds: Sequence[Feed], samples: int,
          extra: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
    """``names`` over the leading ``samples`` samples, a whole calibration batch per run (a file of fixed
    batch runs only those), stopping early once ``MEMORY_BUDGET`` is held."""
    parts: list[list[np.ndarray]] = [[] for _ in names]
    seen, held = 0, 0
    for feed in feeds:
        if seen >= samples or held >= MEMORY_BUDGET:
            break
        outs = session.run(list(names), {**feed, **(extra or {})})
        for k, value in enumerate(outs):
            parts[k].append(value)
        seen += len(next(iter(feed.values())))
        held += sum(v.nbytes for v in outs)
    return [np.concatenate(p)[:samples] for p in parts]


def sequential(model: ir.Model, float_model: onnx.ModelProto, layers: list[WeightLayer], feeds: Sequence[Feed],
               step: Callable[[WeightLayer, torch.Tensor, torch.Tensor], None], skipped: dict[str, str],
               info: dict[str, TensorInfo]) -> int:
    """Call ``step(layer, inputs, float_target)`` for every layer, depth by depth, the inputs read from the
    quantized model as the earlier depths left it; returns the quantized-model passes run. The float
    targets are read in one pass when every layer's fit in half of ``MEMORY_BUDGET``, else depth by depth."""
    n_depths = assign_depths(model, layers)
    every = list(dict.fromkeys(layer.reference for layer in layers))
    held = sum(info[n].bytes_per_sample if n in info else MEMORY_BUDGET for n in every) * SAMPLES
    targets = dict(zip(every, _read(subgraph_session(float_model, every), every, feeds, SAMPLES))) \
        if held <= MEMORY_BUDGET // 2 else None
    quantized = ir.to_proto(model)  # once: the rewritten weights are fed to each depth's session instead
    stored = {}
    for layer in layers:
        stored[layer.quantized.name] = layer.quantized
        stored[layer.scale.name] = layer.scale
    passes = 0
    for depth in range(n_depths):
        level = [layer for layer in layers if layer.depth == depth]
        if not level:
            continue
        names = list(dict.fromkeys([n for layer in level for n in (layer.input, layer.output)]))
        session = subgraph_session(quantized, names, list(stored))
        fed = {i.name for i in session.get_inputs()}
        current = {name: value.const_value.numpy() for name, value in stored.items() if name in fed}
        read = dict(zip(names, _read(session, names, feeds, SAMPLES, current)))
        if targets is None or not all(layer.reference in targets for layer in level):
            wanted = list(dict.fromkeys(layer.reference for layer in level))
            targets = dict(zip(wanted, _read(subgraph_session(float_model, wanted), wanted, feeds, SAMPLES)))
        passes += 1
        for layer in level:
            x = torch.from_numpy(read[layer.input])
            target = torch.from_numpy(targets[layer.reference][:len(x)])
            q, s = integers_and_scale(layer)
            with torch.no_grad():
                mine = forward(layer, x, q * s)
            theirs = torch.from_numpy(read[layer.output])
            gap = float((mine - theirs).abs().max()) if mine.shape == theirs.shape else float("inf")
            if not gap <= CHECK_TOLERANCE * max(float(theirs.abs().max()), 1e-6):
                skipped[layer.label] = f"its torch reading differs from ONNX Runtime's by {gap:.3g}"
                continue
            step(layer, x, target)
    return passes
