"""GPTQ for int4 weight-only: lower output error than round-to-nearest on the same grid, the exact
torchao tensor and ONNX files it hands on, and its refusals."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from onnx import numpy_helper

from quantship import Quantizer, export_qdq, quant_spec, resolve_spec
from quantship.errors import DataRefused, ExportRefused, SpecRefused
from quantship.precision import METADATA_KEY, QuantSpec
from quantship.quantize import gptq
from quantship.quantize.torchao_backend import gptq_tensor
from tests.linear_models import MLP

warnings.filterwarnings("ignore")


def correlated_inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Inputs whose features are mixed and unevenly scaled: the case GPTQ's error feedback is for."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k ** 0.5
    return (torch.randn(rows, k, generator=gen) @ mix) * (0.2 + 3 * torch.rand(k, generator=gen))


def test_gptq_beats_round_to_nearest_on_one_linear():
    x = correlated_inputs(1024, 128, seed=0)
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    hessian = 2 * x.double().T @ x.double() / x.shape[0]
    ours, nearest = gptq.quantize_weight(weight, hessian, 32), gptq.rtn(weight, 32)
    reference = x @ weight.T
    mse = {name: float(((x @ r.dequantized.T - reference) ** 2).mean()) for name, r in
           [("gptq", ours), ("rtn", nearest)]}
    assert mse["gptq"] < 0.8 * mse["rtn"], mse
    assert ours.codes.min() >= -8 and ours.codes.max() <= 7 and ours.scale.shape == (48, 4)


def test_round_to_nearest_is_torchaos_int4_grid():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 16))
    nearest = gptq.rtn(layer[0].weight.detach(), 32)
    q = Quantizer("torchao", method="int4_weight_only", group_size=32).quantize(layer)
    assert torch.equal(q[0].weight.qdata, nearest.codes) and torch.equal(q[0].weight.scale, nearest.scale)


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    return MLP().eval()


@pytest.fixture(scope="module")
def batches():
    x = correlated_inputs(64, 64, seed=2)
    return [x[i:i + 16] for i in range(0, 64, 16)]


@pytest.fixture(scope="module")
def gptq_model(mlp, batches):
    return Quantizer("torchao", method="int4_weight_only", group_size=32, weight_algorithm="gptq").quantize(mlp, batches)


def test_sequential_gptq_is_what_the_model_holds_and_differs_from_nearest(mlp, batches, gptq_model):
    expected = gptq.quantize_layers(copy.deepcopy(mlp), ["fc1", "fc2"], 32, batches, log=lambda m: None)
    plain = Quantizer("torchao", method="int4_weight_only", group_size=32).quantize(mlp)
    for layer in ("fc1", "fc2"):
        held = getattr(gptq_model, layer).weight
        assert torch.equal(held.qdata, expected[layer].codes) and torch.equal(held.scale, expected[layer].scale)
        assert not torch.equal(held.qdata, getattr(plain, layer).weight.qdata)
    assert quant_spec(gptq_model).weight_algorithm == "gptq"
    x = torch.cat(batches)
    with torch.no_grad():
        reference = mlp(x)
        errors = [float(((m(x) - reference) ** 2).mean()) for m in (gptq_model, plain)]
    assert errors[0] < errors[1], errors  # on its own calibration inputs GPTQ must do better


def test_both_files_hold_the_gptq_integers(mlp, batches, gptq_model, tmp_path):
    expected = gptq.quantize_layers(copy.deepcopy(mlp), ["fc1", "fc2"], 32, batches, log=lambda m: None)
    x = batches[0]
    standard = onnx.load(str(export_qdq(gptq_model, x, tmp_path / "std.onnx")))
    inits = {i.name: numpy_helper.to_array(i) for i in standard.graph.initializer}
    for layer in ("fc1", "fc2"):
        assert np.array_equal(inits[f"{layer}.weight_q4"].astype(np.int8), expected[layer].codes.numpy())
        assert np.array_equal(inits[f"{layer}.weight_scale"], expected[layer].scale.numpy())
    meta = {p.key: p.value for p in standard.metadata_props}
    assert QuantSpec.from_json(meta[METADATA_KEY]).weight_algorithm == "gptq"  # the file's provenance
    nbits = onnx.load(str(export_qdq(gptq_model, x, tmp_path / "nbits.onnx", target="onnxruntime-cpu")))
    packed = {i.name: numpy_helper.to_array(i) for i in nbits.graph.initializer if i.name.endswith("_q4_packed")}
    assert len(packed) == 2
    for name, b in packed.items():
        layer = "fc1" if name.startswith("fc1") else "fc2"
        codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1).astype(np.int16) - 8
        assert np.array_equal(codes, expected[layer].codes.numpy().astype(np.int16))


def test_gptq_refusals(mlp):
    with pytest.raises(SpecRefused, match="int4_weight_only") as info:
        resolve_spec("torchao", "int8_weight_only", weight_algorithm="gptq")
    assert "\n" not in str(info.value)
    with pytest.raises(SpecRefused, match="unknown"):
        resolve_spec("torchao", "int4_weight_only", weight_algorithm="awq2")
    with pytest.raises(SpecRefused):
        resolve_spec("pt2e", "static", weight_algorithm="gptq")
    with pytest.raises(DataRefused, match="calibration"):
        Quantizer("torchao", method="int4_weight_only", group_size=32, weight_algorithm="gptq").quantize(mlp)


class TwoHeads(nn.Module):
    """q and k read one tensor (one calibration pass for both); out reads their product (a second pass)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.out = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.out(self.q(x) * self.k(x))


def test_layers_reading_one_input_share_a_pass_and_later_layers_see_quantized_ones():
    torch.manual_seed(0)
    model, x = TwoHeads().eval(), [correlated_inputs(64, 32, seed=3)]
    said = []
    work = copy.deepcopy(model)
    results = gptq.quantize_layers(work, ["q", "k", "out"], 32, x, log=said.append)
    assert "3 Linear layer(s) in 2 calibration passes" in said[0]
    with torch.no_grad():  # the Hessian of `out` was taken on the quantized q and k: redo it by hand
        hidden = work.q(x[0]) * work.k(x[0])
    hessian = (2.0 / hidden.shape[0]) * (hidden.T @ hidden).double()  # as next_hessians sums it
    by_hand = gptq.quantize_weight(model.out.weight, hessian, 32)
    assert torch.equal(results["out"].codes, by_hand.codes) and torch.equal(results["out"].scale, by_hand.scale)


def test_torchao_tensor_is_refused_unless_it_reproduces_gptq_exactly():
    codes = torch.randint(-8, 8, (4, 32), generator=torch.Generator().manual_seed(0)).to(torch.int8)
    scale = torch.rand(4, 1, generator=torch.Generator().manual_seed(1)) + 0.01
    tensor = gptq_tensor(gptq.GptqWeight(codes, scale, 32), torch.float32)
    assert torch.equal(tensor.qdata, codes) and torch.equal(tensor.scale, scale)
    codes[0, 0] = 9  # off the int4 grid: torchao would clamp it to 7
    with pytest.raises(ExportRefused, match="exactly"):
        gptq_tensor(gptq.GptqWeight(codes, scale, 32), torch.float32)
