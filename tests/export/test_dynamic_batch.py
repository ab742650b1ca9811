"""Files that serve any batch (a symbolic ``batch`` dimension), and samples whose memory format never
changes the file."""

from __future__ import annotations

import hashlib

import onnx
import pytest
import torch
import torch.nn as nn

from quantship import Quantizer, export_qdq
from quantship.inspect.run.verify import compare_logits, ort_session, run_session
from quantship.precision import PRESETS
from tests.conftest import ResidualNet


def _batch_dim(path) -> str | int:
    dim = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim[0]
    return dim.dim_param or dim.dim_value


def _digest(path) -> str:
    """Graph and initializers (metadata excluded: it records nothing about the sample)."""
    return hashlib.sha256(onnx.load(str(path)).graph.SerializeToString()).hexdigest()


def test_dynamic_file_runs_any_batch_within_2_lsb(tiny_pt2e, tiny_calib, tmp_path):
    path = export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "d.onnx", dynamic_batch=True)
    assert _batch_dim(path) == "batch"
    g = torch.Generator().manual_seed(5)
    for n in (1, 3, 16):
        x = torch.randn(n, 1, 32, 32, generator=g)
        assert compare_logits(tiny_pt2e, path, x).max_lsb <= 2, n
        assert run_session(ort_session(path, optimized=True), [x.numpy()])[0].shape == (n, 10)


def test_dynamic_export_from_a_batch_one_sample(tiny_pt2e, tmp_path):
    path = export_qdq(tiny_pt2e, torch.randn(1, 1, 32, 32), tmp_path / "d1.onnx", dynamic_batch=True)
    assert _batch_dim(path) == "batch"
    assert run_session(ort_session(path), [torch.randn(4, 1, 32, 32).numpy()])[0].shape == (4, 10)


def test_without_target_the_file_keeps_the_sample_batch(tiny_qdq):
    assert _batch_dim(tiny_qdq) == 8


class FixedBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x).reshape(8, -1).sum(1, keepdim=True)


def test_static_capture_asked_for_a_dynamic_file_is_refused_with_the_guard(tmp_path):
    q = Quantizer().quantize(FixedBatch().eval(), [torch.randn(8, 1, 8, 8)])
    with pytest.raises(ValueError) as info:
        export_qdq(q, torch.randn(8, 1, 8, 8), tmp_path / "s.onnx", target="tensorrt")
    message = str(info.value)
    assert "dynamic_batch=True" in message and "captured at batch 8" in message
    assert "test_dynamic_batch.py:" in message and "reshape(8, -1)" in message
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="runs batch 8 only"):
        export_qdq(q, torch.randn(4, 1, 8, 8), tmp_path / "s.onnx", dynamic_batch=False)
    assert list(tmp_path.iterdir()) == []
    path = export_qdq(q, torch.randn(8, 1, 8, 8), tmp_path / "s.onnx", dynamic_batch=False)
    assert _batch_dim(path) == 8


@pytest.fixture(scope="module")
def rgb_net():
    torch.manual_seed(0)
    return ResidualNet(in_channels=3).eval()


# tensorrt and tigris are the presets a channels-last sample used to break (a float mean before the Q);
# the two uint8 presets take the same path and run in the slow suite
LAYOUT_TARGETS = [p.target if p.target in ("tensorrt", "tigris") else pytest.param(p.target, marks=pytest.mark.slow)
                  for p in PRESETS]


@pytest.mark.parametrize("target", LAYOUT_TARGETS)
def test_channels_last_samples_give_the_same_file(rgb_net, target, tmp_path):
    """Contiguous vs channels-last calibration batches (8, 8, 5) and sample: identical graph and
    initializers, and the target's own checks pass (export_qdq(target=) runs them)."""
    g = torch.Generator().manual_seed(7)
    calib = [torch.randn(n, 3, 16, 16, generator=g) for n in (8, 8, 5)]
    preset = next(p for p in PRESETS if p.target == target)
    paths = {}
    for layout, batches in [("contiguous", calib), ("channels_last", [b.to(memory_format=torch.channels_last)
                                                                      for b in calib])]:
        q = Quantizer.for_target(target).quantize(rgb_net, batches)
        paths[layout] = export_qdq(q, batches[0], tmp_path / f"{layout}.onnx", target=target)
    assert _batch_dim(paths["contiguous"]) == ("batch" if preset.dynamic_batch else 1)
    assert "Gather" not in {n.op_type for n in onnx.load(str(paths["channels_last"])).graph.node}
    assert _digest(paths["channels_last"]) == _digest(paths["contiguous"])


def test_a_non_contiguous_sample_gives_the_same_file(tiny_pt2e, tiny_calib, tiny_qdq, tmp_path):
    strided = tiny_calib[0].transpose(2, 3).contiguous().transpose(2, 3)
    assert not strided.is_contiguous() and torch.equal(strided, tiny_calib[0])
    path = export_qdq(tiny_pt2e, strided, tmp_path / "strided.onnx")
    assert _digest(path) == _digest(tiny_qdq)
