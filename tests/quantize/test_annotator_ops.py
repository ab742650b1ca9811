"""One small module per pattern through prepare_pt2e / convert_pt2e with quantship's annotator.

Each test pins the exact number of quantize / dequantize nodes the pattern produces, so a change
of role for one op fails the one pattern it affects. Counts: (quantize_per_tensor,
dequantize_per_tensor, dequantize_per_channel) after conversion; folded weights count as their
dequantize only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from quantship.precision import resolve_spec
from quantship.quantize.annotator import ROLES, QuantshipQuantizer
from quantship.quantize.conv_bn_fold import fold_what_can_match
from tests.graph_counts import aten, op_counts, qd

torch.manual_seed(0)


def _convert(model: nn.Module, x, **spec_kwargs):
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    inputs = x if isinstance(x, tuple) else (x,)
    graph = torch.export.export(model.eval(), inputs, strict=False).module()
    quantizer = QuantshipQuantizer(resolve_spec("pt2e", act_observer="minmax", **spec_kwargs))
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        prepared(*inputs)
    with fold_what_can_match(prepared, qat=False):  # as quantship's pt2e path converts
        return convert_pt2e(prepared), quantizer.report


def _qdq(graph) -> tuple[int, int, int]:
    c = op_counts(graph)
    return (c[qd.quantize_per_tensor.default], c[qd.dequantize_per_tensor.default],
            c[qd.dequantize_per_channel.default])


class Unary(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class Binary(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, a, b):
        return self.fn(a, b)


class ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class ClassToken(nn.Module):
    """ViT's entry: a learned token concatenated in front, a learned position embedding added."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 8) * 3)
        self.pos = nn.Parameter(torch.randn(1, 5, 8) * 3)

    def forward(self, x):
        return torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos


class Windows(nn.Module):
    """Swin's window partition and reverse around a shift (roll), with zero padding."""

    def forward(self, x):  # (B, H, W, C) = (2, 6, 6, 4), windows of 4 after padding to 8
        x = F.pad(torch.roll(x, shifts=(-1, -1), dims=(1, 2)), (0, 0, 0, 2, 0, 2))
        w = x.view(2, 2, 4, 2, 4, 4).permute(0, 1, 3, 2, 4, 5).reshape(-1, 16, 4)
        w = w.view(2, 2, 2, 4, 4, 4).permute(0, 1, 3, 2, 4, 5).reshape(2, 8, 8, 4)
        return w[:, :6, :6, :].contiguous()


class Attention(nn.Module):
    def __init__(self, mask: str | None = None):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v):
        if self.mask == "bool":
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.mask == "causal")


