"""Learned and searched weight rounding on the pt2e path: after ``convert_pt2e``, the sequential MSE scale
search then AdaRound (``quantize.algorithms.rounding``, the math the ONNX quantizer shares) on each quantized
conv / linear, whichever are on. Runs before bias correction (which then measures the rounded graph).

A layer is a conv / linear whose weight is a stored int8 tensor read through its own
``dequantize_per_channel`` (scale and zero-point tensors) or ``dequantize_per_tensor`` (scale a number),
symmetric (zero-point 0, range [-bound, bound]). Its float weight is the same-named node's in the
calibrated float graph (``bias_correction.float_reference``: BatchNorms folded, observers removed); a
layer whose stored integers are not that weight rounded at its scale is skipped, with why. Layers go
depth by depth (``bias_correction.layer_depths``); each one's inputs are the converted graph's as the
shallower depths left it (every activation Q/DQ in place), its target the float graph's output of it
(``bias_correction.Incremental``: each graph evaluated once in all). A ReLU that is a layer's only reader
is applied to both sides. Only the integer weights (and, with seq-MSE, the weight scales) change: the
bias, every activation's scale and zero-point and the graph stay as they are.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.fx import GraphModule

from quantship.quantize.algorithms import rounding as rounding_math
from quantship.quantize.algorithms.bias_correction import SAMPLES, layer_depths
from quantship.quantize.annotator import WEIGHTED_OPS
from quantship.quantize.bias_correction import Incremental, attribute, leading

qd = torch.ops.quantized_decomposed
_PER_CHANNEL, _PER_TENSOR = qd.dequantize_per_channel.default, qd.dequantize_per_tensor.default
_RELU = {torch.ops.aten.relu.default, torch.ops.aten.relu_.default}
MISMATCH_ALLOWED = 1e-3  # share of stored integers that may differ from the float weight rounded (ties, ulps)
CHECK_TOLERANCE = 1e-4  # the torch reading vs the graph's own output, relative to its largest magnitude
CONSTANT_DEPTH = 8  # ops between a float weight and its stored tensors (a transpose, a reshape) that are followed


@dataclass
class Pt2eLayer:
    """One layer to rewrite (``algorithms.rounding.RoundingLayer``): its node, its weight's dequantize node and
    the stored tensors they read."""

    model: GraphModule
    node: torch.fx.Node
    dq: torch.fx.Node
    integers: torch.Tensor  # the stored int8 weight (rewritten in place)
    scales: torch.Tensor | None  # per channel: the stored scale tensor (rewritten in place); None: per tensor
    weight: np.ndarray  # the float weight, as before quantization
    axis: int | None
    bound: int
    relu: bool

    @property
    def out_axis(self) -> int:
        return -1 if self.node.target == torch.ops.aten.linear.default else 1

    def broadcast(self, per_channel: torch.Tensor) -> torch.Tensor:
        return rounding_math.along_axis(per_channel, self.weight.ndim, self.axis)

    def _value(self, arg):
        return torch.fx.map_arg(arg, lambda n: getattr(*attribute(self.model, n.target)) if n.op == "get_attr"
                                else _unreadable(n))

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.node.target(x, w, *self._value(tuple(self.node.args[2:])), **self._value(dict(self.node.kwargs)))

    def dequantized(self) -> torch.Tensor:
        """The weight as the graph computes it now (its dequantize op on the stored tensors)."""
        return self.dq.target(*self._value(tuple(self.dq.args)))

    def integers_and_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.scales.float().reshape(-1) if self.scales is not None else torch.tensor([float(self.dq.args[1])])
        return self.integers.float(), self.broadcast(scale)

    def write(self, integers: np.ndarray, scale: np.ndarray | None = None) -> None:
        self.integers.copy_(torch.from_numpy(integers.astype(np.int8)))
        if scale is None:
            return
        if self.scales is not None:
            self.scales.copy_(torch.from_numpy(scale.reshape(-1)).to(self.scales.dtype))
        else:
            args = list(self.dq.args)
            args[1] = float(scale.reshape(-1)[0])
            self.dq.args = tuple(args)


def _unreadable(node: torch.fx.Node):
    raise ValueError(f"{node.name} is computed, not stored")


def _stored(model: GraphModule, arg) -> torch.Tensor | None:
    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
        return getattr(*attribute(model, arg.target))
    return None


def _constant(model: GraphModule, arg, depth: int = 0) -> torch.Tensor | None:
    """The value of ``arg`` when it is computed from stored tensors alone (a transposed weight, say), else None."""
    if not isinstance(arg, torch.fx.Node) or depth > CONSTANT_DEPTH:
        return None
    if arg.op == "get_attr":
        return getattr(*attribute(model, arg.target))
    if arg.op != "call_function":
        return None
    inputs = {n: _constant(model, n, depth + 1) for n in arg.all_input_nodes}
    if any(v is None for v in inputs.values()):
        return None
    return arg.target(*torch.fx.map_arg(arg.args, inputs.get), **torch.fx.map_arg(arg.kwargs, inputs.get))


def _layer(model: GraphModule, node: torch.fx.Node, floats: dict[str, torch.fx.Node], reference: GraphModule,
           readers: dict[int, int]) -> Pt2eLayer | str:
    """The layer of ``node``, or why it cannot be rewritten."""
    dq = node.args[1] if len(node.args) > 1 else None
    if not isinstance(dq, torch.fx.Node) or dq.target not in (_PER_CHANNEL, _PER_TENSOR) or len(dq.users) != 1:
        return "its weight is not read through its own dequantize of stored integers"
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if bias is not None and (not isinstance(bias, torch.fx.Node) or bias.op != "get_attr"):
        return "its bias is computed, not a stored tensor"
    integers = _stored(model, dq.args[0])
    if integers is None or integers.dtype != torch.int8 or readers.get(id(integers), 0) != 1:
        return "its int8 weight is not a stored tensor of its own"
    qmin, qmax = dq.args[-3], dq.args[-2]
    if dq.target == _PER_CHANNEL:
        scales, zero_points, axis = _stored(model, dq.args[1]), _stored(model, dq.args[2]), int(dq.args[3])
        if scales is None or zero_points is None or readers.get(id(scales), 0) != 1:
            return "its weight scales are not a stored tensor of its own"
        symmetric = not bool(zero_points.any())
    else:
        scales, axis = None, None
        if not isinstance(dq.args[1], float) or not isinstance(dq.args[2], int):
            return "its per-tensor weight scale is not a number"
        symmetric = dq.args[2] == 0
    if not symmetric or qmin != -qmax:
        return f"its weight range [{qmin}, {qmax}] is not symmetric around a zero-point of 0"
    twin = floats.get(node.name)
    weight = _constant(reference, twin.args[1]) if twin is not None and twin.target == node.target else None
    if not isinstance(weight, torch.Tensor) or weight.shape != integers.shape:
        return "no float weight of the same shape, computed from stored tensors, at the same-named node of the float graph"
    users = list(node.users)
    layer = Pt2eLayer(model, node, dq, integers, scales, weight.detach().float().numpy().copy(),
                      axis % integers.ndim if axis is not None else None, int(qmax),
                      len(users) == 1 and users[0].target in _RELU)
    nearest, scale = layer.integers_and_scale()
    again = rounding_math.rounded(layer, torch.from_numpy(layer.weight), scale)
    if float((again != nearest).float().mean()) > MISMATCH_ALLOWED:
        return "its stored integers are not its float weight rounded at its scale"
    return layer


def round_weights(converted: GraphModule, reference: GraphModule, batches: Sequence[torch.Tensor], *,
                  seq_mse: bool, adaround_iterations: int) -> dict[str, dict]:
    """Rewrite the integer weights (and, with ``seq_mse``, the weight scales) of ``converted`` in place
    against ``reference`` on the leading ``SAMPLES`` calibration samples; each algorithm's record by name."""
    start = time.perf_counter()
    batches = leading(batches, SAMPLES)
    samples = sum(len(b) for b in batches)
    rounder = rounding_math.Rounder(seq_mse, adaround_iterations, samples, start)
    skipped: dict[str, str] = {}
    readers: dict[int, int] = {}
    for node in converted.graph.nodes:
        if node.op == "get_attr":
            key = id(getattr(*attribute(converted, node.target)))
            readers[key] = readers.get(key, 0) + len(node.users)
    floats = {n.name: n for n in reference.graph.nodes if n.op == "call_function"}
    layers = []
    for node in converted.graph.nodes:
        if node.op == "call_function" and node.target in WEIGHTED_OPS:
            found = _layer(converted, node, floats, reference, readers)
            if isinstance(found, str):
                skipped[node.name] = found
            else:
                layers.append(found)
    with rounding_math.torch_threads(rounding_math.TORCH_THREADS), torch.no_grad():
        passes = _sequential(converted, reference, layers, batches, rounder, skipped) if layers else 0
    converted.recompile()
    return rounder.records(skipped, passes)


