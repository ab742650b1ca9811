"""export_onnx, ONNXModel and verify_onnx: the float path, optionally quantized by ONNX Runtime."""

from __future__ import annotations

import onnx
import pytest
import torch

from quantship import ONNXModel, export_onnx, verify_onnx
from quantship.examples.models import TinyResNet


@pytest.mark.slow
def test_resnet18_float_file_verifies_and_runs_at_any_batch(resnet18, resnet18_sample, resnet18_fp32):
    model = onnx.load(str(resnet18_fp32), load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}[""] == 17
    assert verify_onnx(resnet18, resnet18_fp32, resnet18_sample)
    session = ONNXModel(resnet18_fp32)
    for batch in (1, 3):
        x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(batch))
        out = session(x)
        assert out.shape == (batch, 1000)
        with torch.no_grad():
            assert torch.allclose(out, resnet18(x), rtol=1e-3, atol=1e-4)


@pytest.fixture(scope="module")
def resnet18_64():
    from torchvision.models import resnet18 as build

    torch.manual_seed(0)
    return build(weights=None).eval()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_resnet18_ort_quantized_files_run(resnet18_64, mode, tmp_path):
    g = torch.Generator().manual_seed(4)
    calib = [torch.randn(4, 3, 64, 64, generator=g) for _ in range(2)]
    path = export_onnx(resnet18_64, calib[0], tmp_path / f"r_{mode}.onnx", quantize=True, quantize_mode=mode,
                       calibration_data=calib if mode == "static" else None)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    integer_ops = {"DynamicQuantizeLinear", "ConvInteger", "MatMulInteger"} if mode == "dynamic" else {"QuantizeLinear"}
    assert ops & integer_ops
    out = ONNXModel(path)(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 1000) and torch.isfinite(out).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"r_{mode}.onnx"]


def test_pt2e_model_is_refused_with_a_pointer(tiny_pt2e, tiny_calib, tmp_path):
    with pytest.raises(ValueError, match="export_qdq"):
        export_onnx(tiny_pt2e, tiny_calib[0], tmp_path / "x.onnx")
    assert list(tmp_path.iterdir()) == []


class TwoHeads(torch.nn.Module):
    """Two inputs, two outputs: ONNXModel must pass both ways."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(5, 2)

    def forward(self, x, y):
        return self.a(x), self.b(y) + self.a(x).sum(-1, keepdim=True)


def test_multiple_inputs_and_outputs(tmp_path):
    torch.manual_seed(0)
    model = TwoHeads().eval()
    sample = (torch.randn(2, 4), torch.randn(2, 5))
    path = export_onnx(model, sample, tmp_path / "two.onnx", input_names=["x", "y"], output_names=["p", "q"])
    runner = ONNXModel(path)
    assert runner.input_names == ["x", "y"] and runner.output_names == ["p", "q"]
    p, q = runner(*sample)
    assert p.shape == (2, 3) and q.shape == (2, 2)
    assert verify_onnx(model, path, sample)
    with pytest.raises(ValueError, match="takes 2 input"):
        runner(sample[0])


def test_verify_onnx_notices_a_different_model(tmp_path):
    torch.manual_seed(0)
    model, other = TinyResNet().eval(), TinyResNet().eval()
    x = torch.randn(2, 1, 32, 32)
    path = export_onnx(model, x, tmp_path / "t.onnx", dynamic_batch=False)
    assert verify_onnx(model, path, x)
    assert not verify_onnx(other, path, x)


def test_static_quantization_needs_data(tmp_path):
    with pytest.raises(ValueError, match="calibration_data"):
        export_onnx(TinyResNet().eval(), torch.randn(1, 1, 32, 32), tmp_path / "s.onnx", quantize=True,
                    quantize_mode="static")
    with pytest.raises(ValueError, match="quantize_mode='bogus'"):
        export_onnx(TinyResNet().eval(), torch.randn(1, 1, 32, 32), tmp_path / "s.onnx", quantize=True,
                    quantize_mode="bogus")


def test_onnx_model_and_verify_onnx_keep_their_public_names():
    import quantship
    import quantship.export
    from quantship.inspect.run import onnx_model

    assert quantship.ONNXModel is quantship.export.ONNXModel is onnx_model.ONNXModel
    assert quantship.verify_onnx is quantship.export.verify_onnx is onnx_model.verify_onnx


def test_onnx_model_refuses_a_file_ort_cannot_load_in_one_line(tmp_path):
    from quantship.errors import FileRefused

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf at all")
    with pytest.raises(FileRefused, match="ONNX Runtime cannot load it") as caught:
        ONNXModel(bad)
    assert "\n" not in str(caught.value)
    with pytest.raises(FileNotFoundError):
        ONNXModel(tmp_path / "missing.onnx")


def test_ort_settings_come_from_the_presets():
    """quantize-onnx has no table of its own: each preset's dtype, symmetry, granularity and range."""
    from quantship.export.ort_quantize import ort_settings
    from quantship.precision import PRESETS, resolve_spec

    for p in PRESETS:
        spec = resolve_spec(**p.spec_kwargs)
        got = ort_settings(p.target)
        assert got.activation_type == {"uint8": "QUInt8", "int8": "QInt8"}[p.activation_dtype]
        assert got.activation_symmetric is spec.symmetric and got.reduce_range is spec.reduce_range
        assert got.per_channel is (spec.qscheme == "per_channel") and not ort_settings(p, per_tensor=True).per_channel
    assert ort_settings("onnxruntime") == ort_settings("onnxruntime-cpu")  # the alias reads the same row


def test_static_ort_quantization_writes_nothing_outside_the_destination(tmp_path, monkeypatch):
    import tempfile

    cwd, scratch = tmp_path / "cwd", tmp_path / "scratch"
    cwd.mkdir(), scratch.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    torch.manual_seed(0)
    calib = [torch.randn(2, 1, 32, 32) for _ in range(2)]
    path = export_onnx(TinyResNet().eval(), calib[0], tmp_path / "q.onnx", quantize=True, quantize_mode="static",
                       calibration_data=calib, dynamic_batch=False)
    assert {n.op_type for n in onnx.load(str(path)).graph.node} >= {"QuantizeLinear", "DequantizeLinear"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "q.onnx", "scratch"]
    assert list(cwd.iterdir()) == [] and list(scratch.iterdir()) == []


def test_a_float_file_over_the_threshold_is_written_with_its_data_beside_it(tmp_path, monkeypatch):
    """export_onnx above ``EXTERNAL_DATA_THRESHOLD`` (lowered here): the exported graph, ONNX Runtime's
    optimized graph and the file written all keep their weights outside; the pair verifies from its folder."""
    from quantship.export import artifact

    monkeypatch.setattr(artifact, "EXTERNAL_DATA_THRESHOLD", 0)
    torch.manual_seed(0)
    model, x = TinyResNet().eval(), torch.randn(2, 1, 32, 32)
    out = tmp_path / "out"
    out.mkdir()
    path = export_onnx(model, x, out / "t.onnx", dynamic_batch=False)
    (data,) = artifact.external_locations(path)
    assert sorted(p.name for p in out.iterdir()) == sorted(["t.onnx", data])
    monkeypatch.chdir(tmp_path)  # ONNX Runtime finds the data beside the graph, not in the working directory
    assert verify_onnx(model, path, x)
