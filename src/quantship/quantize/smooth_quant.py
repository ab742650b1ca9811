"""SmoothQuant for the pt2e path: activation outliers moved into ``nn.Linear`` weights before capture
(Xiao et al. 2022; the ONNX quantizer's pass is ``quantize_onnx.smooth_quant``, the same rule).

For a Linear whose input is the output of an ``nn.LayerNorm`` (or of another ``nn.Linear``) and of
nothing else, each input channel ``j`` gets ``s_j = max|X_j| ^ alpha / max|W[:, j]| ^ (1 - alpha)``
(``max|X_j|`` over the calibration batches); the LayerNorm's weight and bias (the producing Linear's
output rows and bias) are divided by ``s``, the Linear's input columns multiplied by it: the float
function is unchanged. The graph edges come from one ``torch.export`` capture of the model (its
``nn_module_stack``): a producer read by anything but Linears, a module called more than once, a
LayerNorm without affine parameters and a weight shared with another module are skipped, with why.
Every Linear reading one producer gets one ``s``. The caller's model is not modified: a copy is smoothed.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch

from quantship.quantize.algorithms.smooth_quant import Smoothing, check_alpha, smoothing_scales
from quantship.quantize.annotator import module_of

_LINEAR, _LAYER_NORM = "aten.linear.default", "aten.layer_norm.default"


def find_groups(model: torch.nn.Module, example: torch.Tensor) -> tuple[list[tuple[str, list[str]]], dict[str, str]]:
    """[(producer module, [Linear modules reading only it])] and {Linear: why it is skipped}."""
    graph = torch.export.export(model, (example,)).graph_module.graph
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_function" and str(node.target) in (_LINEAR, _LAYER_NORM) and module_of(node):
            calls[module_of(node)] = calls.get(module_of(node), 0) + 1
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    groups, skipped = [], {}
    for node in graph.nodes:
        if node.op != "call_function" or str(node.target) != _LINEAR:
            continue
        name = module_of(node)
        if not isinstance(modules.get(name), torch.nn.Linear) or calls[name] != 1:
            continue
        source = node.args[0]
        producer = module_of(source) if isinstance(source, torch.fx.Node) else None
        if any(g[0] == producer for g in groups):
            continue  # already grouped with an earlier reader
        why = None
        if not isinstance(source, torch.fx.Node) or str(source.target) not in (_LINEAR, _LAYER_NORM):
            why = f"its input comes from {getattr(source, 'target', source)}, not a LayerNorm or Linear"
        elif not isinstance(modules.get(producer), (torch.nn.LayerNorm, torch.nn.Linear)) or calls[producer] != 1:
            why = f"its producer {producer} is not one nn.LayerNorm / nn.Linear called once"
        elif isinstance(modules[producer], torch.nn.LayerNorm) and (
                modules[producer].weight is None or len(modules[producer].normalized_shape) != 1):
            why = f"its LayerNorm {producer} has no affine weight over the last axis alone"
        readers = [u for u in source.users] if why is None else []
        for user in readers:
            if str(user.target) != _LINEAR or user.args[0] is not source or calls.get(module_of(user)) != 1 \
                    or not isinstance(modules.get(module_of(user)), torch.nn.Linear):
                why = f"its producer {producer}'s output is also read by {user.target}"
                break
            if owners[id(modules[module_of(user)].weight)] != 1:
                why = f"{module_of(user)}'s weight is shared with another module"
                break
        if why is None and any(owners[id(p)] != 1 for p in modules[producer].parameters(recurse=False)):
            why = f"its producer {producer}'s parameters are shared with another module"
        if why is not None:
            linears = [module_of(u) for u in readers if str(u.target) == _LINEAR
                       and isinstance(modules.get(module_of(u)), torch.nn.Linear)]
            for reader in linears or [name]:
                skipped[reader] = why
            continue
        groups.append((producer, [module_of(u) for u in readers]))
    return groups, skipped


def _input_ranges(model: torch.nn.Module, names: Sequence[str], batches: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Largest |input| per input channel of each Linear in ``names`` over the calibration batches."""
    ranges: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())

    def hook(name):
        def record(_module, args):
            peak = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0).double()
            ranges[name] = peak if name not in ranges else torch.maximum(ranges[name], peak)
        return record

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            for batch in batches:
                model(batch)
    finally:
        for h in handles:
            h.remove()
    return ranges


def smooth(model: torch.nn.Module, batches: Sequence[torch.Tensor], alpha: float) -> tuple[torch.nn.Module, Smoothing]:
    """A smoothed copy of ``model`` (eval mode) and what was done; ``model`` itself is left as it was."""
    start = time.perf_counter()
    record = Smoothing(check_alpha(alpha))
    smoothed = copy.deepcopy(model).eval()
    groups, record.skipped = find_groups(smoothed, batches[0])
    modules = dict(smoothed.named_modules())
    ranges = _input_ranges(smoothed, [r for _, readers in groups for r in readers], batches)
    with torch.no_grad():
        for producer, readers in groups:
            x_range = torch.stack([ranges[r] for r in readers]).amax(dim=0)  # the same tensor: equal ranges
            w_range = torch.stack([modules[r].weight.detach().abs().amax(dim=0).double() for r in readers]).amax(dim=0)
            s = torch.from_numpy(smoothing_scales(x_range.numpy(), w_range.numpy(), record.alpha))
            source = modules[producer]
            if isinstance(source, torch.nn.LayerNorm):
                source.weight.div_(s.to(source.weight.dtype))
            else:
                source.weight.div_(s.to(source.weight.dtype).reshape(-1, 1))
            if source.bias is not None:
                source.bias.div_(s.to(source.bias.dtype))
            for r in readers:
                modules[r].weight.mul_(s.to(modules[r].weight.dtype))
                record.smoothed[r] = f"s in [{s.min():.3g}, {s.max():.3g}] over {s.numel()} channels"
    record.seconds = time.perf_counter() - start
    return smoothed, record
