"""convert_pt2e's QAT conv-bn fold is skipped where its patterns cannot match, with the same result."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from quantship.precision import resolve_spec
from quantship.quantize.annotator import QuantshipQuantizer
from quantship.quantize.conv_bn_fold import fold_what_can_match, fuse_what_can_match


class PreActivation(nn.Module):
    """DenseNet's layer: batch norm and ReLU before the conv, so the batch norm stays in the graph."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm2d(3)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)
        self.norm1d = nn.BatchNorm1d(2)

    def forward(self, x):
        y = self.conv(torch.relu(self.norm(x)))
        return self.norm1d(self.head(y.mean((2, 3))))


def _prepared(x):
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    torch.manual_seed(0)
    model = PreActivation().eval()
    for bn in (model.norm, model.norm1d):  # running statistics away from the identity
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    graph = torch.export.export(model, (x,), strict=False).module()
    prepared = prepare_pt2e(graph, QuantshipQuantizer(resolve_spec("pt2e", act_observer="minmax")))
    with torch.no_grad():
        prepared(x)
    return prepared


@pytest.fixture
def traced(monkeypatch):
    """Every pattern torchao traces with torch.export, with quantship's pattern cache empty."""
    from torchao.quantization.pt2e import qat_utils

    import quantship.quantize.conv_bn_fold as conv_bn_fold

    seen: list[object] = []
    real = qat_utils._get_aten_graph_module_for_pattern

    def counting(*args, **kwargs):
        seen.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(qat_utils, "_get_aten_graph_module_for_pattern", counting)
    monkeypatch.setattr(conv_bn_fold, "_PATTERNS", {})  # each reference traces its own patterns
    return seen


def test_post_training_graph_skips_the_qat_patterns_with_the_same_result(traced):
    from torchao.quantization.pt2e import qat_utils
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e
    from torchao.quantization.pt2e.utils import _is_bn_node

    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    prepared = _prepared(x)
    # the pre-activation batch norm stays in the graph: torchao's own test for "the fold runs" holds
    assert [list(n.meta["nn_module_stack"].values())[-1][0] for n in prepared.graph.nodes if _is_bn_node(n)] == ["norm"]
    with fold_what_can_match(prepared, qat=False):
        skipped = convert_pt2e(prepared)
    assert traced == []  # no pattern traced
    # torchao's fold for the conv kind the graph holds (conv2d: 24 pattern exports), as QAT convert runs it
    reference = _prepared(x)
    with fold_what_can_match(reference, qat=True):
        folded = convert_pt2e(reference)
    assert len(traced) == 24
    assert skipped.code == folded.code
    with torch.no_grad():
        assert torch.equal(skipped(x), folded(x))
    assert qat_utils._fold_conv_bn_qat_helper.__module__ == qat_utils.__name__  # torchao's own helper is back


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_qat_patterns_traced_once_fold_the_same(traced):
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e

    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))

    def converted(ours: bool):
        """(converted model, prepared code, patterns traced at prepare, at convert); ``ours``: prepare in
        quantship's context (torchao's own prepare otherwise)."""
        torch.manual_seed(0)
        graph = torch.export.export(ConvBN().train(), (x,), strict=False).module()
        start = len(traced)
        with fuse_what_can_match(graph) if ours else contextlib.nullcontext():
            prepared = prepare_qat_pt2e(graph, QuantshipQuantizer(resolve_spec("pt2e", "qat")))
        n_prepare = len(traced) - start
        code = prepared.code
        prepared(x)  # one training step's forward: observers and batch statistics move
        move_exported_model_to_eval(prepared)
        with fold_what_can_match(prepared, qat=True):
            return convert_pt2e(prepared), code, n_prepare, len(traced) - start - n_prepare

    runs = [converted(ours=False), converted(ours=True), converted(ours=True)]
    # torchao's prepare traces 3 fusion patterns for each of 4 conv kinds; quantship's, conv2d's 3 once;
    # the fold's 24 conv2d patterns are traced at the first convert only
    assert [(n_prepare, n_convert) for _, _, n_prepare, n_convert in runs] == [(12, 24), (3, 0), (0, 0)]
    (reference, reference_prepared, _, _) = runs[0]
    assert not any(n.target == torch.ops.aten.batch_norm.default for n in reference.graph.nodes)  # folded
    for model, prepared, _, _ in runs[1:]:
        assert prepared == reference_prepared
        assert model.code == reference.code
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))


def test_a_cached_pattern_changed_by_its_user_is_traced_anew(monkeypatch):
    """The pattern cache never hands out a graph that differs from what a fresh trace gives."""
    import quantship.quantize.conv_bn_fold as conv_bn_fold

    monkeypatch.setattr(conv_bn_fold, "_PATTERNS", {})
    calls: list[int] = []

    def trace(pattern, example_inputs, is_cuda=False, **kwargs):
        calls.append(1)
        return torch.fx.symbolic_trace(pattern)

    def pattern(x):
        return torch.relu(x) + 1

    x = (torch.randn(2, 3),)
    first = conv_bn_fold._traced_once(trace, pattern, x)
    assert conv_bn_fold._traced_once(trace, pattern, x) is first and len(calls) == 1
    relu = next(n for n in first.graph.nodes if n.op == "call_function" and n.target is torch.relu)
    relu.replace_all_uses_with(relu.args[0])  # a user rewrites the graph it was handed
    first.graph.erase_node(relu)
    first.recompile()
    again = conv_bn_fold._traced_once(trace, pattern, x)
    assert len(calls) == 2 and again is not first
    assert any(n.target is torch.relu for n in again.graph.nodes)
