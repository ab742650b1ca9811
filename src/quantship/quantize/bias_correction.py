"""Bias correction, full (empirical, per layer) for the pt2e path: after ``convert_pt2e``, each quantized
conv / linear bias moves so that the mean of its output per channel, in the quantized graph, matches the
float model's on the calibration data (Nagel et al. 2019, section 4.2). The ONNX quantizer's pass is
``quantize_onnx.bias_correction``; both read the record, the per-channel means, the depths and the
update below (one implementation on numpy arrays).

The float reference is the calibrated ``prepare_pt2e`` graph with its observers removed: BatchNorms are
already folded into the convs there, and each conv / linear node has the name its quantized node keeps.
The quantized graph runs as converted (every earlier layer's Q/DQ pairs and corrected bias in place), so
earlier layers' errors are included; layers are grouped by depth (the longest chain of corrected layers
above them) and each depth is measured once every shallower depth is corrected. The graph is evaluated
once in all, depth by depth (``Incremental``: a value a depth needs is computed when that depth is
measured and kept until its readers have run), so the cost is about one float and one quantized pass
over the samples, whatever the depth (measured on a 3-depth model: 0.18 s instead of 1.8 s for a cut
graph run from the input per depth, same biases). A layer without a bias gets one (a new buffer). Only
biases change.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch
from torch.fx import GraphModule

from quantship.quantize.algorithms.bias_correction import (
    SAMPLES,
    BiasCorrection,
    ChannelMeans,
    corrected_bias,
    layer_depths,
)
from quantship.quantize.annotator import WEIGHTED_OPS

_CONV_AXIS, _LINEAR = 1, torch.ops.aten.linear.default

# -- the pt2e pass --

def float_reference(prepared: GraphModule) -> GraphModule:
    """The float graph of a calibrated ``prepare_pt2e`` model: its observers removed (a new graph over the
    same tensors, so build it before ``convert_pt2e``)."""
    from torchao.quantization.pt2e import ObserverBase

    graph = torch.fx.Graph()
    remap: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in prepared.graph.nodes:
        if node.op == "call_module" and isinstance(prepared.get_submodule(node.target), ObserverBase):
            remap[node] = remap[node.args[0]]
        elif node.op == "output":
            graph.output(torch.fx.map_arg(node.args[0], lambda n: remap[n]))
        else:
            remap[node] = graph.node_copy(node, lambda n: remap[n])
    return _without_dead_code(GraphModule(prepared, graph))


def _without_dead_code(model: GraphModule) -> GraphModule:
    model.graph.eliminate_dead_code()
    model.recompile()
    return model


def _fetching(model: GraphModule, names: Sequence[str]) -> GraphModule:
    """``model`` cut after the nodes ``names``: it returns their outputs and computes nothing else."""
    graph = torch.fx.Graph()
    remap: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.graph_copy(model.graph, remap)
    by_name = {n.name: remap[n] for n in model.graph.nodes if n in remap}
    graph.output(tuple(by_name[name] for name in names))
    return _without_dead_code(GraphModule(model, graph))


def leading(batches: Sequence[torch.Tensor], samples: int) -> list[torch.Tensor]:
    kept, n = [], 0
    for batch in batches:
        if n >= samples:
            break
        kept.append(batch[:samples - n])
        n += len(kept[-1])
    return kept


def _means(model: GraphModule, names: Sequence[str], axes: Sequence[int], batches: Sequence[torch.Tensor]):
    sums = ChannelMeans(len(names))
    cut = _fetching(model, names)
    with torch.no_grad():
        for batch in batches:
            for k, (value, axis) in enumerate(zip(cut(batch), axes)):
                sums.add(k, value.detach().numpy(), axis if axis >= 0 else value.ndim + axis)
    return sums.means()


class Incremental:
    """The quantized graph evaluated depth by depth on the calibration batches, each node once: a node a
    depth's layers need is computed when that depth is measured, when every layer above it is already
    corrected (each layer is corrected once, so the value stays right); a corrected layer's own output is
    computed again from its kept inputs. A value is dropped once every node that reads it has run."""

    def __init__(self, model: GraphModule, batches: Sequence[torch.Tensor], layers: Sequence[torch.fx.Node]):
        self.model, self.batches, self.layer_ids = model, batches, {id(n) for n in layers}
        self.values: dict[torch.fx.Node, list] = {}
        needed = self._ancestors(layers)
        self.waiting = {n: sum(1 for u in n.users if u in needed) for n in needed}

    @staticmethod
    def _ancestors(nodes: Iterable[torch.fx.Node], held: Iterable[torch.fx.Node] = ()) -> set[torch.fx.Node]:
        """``nodes`` and what they read, not looking above a node in ``held`` (its value is at hand: what lies
        above it was computed and may have been dropped, and must not be computed again)."""
        seen, todo, held = set(), list(nodes), set(held)
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                if node not in held:
                    todo.extend(node.all_input_nodes)
        return seen

    def _run(self, node: torch.fx.Node) -> list:
        if node.op == "placeholder":
            return list(self.batches)
        if node.op == "get_attr":
            return [getattr(*attribute(self.model, node.target))] * len(self.batches)
        if node.op != "call_function":
            raise ValueError(f"bias correction cannot evaluate {node.op} node {node.name}")
        out = []
        for i in range(len(self.batches)):
            args = torch.fx.map_arg(node.args, lambda n, i=i: self.values[n][i])
            kwargs = torch.fx.map_arg(node.kwargs, lambda n, i=i: self.values[n][i])
            out.append(node.target(*args, **kwargs))
        return out

    def _release_inputs(self, node: torch.fx.Node) -> None:
        for source in node.all_input_nodes:
            self.waiting[source] -= 1
            if self.waiting[source] == 0 and source in self.values:
                del self.values[source]

    def outputs(self, level: Sequence[torch.fx.Node]) -> list[list[torch.Tensor]]:
        """Each of ``level``'s layers' outputs, per batch (their inputs kept for ``recompute``)."""
        wanted = self._ancestors(level, self.values)
        for node in self.model.graph.nodes:  # graph order is a topological order
            if node in self.values or node not in wanted:
                continue
            self.values[node] = self._run(node)
            if id(node) not in self.layer_ids:
                self._release_inputs(node)
        return [self.values[n] for n in level]

    def recompute(self, level: Sequence[torch.fx.Node]) -> None:
        """``level``'s outputs again, with their corrected biases; then their inputs may go."""
        for node in level:
            self.values[node] = self._run(node)
            self._release_inputs(node)


