"""Export fixtures: a small pt2e model, and ResNet-18 files written once per session."""

from __future__ import annotations

import warnings

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_calib():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8, 1, 32, 32, generator=g) for _ in range(2)]


@pytest.fixture(scope="session")
def tiny_pt2e(tiny_calib):
    from quantship import Quantizer
    from quantship.examples.models import TinyResNet

    torch.manual_seed(0)
    return Quantizer(backend="pt2e").quantize(TinyResNet().eval(), tiny_calib)


@pytest.fixture(scope="session")
def tiny_affine_pt2e(tiny_calib):
    from quantship import Quantizer
    from quantship.examples.models import TinyResNet

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantizer = Quantizer(backend="pt2e", symmetric=False)
    return quantizer.quantize(TinyResNet().eval(), tiny_calib)


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="session")
def resnet18_qdq(resnet18_pt2e, resnet18_sample, export_dir):
    from quantship import export_qdq

    return export_qdq(resnet18_pt2e, resnet18_sample, export_dir / "resnet18_qdq.onnx")


@pytest.fixture(scope="session")
def resnet18_fp32(resnet18, resnet18_sample, export_dir):
    from quantship import export_onnx

    return export_onnx(resnet18, resnet18_sample, export_dir / "resnet18_fp32.onnx")


@pytest.fixture(scope="session")
def tiny_qdq(tiny_pt2e, tiny_calib, export_dir):
    """The small model's opset-18 int8 file, written once."""
    from quantship import export_qdq

    return export_qdq(tiny_pt2e, tiny_calib[0], export_dir / "tiny_qdq.onnx")


@pytest.fixture(scope="session")
def tiny_produced(tiny_pt2e, tiny_calib):
    """The small model's graph exactly as the dynamo exporter produces it (to skip re-exporting)."""
    import quantship.export.qdq as qdq

    return qdq.produce(tiny_pt2e, tiny_calib[0], opset_version=18, dynamic_batch=False,
                       input_names=None, output_names=None)


@pytest.fixture
def reuse_produced(tiny_produced, monkeypatch):
    """Make export_qdq take the cached produced graph instead of running the exporter again."""
    import onnx

    import quantship.export.qdq as qdq

    def cached(*args, **kwargs):
        copy = onnx.ModelProto()
        copy.CopyFrom(tiny_produced)
        return copy

    monkeypatch.setattr(qdq, "produce", cached)
