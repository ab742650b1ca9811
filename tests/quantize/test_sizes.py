"""state_dict_size: FP32 vs FX INT8 ResNet-18 on disk."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

from quantship import Quantizer, state_dict_size


def test_matches_torch_save_bytes():
    model = nn.Linear(100, 10)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    assert state_dict_size(model) == len(buffer.getvalue())
    assert state_dict_size(model) > 4 * (100 * 10 + 10)  # at least the float32 payload


def test_refuses_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        state_dict_size({"w": torch.zeros(1)})


@pytest.mark.slow
def test_resnet18_fp32_vs_fx_int8():
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = resnet18(weights=None).eval()
    calib = [torch.randn(2, 3, 64, 64)]
    q = Quantizer("x86", "static").quantize(model, calib)
    fp32, int8 = state_dict_size(model), state_dict_size(q)
    print(f"ResNet-18 state_dict: FP32 {fp32 / 1e6:.2f} MB, FX x86 INT8 {int8 / 1e6:.2f} MB ({fp32 / int8:.2f}x)")
    assert fp32 > 11_689_512 * 4  # 11.7 M float32 parameters, plus BatchNorm buffers
    assert int8 < 0.3 * fp32  # int8 weights: about a quarter, plus scales and packing headers
