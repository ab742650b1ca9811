"""FX backends: static PTQ on a torchvision ResNet for each engine, dynamic on Linear/LSTM, refusals."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from quantship import Quantizer, quant_spec
from quantship.quantize import fx

BACKENDS = ("x86", "fbgemm", "onednn", "qnnpack")


@pytest.fixture(scope="module")
def calib_32():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 32, 32, generator=g) for _ in range(2)]


class SeqNet(nn.Module):
    """An LSTM encoder with a Linear head: what dynamic quantization is for."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.fc(y[:, -1])


class ConvOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv(x))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_resnet_static_each_backend(backend, small_resnet, small_resnet_counts, calib_32):
    resnet18 = small_resnet  # one block per stage: ResNet-18's layer kinds, half its depth
    engine_before = torch.backends.quantized.engine
    before = {k: v.clone() for k, v in resnet18.state_dict().items()}
    q = Quantizer(backend, "static").quantize(resnet18, calib_32)
    assert torch.backends.quantized.engine == engine_before  # restored
    spec = quant_spec(q)
    assert (spec.label, spec.symmetric, spec.engine, spec.method) == ("W8A8", False, backend, "static")
    assert spec.qscheme == ("per_tensor" if backend == "qnnpack" else "per_channel")
    assert not spec.exports
    # every convolution (batch-norm folded, ReLU fused) + the fc layer became quantized modules
    assert len(fx.quantized_modules(q)) == small_resnet_counts["conv"] + small_resnet_counts["linear"]
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, out = resnet18(x), q(x)
    err = (out - ref).abs().max().item()
    print(f"{backend}: max |int8 - fp32| = {err:.4f} (fp32 max |logit| {ref.abs().max().item():.3f})")
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert err < 0.2 * ref.abs().max().item() + 0.05  # untrained net: relative to the logit range
    for k, v in resnet18.state_dict().items():  # input untouched
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("backend", ["x86", "qnnpack"])
def test_dynamic_linear_lstm(backend):
    torch.manual_seed(0)
    model = SeqNet().eval()
    q = Quantizer(backend, "dynamic").quantize(model)
    import torch.ao.nn.quantized.dynamic as nnqd

    assert isinstance(q.lstm, nnqd.LSTM) and isinstance(q.fc, nnqd.Linear)
    assert sorted(fx.quantized_modules(q)) == ["fc", "lstm"]
    assert quant_spec(q).method == "dynamic" and quant_spec(q).engine == backend
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        err = (q(x) - model(x)).abs().max().item()
    assert err < 0.05 * model(x).abs().max().item() + 0.01
    assert isinstance(model.fc, nn.Linear)  # input untouched


def test_dynamic_conv_only_refused():
    with pytest.raises(ValueError, match="nothing would be quantized") as info:
        Quantizer("x86", "dynamic").quantize(ConvOnly())
    assert "method='static'" in str(info.value)


def test_layer_bits_16_stays_float(residual_net):
    calib = [torch.randn(4, 1, 8, 8) for _ in range(2)]
    q = Quantizer("x86", "static", weight_bits={"head": 16}).quantize(residual_net, calib)
    assert isinstance(q.head, nn.Linear)  # float, not a quantized Linear
    names = fx.quantized_modules(q)
    assert names and "head" not in names
    assert dict(quant_spec(q).layer_bits) == {"head": 16}
    q(torch.randn(2, 1, 8, 8))


def test_layer_bits_unknown_name_refused(residual_net):
    with pytest.raises(ValueError, match="not modules") as info:
        Quantizer("x86", "static", weight_bits={"nope": 16}).quantize(residual_net, [torch.randn(2, 1, 8, 8)])
    assert "nope" in str(info.value)


def test_unsupported_engine_refused():
    with pytest.raises(ValueError, match="supported engines"):
        with fx.quantized_engine("nonexistent"):
            pass


def test_deprecation_said_once_and_upstream_silenced(residual_net, monkeypatch):
    monkeypatch.setattr(fx, "_deprecation_said", False)
    calib = [torch.randn(2, 1, 8, 8)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Quantizer("fbgemm", "static").quantize(residual_net, calib)
        Quantizer("fbgemm", "static").quantize(residual_net, calib)
    ours = [w for w in caught if "deprecated upstream" in str(w.message)]
    upstream = [w for w in caught if "torch.ao.quantization is deprecated" in str(w.message)]
    assert len(ours) == 1 and upstream == []


def test_per_tensor_qscheme_on_x86(residual_net):
    calib = [torch.randn(4, 1, 8, 8) for _ in range(2)]
    q = Quantizer("x86", "static", qscheme="per_tensor").quantize(residual_net, calib)
    qschemes = {m.weight().qscheme() for _, m in q.named_modules() if hasattr(m, "weight") and callable(m.weight)}
    assert qschemes == {torch.per_tensor_affine}
    per_channel = Quantizer("x86", "static").quantize(residual_net, calib)
    assert {m.weight().qscheme() for _, m in per_channel.named_modules()
            if hasattr(m, "weight") and callable(m.weight)} == {torch.per_channel_affine}
