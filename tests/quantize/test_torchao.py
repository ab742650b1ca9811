"""torchao: W8A16, W4A16 and W8A8-dynamic on a small MLP, on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from quantship import Quantizer, quant_spec


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 128)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return MLP().eval()


@pytest.fixture
def x():
    return torch.randn(16, 256, generator=torch.Generator().manual_seed(1))


def rel_error(q, ref_model, x) -> float:
    with torch.no_grad():
        ref = ref_model(x)
        return ((q(x) - ref).norm() / ref.norm()).item()


# (kwargs, label, bound): int8 error is ~0.5-1% of the output norm; int4 with groups of 128 on
# Gaussian init weights ~10% (16 levels per group), so the bounds leave a 2-3x margin.
CASES = [
    (dict(method="int8_weight_only"), "W8A16", 0.03),
    (dict(method="int8_weight_only", qscheme="per_group", group_size=64), "W8A16", 0.03),
    (dict(method="int4_weight_only"), "W4A16", 0.25),
    (dict(method="int8_dynamic"), "W8A8", 0.03),
]


@pytest.mark.parametrize("kwargs,label,bound", CASES)
def test_runs_on_cpu_with_small_error(mlp, x, kwargs, label, bound):
    before = mlp.fc1.weight.detach().clone()
    q = Quantizer("torchao", **kwargs).quantize(mlp)
    spec = quant_spec(q)
    assert spec.label == label and spec.exports == spec.method.endswith("weight_only")
    err = rel_error(q, mlp, x)
    print(f"torchao {spec.method} {spec.qscheme} group={spec.group_size}: relative output error {err:.4f}")
    assert 0 < err < bound  # 0 would mean nothing was quantized
    assert type(mlp.fc1.weight) is nn.Parameter and torch.equal(mlp.fc1.weight, before)  # untouched


def test_int4_default_group_is_128():
    spec = Quantizer("torchao", method="int4_weight_only").spec
    assert (spec.group_size, spec.weight_bits, spec.act_bits) == (128, 4, 16)


def test_all_8_dict_same_weights_as_uniform(mlp, x):
    uniform = Quantizer("torchao", method="int8_weight_only").quantize(mlp)
    per_layer = Quantizer("torchao", weight_bits={"fc1": 8, "fc2": 8}).quantize(mlp)
    for name in ("fc1", "fc2"):
        a, b = getattr(uniform, name).weight, getattr(per_layer, name).weight
        assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scale, b.scale)
    with torch.no_grad():
        assert torch.equal(uniform(x), per_layer(x))


def test_dict_with_16_leaves_layer_float(mlp, x):
    q = Quantizer("torchao", weight_bits={"fc1": 8, "fc2": 16}).quantize(mlp)
    assert type(q.fc2.weight) is nn.Parameter and torch.equal(q.fc2.weight, mlp.fc2.weight)
    assert type(q.fc1.weight) is not nn.Parameter
    assert 0 < rel_error(q, mlp, x) < 0.03


def test_no_linear_refused():
    conv = nn.Sequential(nn.Conv2d(1, 2, 3))
    with pytest.raises(ValueError, match="no nn.Linear"):
        Quantizer("torchao", method="int8_dynamic").quantize(conv)


def test_group_size_not_dividing_refused():
    model = nn.Sequential(nn.Linear(96, 8))
    with pytest.raises(ValueError, match="group_size=64") as info:
        Quantizer("torchao", method="int4_weight_only", group_size=64).quantize(model)
    assert "96" in str(info.value)


def test_dict_name_not_linear_refused(mlp):
    with pytest.raises(ValueError, match="relu"):
        Quantizer("torchao", weight_bits={"relu": 8}).quantize(mlp)
