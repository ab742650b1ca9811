"""The two decoder patterns of GPT-2 and Llama, one small module each, through prepare_pt2e / convert_pt2e.

- a product by a constant weight stored [in, out] (``addmm(bias, x, W)``: GPT-2's ``Conv1D``; ``mm``;
  ``x @ W``) becomes a linear layer whose weight is quantized per output channel;
- a constant built from ``arange`` (RoPE's cos table, a position-id lookup in a learned table) is stored
  int8, never quantized on every run.

Counts as in test_annotator_ops: (quantize_per_tensor, dequantize_per_tensor, dequantize_per_channel).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.graph_counts import aten, op_counts, qd
from tests.quantize.test_annotator_ops import Binary, _convert, _qdq

torch.manual_seed(0)


class Conv1DLike(nn.Module):
    """GPT-2's Conv1D: weight [in, out], ``addmm(bias, x.view(-1, in), weight)``."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.weight = nn.Parameter(torch.randn(8, 6))
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x):
        if self.form == "addmm":
            return torch.addmm(self.bias, x.view(-1, 8), self.weight).view(2, 5, 6)
        if self.form == "mm":
            return torch.mm(x.view(-1, 8), self.weight)
        return x @ self.weight  # 3-D x: matmul


def _per_channel_axes(graph) -> list[tuple[int, tuple[int, ...]]]:
    """(axis, stored shape) of every per-channel dequantize."""
    out = []
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target is qd.dequantize_per_channel.default:
            stored = getattr(graph, node.args[0].target)
            out.append((node.args[3], tuple(stored.shape)))
    return out


# activation Q/DQ pairs: input, the linear's output, the views around it (addmm: x.view, the output's view;
# matmul on 3-D x: the 2-D view flatten_linear_inputs gives it, the reshape back)
QDQ_PAIRS = {"addmm": 4, "mm": 3, "matmul": 4}


@pytest.mark.parametrize("form", ["addmm", "mm", "matmul"])
def test_product_by_constant_weight_is_a_per_channel_linear(form):
    model = Conv1DLike(form).eval()
    x = torch.randn(2, 5, 8)
    converted, report = _convert(model, x)
    counts = op_counts(converted)
    assert counts[aten.addmm.default] == counts[aten.mm.default] == counts[aten.matmul.default] == 0
    assert counts[aten.linear.default] == 1
    assert _per_channel_axes(converted) == [(0, (6, 8))]  # [out, in], one scale per output feature
    # every activation pair (input, views, output) is a quantize + dequantize; the weight only a dequantize
    n_q, n_dq, n_per_channel = _qdq(converted)
    assert (n_q, n_dq, n_per_channel) == (QDQ_PAIRS[form], QDQ_PAIRS[form], 1)
    assert report.n_weighted == 1 and report.float_ops == []
    with torch.no_grad():
        ref, got = model(x), converted(x)
    assert torch.allclose(ref, got, atol=0.1 * float(ref.abs().max()))


def test_product_of_two_activations_stays_a_matmul():
    converted, _ = _convert(Binary(torch.matmul), (torch.randn(2, 5, 8), torch.randn(2, 8, 3)))
    assert op_counts(converted)[aten.matmul.default] == 1
    assert _per_channel_axes(converted) == []


class Rope(nn.Module):
    """x * cos(positions x inv_freq): the table depends on arange only (a buffer, no parameter)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        t = torch.arange(x.shape[1], dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        cos = torch.cat([freqs, freqs], dim=-1).cos()
        return self.proj(x) * cos


class PositionEmbedding(nn.Module):
    """GPT-2's wpe: a learned table read at arange(T)."""

    def __init__(self):
        super().__init__()
        self.wpe = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) + self.wpe(torch.arange(x.shape[1]))


def _quantized_at_run_time(graph) -> list[str]:
    """quantize nodes whose input is computed without any model input (a constant quantized every call)."""
    placeholders = {n for n in graph.graph.nodes if n.op == "placeholder"}

    def reaches_input(node):
        if node in placeholders:
            return True
        return any(reaches_input(a) for a in node.all_input_nodes)

    return [n.name for n in graph.graph.nodes
            if n.op == "call_function" and n.target is qd.quantize_per_tensor.default
            and not reaches_input(n.args[0])]


@pytest.mark.parametrize("module", [Rope, PositionEmbedding])
def test_constant_built_from_arange_is_stored_int8(module):
    model = module().eval()
    x = torch.randn(1, 5, 8)
    converted, report = _convert(model, x)
    assert _quantized_at_run_time(converted) == []
    counts = op_counts(converted)
    assert counts[aten.arange.start_step] + counts[aten.arange.default] + counts[aten.arange.start] == 0
    # activations: input, the linear's 2-D view, output and reshape, the product/sum; the constant operand
    # stored int8 per tensor (a dequantize with no quantize), the linear's weight per channel
    assert _qdq(converted) == (5, 6, 1)
    with torch.no_grad():
        ref, got = model(x), converted(x)
    assert torch.allclose(ref, got, atol=0.1 * float(ref.abs().max()))


def test_qat_trains_the_conv1d_weight_through_the_rewrite():
    """The rewrite transposes the parameter in the graph, never a copy of it: training still updates it."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

    from quantship.precision import resolve_spec
    from quantship.quantize.annotator import QuantshipQuantizer

    model = Conv1DLike("addmm")
    x = torch.randn(2, 5, 8)
    graph = torch.export.export(model, (x,), strict=False).module()
    prepared = prepare_qat_pt2e(graph, QuantshipQuantizer(resolve_spec("pt2e", "qat"), is_qat=True))
    assert op_counts(prepared)[aten.linear.default] == 1
    weights = [p for name, p in prepared.named_parameters() if p.shape == (8, 6)]
    assert len(weights) == 1
    prepared(x).square().sum().backward()
    assert weights[0].grad is not None and float(weights[0].grad.abs().sum()) > 0


class ZerosLikeTemplate(nn.Module):
    """``x.new_zeros(...) + arange``: constant for the annotator (the template gives only dtype and device),
    but it reads a model input: never evaluated here (the pure ``arange`` part may be stored)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        offset = x.new_zeros(8) + torch.arange(8, dtype=x.dtype)
        return self.proj(x) * offset


def test_constant_from_an_input_template_is_left_in_the_graph():
    model = ZerosLikeTemplate().eval()
    x = torch.randn(1, 5, 8)
    converted, _ = _convert(model, x)
    stored = [b for name, b in converted.named_buffers() if name.startswith("_quantship_constant_")]
    assert all(torch.equal(b, torch.arange(8, dtype=torch.float32)) for b in stored)
    assert op_counts(converted)[aten.new_zeros.default] == 1
    with torch.no_grad():
        ref, got = model(x), converted(x)
    assert torch.allclose(ref, got, atol=0.1 * float(ref.abs().max()))