class SelfAttention(nn.Module):
    """nn.MultiheadAttention as ViT calls it: packed in-projection, no weights returned."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class WithCumsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.block = Unary(lambda x: torch.cumsum(x, dim=-1))

    def forward(self, x):
        return self.block(self.fc(x))


def x4(*shape):
    return torch.randn(*shape)


# pattern -> (module, input(s), pinned (Q, DQ per tensor, DQ per channel))
PATTERNS = {
    "conv": (lambda: nn.Conv2d(3, 4, 3), lambda: x4(2, 3, 8, 8), (2, 2, 1)),
    "conv_bn_relu": (ConvBnRelu, lambda: x4(2, 3, 8, 8), (2, 2, 1)),
    # the weight [in, out, k, k] per output channel (axis 1): ``test_transposed_conv_weight_is_per_output_channel``
    "conv_transpose": (lambda: nn.ConvTranspose2d(3, 4, 2, stride=2), lambda: x4(2, 3, 8, 8), (2, 2, 1)),
    "linear": (lambda: nn.Linear(8, 4), lambda: x4(2, 8), (2, 2, 1)),
    "linear_3d": (lambda: nn.Linear(8, 4), lambda: x4(2, 5, 8), (4, 4, 1)),
    "add": (lambda: Binary(torch.add), lambda: (x4(2, 4), x4(2, 4)), (3, 3, 0)),
    "mul": (lambda: Binary(torch.mul), lambda: (x4(2, 4), x4(2, 4)), (3, 3, 0)),
    # the divisor stays float: only the dividend and the quotient are quantized
    "div": (lambda: Binary(torch.div), lambda: (x4(2, 4), x4(2, 4).abs() + 1), (2, 2, 0)),
    "cat": (lambda: Binary(lambda a, b: torch.cat([a, b], 1)), lambda: (x4(2, 4), x4(2, 4)), (3, 3, 0)),
    "max_pool": (lambda: nn.MaxPool2d(2), lambda: x4(2, 3, 8, 8), (2, 2, 0)),
    "avg_pool": (lambda: nn.AdaptiveAvgPool2d(1), lambda: x4(2, 3, 8, 8), (2, 2, 0)),
    "sigmoid": (nn.Sigmoid, lambda: x4(2, 4), (2, 2, 0)),
    "hardswish": (nn.Hardswish, lambda: x4(2, 4), (2, 2, 0)),
    "matmul": (lambda: Binary(torch.matmul), lambda: (x4(2, 3, 5), x4(2, 5, 4)), (3, 3, 0)),
    "bmm": (lambda: Binary(torch.bmm), lambda: (x4(2, 3, 5), x4(2, 5, 4)), (3, 3, 0)),
    "baddbmm": (lambda: Binary(lambda a, b: torch.baddbmm(a @ b, a, b)), lambda: (x4(2, 4, 4), x4(2, 4, 4)), (4, 6, 0)),
    "layer_norm": (lambda: nn.LayerNorm(8), lambda: x4(2, 5, 8), (2, 2, 0)),
    "group_norm": (lambda: nn.GroupNorm(2, 4), lambda: x4(2, 4, 3, 3), (2, 2, 0)),
    "softmax": (lambda: nn.Softmax(-1), lambda: x4(2, 5), (2, 2, 0)),
    "gelu": (nn.GELU, lambda: x4(2, 5), (2, 2, 0)),
    "sdpa": (Attention, lambda: (x4(2, 2, 5, 4), x4(2, 2, 5, 4), x4(2, 2, 5, 4)), (8, 8, 0)),
    "sdpa_causal": (lambda: Attention("causal"), lambda: (x4(2, 2, 5, 4), x4(2, 2, 5, 4), x4(2, 2, 5, 4)), (8, 8, 0)),
    "sdpa_bool_mask": (lambda: Attention("bool"), lambda: (x4(2, 2, 5, 4), x4(2, 2, 5, 4), x4(2, 2, 5, 4)), (8, 8, 0)),
    "multihead_attention": (SelfAttention, lambda: x4(2, 5, 8), (32, 34, 2)),
    "class_token": (ClassToken, lambda: x4(2, 4, 8), (3, 5, 0)),
    "select_slice_index": (lambda: Unary(lambda x: x[:, 0] + x[:, 1:3][:, 1] * x[:, torch.tensor([3, 0])][:, 0]),
                           lambda: x4(2, 4, 8), (8, 10, 0)),
    "windows": (Windows, lambda: x4(2, 6, 6, 4), (12, 12, 0)),
    "dropout_eval": (lambda: nn.Dropout(0.5), lambda: x4(2, 5), (2, 2, 0)),
    "chunk": (lambda: Unary(lambda x: torch.mul(*x.chunk(2, dim=-1))), lambda: x4(2, 8), (4, 4, 0)),
    "embedding": (lambda: nn.Embedding(10, 8), lambda: torch.tensor([[1, 2, 3]]), (1, 2, 0)),
    # a batched-matmul einsum becomes transpose + matmul (the transpose keeps its input's scale)
    "einsum": (lambda: Binary(lambda a, b: torch.einsum("bhid,bhjd->bhij", a, b)),
               lambda: (x4(2, 2, 5, 4), x4(2, 2, 5, 4)), (4, 4, 0)),
    "einsum_other": (lambda: Binary(lambda a, b: torch.einsum("bij,bkj->bjik", a, b)),
                     lambda: (x4(2, 3, 4), x4(2, 5, 4)), (3, 3, 0)),
    "swapaxes": (lambda: Unary(lambda x: torch.swapaxes(x, 1, 2)), lambda: x4(2, 3, 4), (2, 2, 0)),
    "batch_norm_alone": (lambda: nn.BatchNorm2d(3), lambda: x4(2, 3, 4, 4), (2, 2, 0)),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_counts(name):
    build, make_input, expected = PATTERNS[name]
    torch.manual_seed(0)
    converted, report = _convert(build(), make_input())
    assert _qdq(converted) == expected
    assert report.float_ops == []


def _stored_weights(graph) -> dict[str, int]:
    """Widest |value| of every stored integer tensor a dequantize reads (what the file calls weights)."""
    dq = {qd.dequantize_per_tensor.default, qd.dequantize_per_channel.default}
    out = {}
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target in dq and node.args[0].op == "get_attr":
            out[node.args[0].target] = int(getattr(graph, node.args[0].target).int().abs().max())
    return out


@pytest.mark.parametrize("reduce_range,bound", [(True, 63), (False, 127)])
def test_constants_read_by_any_op_are_weights(reduce_range, bound):
    # class token (cat), position embedding (add), embedding table: each stored as an integer
    # tensor in weight form, so reduce_range holds for them as for conv/linear weights
    class Entry(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = ClassToken()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(self.tokens(x))

    converted, _ = _convert(Entry(), x4(2, 4, 8), symmetric=False, reduce_range=reduce_range)
    widths = _stored_weights(converted)
    assert len(widths) == 3, widths  # cls, pos, fc weight
    assert max(widths.values()) == bound


def test_float_op_named_by_module_path():
    converted, report = _convert(WithCumsum(), x4(2, 4))
    assert [str(f) for f in report.float_ops] == ["aten.cumsum.default in block"]
    assert report.float_ops_by_module() == {"block": ["aten.cumsum.default"]}
    # quantized around it: the linear is integer, its output is dequantized for the float op
    assert _qdq(converted) == (2, 2, 1)


def test_strict_refuses_op_without_rule_and_default_names_it():
    from quantship import Quantizer

    model, calib = WithCumsum().eval(), [x4(2, 4)]
    with pytest.raises(ValueError, match=r"strict=True: WithCumsum has 1 op.*block: aten\.cumsum\.default"):
        Quantizer(strict=True, act_observer="minmax").quantize(model, calib)
    quantizer = Quantizer(act_observer="minmax")
    quantizer.quantize(model, calib)
    assert quantizer.report.float_ops_by_module() == {"block": ["aten.cumsum.default"]}
    assert Quantizer(strict=True, act_observer="minmax").quantize(nn.Sequential(nn.Linear(4, 4)), calib) is not None


def test_strict_needs_pt2e():
    from quantship import Quantizer

    with pytest.raises(ValueError, match="strict=True.*backend='x86'"):
        Quantizer(backend="x86", strict=True)


def test_roles_are_data():
    assert {ROLES[op] for op in (aten.matmul.default, aten.bmm.default, aten.baddbmm.default)} == {"matmul"}
    assert ROLES[aten.layer_norm.default] == ROLES[aten.softmax.int] == "own_scale"
    assert ROLES[aten.roll.default] == ROLES[aten.select.int] == "shared_scale"


@pytest.mark.parametrize("mask", [None, "causal", "bool"])
def test_attention_decomposed_matches_fused(mask):
    # the rewrite computes what the fused op computes, and leaves two matmuls per attention
    from quantship.quantize.decompose import decompose_attention

    q, k, v = x4(2, 2, 5, 4), x4(2, 2, 5, 4), x4(2, 2, 5, 4)
    graph = torch.export.export(Attention(mask), (q, k, v), strict=False).module()
    assert decompose_attention(graph) == 1
    counts = op_counts(graph)
    assert counts[aten.scaled_dot_product_attention.default] == 0 and counts[aten.matmul.default] == 2
    torch.testing.assert_close(graph(q, k, v), Attention(mask)(q, k, v), rtol=1e-5, atol=1e-6)


class ConstantBiasMLP(nn.Module):
    """Swin V2's continuous position bias: an MLP (with an in-place ReLU) on a stored coordinate table,
    16 * sigmoid, added to an activation. Everything before the add depends on parameters only."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.rand(6, 2) * 2 - 1)
        self.mlp = nn.Sequential(nn.Linear(2, 16), nn.ReLU(inplace=True), nn.Linear(16, 3))

    def forward(self, x):  # (B, 6, 3)
        return x + 16 * torch.sigmoid(self.mlp(self.table))


