"""Cross-layer equalization for the pt2e path (Nagel et al. 2019, section 4.1), on a copy of the float
``nn.Module`` before capture; the ONNX quantizer's pass is ``quantize_onnx.equalize``, the same rule, and
reads the channel arithmetic below (one implementation on numpy arrays).

A pair is ``nn.Conv1d/2d -> [nn.BatchNorm] -> (ReLU | PReLU | max / average pooling){0..MAX_BETWEEN} ->
nn.Conv1d/2d``, each output read by the next op only. Channel ``i`` between them gets ``s_i = sqrt(r1_i *
r2_i) / r2_i`` (``r`` the largest absolute weight on each side, as the quantizer will see it: a
BatchNorm folded into its conv, as ``prepare_pt2e`` folds it); the first side is divided by ``s`` (the
BatchNorm's weight and bias when there is one: exact, where scaling the conv would not be through the
BatchNorm's ``eps``; otherwise the conv's weight and bias), the second conv's input channels multiplied
by it. Every op between is positively homogeneous (``f(x / s) = f(x) / s`` for ``s > 0``; PReLU's slope,
one or per channel, is), so the float function is unchanged. ReLU6 / Hardtanh, HardSwish and every
other op are not: a pair through them is skipped with why. Pairs sharing a conv interact, so the sweep
repeats until no scale moves more than ``TOLERANCE``. The caller's model is not modified.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from quantship.quantize.algorithms.equalize import (
    MAX_BETWEEN,
    MAX_SWEEPS,
    TOLERANCE,
    Equalization,
    equalizing_scales,
    input_channel_ranges,
    scale_input_channels,
)
from quantship.quantize.annotator import module_of

_CONVS = {"aten.conv1d.default", "aten.conv2d.default"}
_BATCH_NORM = "aten.batch_norm.default"
_HOMOGENEOUS = {"aten.relu.default", "aten.relu_.default", "aten.prelu.default", "aten.max_pool1d.default",
                "aten.max_pool2d.default", "aten.avg_pool1d.default", "aten.avg_pool2d.default"}


# -- the pt2e pass --

@dataclass(frozen=True)
class ModulePair:
    """Two convs (module names), the BatchNorm right after the first (or None), the ops between."""

    first: str
    second: str
    batch_norm: str | None
    between: tuple[str, ...]
    second_batch_norm: str | None = None  # folded into the second conv by prepare_pt2e: its ranges count


def _sole_reader(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    if len(users) != 1 or users[0].op != "call_function" or users[0].args[0] is not node:
        return None
    return users[0]


def _fold(bn: torch.nn.Module | None, channels: int) -> np.ndarray:
    """The factor ``prepare_pt2e`` folds a BatchNorm into its conv's output channels with (1: none)."""
    if bn is None:
        return np.ones(channels)
    return (bn.weight.detach().double() / torch.sqrt(bn.running_var.double() + bn.eps)).numpy()


def find_pairs(model: torch.nn.Module, example: torch.Tensor) -> tuple[list[ModulePair], dict[str, str]]:
    """Every conv pair the rescaling keeps exact (graph order), and {conv: why it starts no pair}."""
    graph = torch.export.export(model, (example,)).graph_module.graph
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_function" and module_of(node):
            calls[module_of(node)] = calls.get(module_of(node), 0) + 1
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1

    def conv(node: torch.fx.Node | None) -> str | None:
        name = module_of(node) if node is not None and str(node.target) in _CONVS else None
        ok = isinstance(modules.get(name), (torch.nn.Conv1d, torch.nn.Conv2d)) and calls.get(name) == 1 \
            and modules[name].weight.dtype == torch.float32 and owners[id(modules[name].weight)] == 1
        return name if ok else None

    def batch_norm(node: torch.fx.Node | None) -> str | None:
        name = module_of(node) if node is not None and str(node.target) == _BATCH_NORM else None
        bn = modules.get(name)
        ok = isinstance(bn, torch.nn.modules.batchnorm._BatchNorm) and calls.get(name) == 1 and bn.affine \
            and bn.running_var is not None and all(owners[id(p)] == 1 for p in bn.parameters(recurse=False))
        return name if ok else None

    pairs, skipped = [], {}
    for node in graph.nodes:
        first = conv(node)
        if first is None:
            continue
        if modules[first].bias is not None and owners[id(modules[first].bias)] != 1:
            skipped[first] = "its bias is shared with another module"
            continue
        reader, bn, between = _sole_reader(node), None, []
        if batch_norm(reader) is not None:
            bn, reader = batch_norm(reader), _sole_reader(reader)
        while reader is not None and str(reader.target) in _HOMOGENEOUS and len(between) < MAX_BETWEEN:
            between.append(str(reader.target).split(".")[1])
            reader = _sole_reader(reader)
        second = conv(reader)
        if reader is None:
            skipped[first] = "its output (or an op's after it) has more than one reader"
        elif second is None or second == first:
            skipped[first] = f"{reader.target} after it is not a positively homogeneous op or a conv called once"
        elif modules[second].weight.shape[1] * modules[second].groups != modules[first].weight.shape[0]:
            skipped[first] = f"{second}'s input channels do not match its output channels"
        if first in skipped:
            continue
        pairs.append(ModulePair(first, second, bn, tuple(between), batch_norm(_sole_reader(reader))))
    return pairs, skipped


