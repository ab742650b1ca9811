"""Model files for the inspect tests, each built once per session into a temporary directory.

pt2e files are written by ``quantship.export.export_qdq`` (int8, and uint8 activations with
zero-point 128). ONNX Runtime's quantizer makes the QOperator, dynamic, partial and uint8 files
from a small float model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn


class SmallNet(nn.Module):
    """Two convs, a residual add, a global pool and a Linear head: 3x32x32 inputs."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        y = torch.relu(self.c2(y) + y)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def quantize_pt2e(model: nn.Module, calib: list[torch.Tensor]) -> nn.Module:
    from quantship import Quantizer

    return Quantizer(backend="pt2e").quantize(model, calib)


def export_pt2e(model: nn.Module, calib: list[torch.Tensor], path: Path, *, quantized: nn.Module | None = None,
                activation_dtype: str | None = None) -> Path:
    """Quantize with pt2e (unless ``quantized`` is given) and write the file with export_qdq."""
    from quantship.export import export_qdq

    quantized = quantized if quantized is not None else quantize_pt2e(model, calib)
    return Path(export_qdq(quantized, calib[0], path, activation_dtype=activation_dtype))


def with_external_data(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose weights live in ``<dst name>.data`` beside it."""
    import onnx

    onnx.save(onnx.load(str(src)), str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
              location=dst.name + ".data", size_threshold=0)
    return dst


def export_float(model: nn.Module, sample: torch.Tensor, path: Path) -> Path:
    torch.onnx.export(model, (sample,), str(path), dynamo=True, opset_version=18, verbose=False,
                      external_data=False)
    return path


@pytest.fixture(scope="session")
def files(tmp_path_factory, mobilenet_v2_pt2e, resnet18_pt2e) -> dict[str, Path]:
    """pt2e MobileNetV2 (96x96) and ResNet-18 (224x224) files, batch 1, and ResNet-18 with uint8 activations.

    Both models are the session's quantized ones (tests/conftest.py, batch symbolic), written here at
    batch 1: neither is quantized a second time.
    """
    root = tmp_path_factory.mktemp("pt2e")
    g = torch.Generator().manual_seed(1)
    out = {"mobilenetv2": export_pt2e(None, [torch.randn(1, 3, 96, 96, generator=g)], root / "mobilenetv2.onnx",
                                      quantized=mobilenet_v2_pt2e)}
    sample = [torch.randn(1, 3, 224, 224, generator=g)]
    out["resnet18"] = export_pt2e(None, sample, root / "resnet18.onnx", quantized=resnet18_pt2e)
    out["resnet18_uint8"] = export_pt2e(None, sample, root / "resnet18_uint8.onnx", quantized=resnet18_pt2e,
                                        activation_dtype="uint8")
    return out


@pytest.fixture(scope="session")
def ort_files(tmp_path_factory) -> dict[str, Path]:
    """ONNX Runtime quantizer outputs from SmallNet: QDQ uint8, QOperator, dynamic, Conv-only."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    root = tmp_path_factory.mktemp("ort")
    torch.manual_seed(0)
    float_path = export_float(SmallNet().eval(), torch.randn(1, 3, 32, 32), root / "float.onnx")
    pre = root / "pre.onnx"
    quant_pre_process(str(float_path), str(pre), skip_symbolic_shape=True)

    class Reader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.feeds = iter([{"x": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(8)])

        def get_next(self):
            return next(self.feeds, None)

    extra = {"ForceQuantizeNoInputCheck": True}
    out = {"float": float_path}
    for name, kwargs in (
        ("uint8", dict(quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8, per_channel=True)),
        ("qoperator", dict(quant_format=QuantFormat.QOperator, activation_type=QuantType.QUInt8)),
        ("partial", dict(quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8, op_types_to_quantize=["Conv"])),
    ):
        out[name] = root / f"{name}.onnx"
        quantize_static(str(pre), str(out[name]), Reader(), weight_type=QuantType.QInt8, extra_options=extra, **kwargs)
    out["dynamic"] = root / "dynamic.onnx"
    quantize_dynamic(str(pre), str(out["dynamic"]), weight_type=QuantType.QInt8)
    return out


@pytest.fixture(scope="session")
def digits_files(tmp_path_factory) -> dict[str, Path]:
    """The reference task (trained TinyResNet on digits): float and pt2e INT8 files, batch 1."""
    from quantship.examples.digits import load_split, trained_model

    root = tmp_path_factory.mktemp("digits")
    model = trained_model()
    split = load_split()
    calib = [split.x_train[i : i + 1] for i in range(32)]
    return {
        "float": export_float(model, calib[0], root / "digits_float.onnx"),
        "int8": export_pt2e(model, calib, root / "digits_int8.onnx"),
    }


@pytest.fixture(scope="session")
def small_qdq(tmp_path_factory) -> Path:
    """A pt2e INT8 SmallNet file (3x32x32, batch 1): 7 Q / 10 DQ, the seed of the broken-file and fuzz tests."""
    root = tmp_path_factory.mktemp("small")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(1, 3, 32, 32, generator=g) for _ in range(4)]
    return export_pt2e(SmallNet().eval(), calib, root / "small_int8.onnx")


@pytest.fixture(scope="session")
def constant_file(tmp_path_factory) -> Path:
    """A pt2e INT8 SmallNet whose first ReLU is always off: its output is the same for every input
    (like an untrained torchvision MobileNetV2's)."""
    torch.manual_seed(0)
    model = SmallNet().eval()
    with torch.no_grad():
        model.c1.bias.fill_(-1e3)
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(1, 3, 32, 32, generator=g) for _ in range(4)]
    return export_pt2e(model, calib, tmp_path_factory.mktemp("constant") / "constant_int8.onnx")