class ZeroedSliceOfCopy(nn.Module):
    """Swin V2's query-key-value bias: a copy of the linear's bias with its middle third zeroed in place
    (an in-place op on a view of a tensor the linear then reads)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        nn.init.constant_(self.fc.bias, 2.0)

    def forward(self, x):
        b = self.fc.bias.clone()
        b[2:4].zero_()
        return F.linear(x, self.fc.weight, b)


@pytest.mark.parametrize("symmetric", [True, False])
def test_linear_on_constants_folds_into_one_stored_tensor(symmetric):
    # the MLP is folded at conversion: no float or integer linear is left to run, and the one stored
    # tensor the add reads is in weight form (reduce_range: [-63, 63]), within half a step of the float bias
    torch.manual_seed(0)
    model, x = ConstantBiasMLP().eval(), x4(2, 6, 3)
    converted, report = _convert(model, x, symmetric=symmetric, reduce_range=True)
    counts = op_counts(converted)
    assert counts[aten.linear.default] == counts[aten.relu.default] == counts[aten.relu_.default] == 0
    assert report.n_weighted == 0 and report.float_ops == []
    assert _qdq(converted) == (2, 3, 0)  # x and the sum quantized; the folded bias dequantized
    widths = _stored_weights(converted)
    assert len(widths) == 1 and max(widths.values()) == 63
    with torch.no_grad():
        bias = 16 * torch.sigmoid(model.mlp(model.table))
        (scale,) = [n.args[1] for n in converted.graph.nodes if n.op == "call_function"
                    and n.target == qd.dequantize_per_tensor.default and n.args[0].op == "get_attr"]
        stored = getattr(converted, next(iter(widths))).float() * scale
    assert float((stored - bias).abs().max()) <= scale / 2 + 1e-6


def test_inplace_on_a_view_of_a_shared_copy_is_kept():
    # the zeroed slice still reaches the linear: made functional, the two middle outputs would be 2.0 off
    torch.manual_seed(0)
    model, x = ZeroedSliceOfCopy().eval(), x4(8, 4)
    converted, _ = _convert(model, x, symmetric=False, reduce_range=True)
    assert op_counts(converted)[aten.zero_.default] == 1
    with torch.no_grad():
        torch.testing.assert_close(converted(x), model(x), atol=0.1, rtol=0)


def test_normalize_of_a_zero_row_stays_finite():
    # Swin V2's cosine attention normalizes keys; a padded token's key is exactly 0, its norm is clamped
    # to eps. A quantized divisor rounds eps to 0: 0 / 0 = NaN inside the graph, which torch's next
    # quantize happens to map to the zero-point while ONNX Runtime's does not (45 LSB on one Swin V2 block)
    class Keys(nn.Module):
        def __init__(self):
            super().__init__()
            self.k = nn.Linear(8, 8, bias=False)

        def forward(self, x):
            return F.normalize(self.k(x), dim=-1)

    class NonFinite(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and out.is_floating_point() and not torch.isfinite(out).all():
                found.append(n.name)
            return out

    torch.manual_seed(0)
    x = x4(2, 6, 8)
    x[:, 4:] = 0  # padding tokens
    model = Keys().eval()
    converted, _ = _convert(model, x, symmetric=False, reduce_range=True)
    found: list[str] = []
    with torch.no_grad():
        out = NonFinite(converted).run(x)
    assert found == []
    torch.testing.assert_close(out, model(x), atol=0.05, rtol=0)


class ClampedHead(nn.Module):
    """A conv whose output a clamp bounds, as the model's output: ``bounds`` as given to ``torch.clamp``."""

    def __init__(self, **bounds):
        super().__init__()
        self.conv, self.bounds = nn.Conv2d(3, 4, 3, padding=1), bounds

    def forward(self, x):
        return torch.clamp(0.2 * self.conv(x) + 0.5, **self.bounds)