def channel_ranges(model: torch.nn.Module, pair: ModulePair) -> tuple[np.ndarray, np.ndarray]:
    """(first conv's range per output channel, second conv's range per input channel), each with its
    BatchNorm folded as ``prepare_pt2e`` folds it: what the per-channel weight grid sees."""
    modules = dict(model.named_modules())
    w1 = modules[pair.first].weight.detach().double().numpy()
    w2 = modules[pair.second].weight.detach().double().numpy()
    fold1 = _fold(modules.get(pair.batch_norm), w1.shape[0]).reshape((-1,) + (1,) * (w1.ndim - 1))
    fold2 = _fold(modules.get(pair.second_batch_norm), w2.shape[0]).reshape((-1,) + (1,) * (w2.ndim - 1))
    r1 = np.abs(w1 * fold1).reshape(w1.shape[0], -1).max(axis=1)
    return r1, input_channel_ranges(w2 * fold2, modules[pair.second].groups)


def _set(param: torch.Tensor, array: np.ndarray) -> None:
    param.copy_(torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)))


def _rescale(modules: dict[str, torch.nn.Module], model: torch.nn.Module, pair: ModulePair) -> float:
    """One equalization step of a pair; returns the largest |s - 1| it applied."""
    s = equalizing_scales(*channel_ranges(model, pair))
    first, second = modules[pair.first], modules[pair.second]
    divided = [modules[pair.batch_norm].weight, modules[pair.batch_norm].bias] if pair.batch_norm \
        else [first.weight, first.bias]
    for param in divided:
        if param is not None:
            value = param.detach().numpy()
            _set(param, value / s.reshape((-1,) + (1,) * (value.ndim - 1)))
    _set(second.weight, scale_input_channels(second.weight.detach().numpy(), second.groups, s))
    return float(np.abs(s - 1).max()) if s.size else 0.0


def equalize(model: torch.nn.Module, batches: Sequence[torch.Tensor]) -> tuple[torch.nn.Module, Equalization]:
    """An equalized copy of ``model`` (eval mode) and what was done; ``model`` itself is left as it was."""
    start = time.perf_counter()
    record = Equalization()
    equalized = copy.deepcopy(model).eval()
    pairs, record.skipped = find_pairs(equalized, batches[0])
    modules = dict(equalized.named_modules())
    with torch.no_grad():
        before = equalized(batches[0])
        moved = [_rescale(modules, equalized, p) for p in pairs]
        record.pairs_changed, record.sweeps = sum(m >= TOLERANCE for m in moved), 1
        while max(moved, default=0.0) >= TOLERANCE and record.sweeps < MAX_SWEEPS:
            moved = [_rescale(modules, equalized, p) for p in pairs]
            record.sweeps += 1
        after = equalized(batches[0])
    record.pairs = {p.first: " -> ".join([p.first, *([p.batch_norm] if p.batch_norm else []), *p.between, p.second])
                    for p in pairs}
    record.max_abs_diff = max((float((a - b).abs().max()) for a, b in zip(_tensors(before), _tensors(after))),
                              default=0.0)
    record.seconds = time.perf_counter() - start
    return equalized, record


def _tensors(output: object) -> list[torch.Tensor]:
    """The tensors of a forward's output (a tensor, or a tuple / list / dict of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    return [t for item in output for t in _tensors(item)] if isinstance(output, (list, tuple)) else []