def attribute(model: GraphModule, target: str) -> tuple[torch.nn.Module, str]:
    owner, _, leaf = target.rpartition(".")
    return (model.get_submodule(owner) if owner else model), leaf


def _own_bias(model: GraphModule, node: torch.fx.Node, channels: int,
              readers: dict[int, int]) -> tuple[torch.Tensor | None, bool, str]:
    """The float bias tensor ``node`` reads, made its own (a copy in the same place; a new buffer when it was
    shared, or a zero one when it had none): (tensor, added, '') or (None, False, why)."""
    source = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if source is not None and (not isinstance(source, torch.fx.Node) or source.op != "get_attr"):
        return None, False, "its bias is computed, not a stored tensor"
    value = None
    if source is not None:
        owner, leaf = attribute(model, source.target)
        value = getattr(owner, leaf)
        if value.dtype != torch.float32 or value.numel() != channels:
            return None, False, f"its bias of shape {list(value.shape)} is not one float per output channel"
        if len(source.users) == 1 and readers[id(value)] == 1:  # a copy in place: nothing else reads it
            copied = value.detach().clone()
            if isinstance(value, torch.nn.Parameter):
                copied = torch.nn.Parameter(copied, requires_grad=value.requires_grad)
            setattr(owner, leaf, copied)
            return copied, False, ""
    fresh = torch.zeros(channels) if value is None else value.detach().clone()
    name = f"_quantship_corrected_bias_{node.name}"
    model.register_buffer(name, fresh)
    with model.graph.inserting_before(node):
        attr = model.graph.get_attr(name)
    args = list(node.args) + [None] * max(0, 3 - len(node.args))
    args[2] = attr
    node.args = tuple(args)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
    return fresh, value is None, ""


def correct(converted: GraphModule, reference: GraphModule, batches: Sequence[torch.Tensor]) -> BiasCorrection:
    """Correct the bias of every conv / linear of ``converted`` in place against ``reference``
    (``float_reference`` of the same prepared graph) on the leading ``SAMPLES`` calibration samples."""
    start = time.perf_counter()
    batches = leading(batches, SAMPLES)
    report = BiasCorrection(samples=sum(len(b) for b in batches))
    floats = {n.name: n for n in reference.graph.nodes if n.op == "call_function"}
    layers = []  # (node, axis, bias tensor)
    readers: dict[int, int] = {}  # id(tensor) -> get_attr nodes reading it
    for node in converted.graph.nodes:
        if node.op == "get_attr":
            key = id(getattr(*attribute(converted, node.target)))
            readers[key] = readers.get(key, 0) + 1
    for node in list(converted.graph.nodes):
        if node.op != "call_function" or node.target not in WEIGHTED_OPS:
            continue
        if getattr(floats.get(node.name), "target", None) != node.target:
            report.skipped[node.name] = "no float node of the same name in the prepared graph"
            continue
        weight = node.args[1].args[0] if isinstance(node.args[1], torch.fx.Node) and node.args[1].args else None
        if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":
            report.skipped[node.name] = "its weight is not a stored quantized tensor"
            continue
        channels = int(getattr(*attribute(converted, weight.target)).shape[0])
        bias, added, why = _own_bias(converted, node, channels, readers)
        if bias is None:
            report.skipped[node.name] = why
            continue
        report.n_added += int(added)
        layers.append((node, -1 if node.target == _LINEAR else _CONV_AXIS, bias))
    converted.recompile()
    if not layers:
        report.seconds = time.perf_counter() - start
        return report
    ids = {id(node) for node, _, _ in layers}
    depths = layer_depths(converted.graph.nodes, lambda n: n.all_input_nodes, lambda n: [n], lambda n: id(n) in ids)
    target = dict(zip([node.name for node, _, _ in layers],
                      _means(reference, [node.name for node, _, _ in layers], [a for _, a, _ in layers], batches)))
    quantized = Incremental(converted, batches, [node for node, _, _ in layers])
    with torch.no_grad():
        for depth in sorted(set(depths.values())):
            level = [layer for layer in layers if depths[id(layer[0])] == depth]
            outputs = quantized.outputs([node for node, _, _ in level])
            report.n_passes += 1
            for (node, axis, bias), values in zip(level, outputs):
                sums = ChannelMeans(1)
                for value in values:
                    sums.add(0, value.numpy(), axis if axis >= 0 else value.ndim + axis)
                bias.copy_(torch.from_numpy(corrected_bias(bias.detach().numpy(), sums.means()[0], target[node.name],
                                                           report)))
            quantized.recompute([node for node, _, _ in level])
    report.n_corrected = len(layers)
    report.seconds = time.perf_counter() - start
    return report