def _sequential(converted: GraphModule, reference: GraphModule, layers: list[Pt2eLayer],
                batches: Sequence[torch.Tensor], rounder: rounding_math.Rounder, skipped: dict[str, str]) -> int:
    ids = {id(layer.node) for layer in layers}
    depths = layer_depths(converted.graph.nodes, lambda n: n.all_input_nodes, lambda n: [n], lambda n: id(n) in ids)
    twins = {n.name: n for n in reference.graph.nodes}
    quantized = Incremental(converted, batches, [layer.node for layer in layers])
    floats = Incremental(reference, batches, [twins[layer.node.name] for layer in layers])
    passes = 0
    for depth in sorted(set(depths.values())):
        level = [layer for layer in layers if depths[id(layer.node)] == depth]
        outputs = quantized.outputs([layer.node for layer in level])
        float_nodes = [twins[layer.node.name] for layer in level]
        targets = floats.outputs(float_nodes)
        passes += 1
        for layer, theirs, target in zip(level, outputs, targets):
            x = torch.cat(quantized.values[layer.node.args[0]])
            theirs, target = torch.cat(theirs), torch.cat(target)
            mine = layer.forward(x, layer.dequantized())
            gap = float((mine - theirs).abs().max()) if mine.shape == theirs.shape else float("inf")
            if not gap <= CHECK_TOLERANCE * max(float(theirs.abs().max()), 1e-6):
                skipped[layer.node.name] = f"its torch reading differs from the graph's output by {gap:.3g}"
                continue
            rounder.step(layer, x, target)
            quantized.values[layer.dq] = [layer.dequantized()] * len(batches)
        quantized.recompute([layer.node for layer in level])
        floats.recompute(float_nodes)
    return passes