@pytest.mark.parametrize("bounds, quantized", [({"min": 0.0, "max": 1.0}, True), ({"min": 1e-6}, False)])
def test_a_clamp_between_two_numbers_gets_its_own_scale_and_a_one_sided_one_stays_float(bounds, quantized):
    """A hard sigmoid written out ends in ``clamp(., 0, 1)``: quantized, an integer-only runtime reads it (TiGrIS
    runs it as a Relu6 at 6x scale); a one-sided clamp (F.normalize's eps floor, a divisor) stays float."""
    torch.manual_seed(0)
    x = x4(2, 3, 8, 8)
    converted, report = _convert(ClampedHead(**bounds), x, symmetric=True)
    clamp = next(n for n in converted.graph.nodes if n.op == "call_function" and n.target in
                 (aten.clamp.default, aten.clip.default))
    (user,) = clamp.users
    assert (user.target == qd.quantize_per_tensor.default) == quantized
    assert any("clamp" in f.op for f in report.float_ops) != quantized  # "no INT8 rule" only for the one-sided


class ConstantTableBias(nn.Module):
    """Swin V2's continuous position bias in miniature: an MLP on a constant coordinate table, its output added
    to a float op's output (a normalisation) before a softmax. No integer kernel reads the MLP's output."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(9, 2))
        self.mlp = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 3))
        self.fc = nn.Linear(9, 9)

    def forward(self, x):
        scores = F.normalize(self.fc(x), dim=-1)
        bias = 16 * torch.sigmoid(self.mlp(self.table)).transpose(0, 1)
        return torch.softmax(scores + bias, dim=-1)


def test_a_linear_on_constants_read_by_float_ops_stays_float_by_design(tmp_path):
    """The MLP on the constant table is not annotated (a runtime folds it once, at load); on a target that runs
    mixed graphs nothing quantized reads it either, so it stays a float Linear after conversion. The
    conversion's check refused that as a partial result (every Swin V2 of torchvision's zoo); it is recorded as
    kept float, with the reason, and the file is written."""
    from quantship import Quantizer, export_qdq

    torch.manual_seed(0)
    model, x = ConstantTableBias().eval(), torch.randn(4, 3, 9)
    quantizer = Quantizer.for_target("onnxruntime-cpu")
    qmodel = quantizer.quantize(model, [x])
    kept = quantizer.report.kept_float
    assert len([n for n, why in kept.items() if "constants only" in why]) == 2, kept
    path = export_qdq(qmodel, x, tmp_path / "int8.onnx", target="onnxruntime-cpu")
    assert path.exists()
