"""state_dict_size: what a checkpoint costs on disk, FP32 vs FX INT8."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from quantship import Quantizer, state_dict_size


def test_is_the_size_of_the_checkpoint_file(tmp_path):
    model = nn.Linear(100, 10)
    # torch.save names every record in the archive after the file's stem ("archive" in memory), so a
    # file of that stem has exactly the measured size; another stem changes it by a few bytes per record
    torch.save(model.state_dict(), tmp_path / "archive.pt")
    assert state_dict_size(model) == (tmp_path / "archive.pt").stat().st_size
    torch.save(model.state_dict(), tmp_path / "w.pt")
    assert abs(state_dict_size(model) - (tmp_path / "w.pt").stat().st_size) < 0.05 * state_dict_size(model)


def test_grows_by_the_float32_payload():
    small, large = nn.Linear(1000, 10), nn.Linear(2000, 10)
    payload = 4 * 10 * 1000  # the extra float32 weights
    # the archive's records are aligned to 64 bytes, so the difference is the payload to within one alignment
    assert abs(state_dict_size(large) - state_dict_size(small) - payload) <= 64


def test_refuses_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        state_dict_size({"w": torch.zeros(1)})


@pytest.mark.slow
def test_resnet_fp32_vs_fx_int8(small_resnet):
    q = Quantizer("x86", "static").quantize(small_resnet, [torch.randn(2, 3, 32, 32)])
    fp32, int8 = state_dict_size(small_resnet), state_dict_size(q)
    n_params = sum(p.numel() for p in small_resnet.parameters())
    print(f"ResNet (1 block per stage) state_dict: FP32 {fp32 / 1e6:.2f} MB, FX x86 INT8 {int8 / 1e6:.2f} MB "
          f"({fp32 / int8:.2f}x)")
    assert fp32 > 4 * n_params  # float32 parameters, plus BatchNorm buffers
    assert int8 < 0.3 * fp32  # int8 weights: about a quarter, plus scales and packing headers
