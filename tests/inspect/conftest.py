"""Model files for the inspect tests, each built once per session into a temporary directory.

pt2e files are exported with ``torch.onnx.export(dynamo=True, opset_version=18)`` directly
(``quantship.export.export_qdq`` had not landed when these tests were written). ONNX Runtime's
quantizer makes the QOperator, dynamic, partial and uint8 files from a small float model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
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


def export_pt2e(model: nn.Module, calib: list[torch.Tensor], path: Path) -> Path:
    from quantship import Quantizer

    quantized = Quantizer(backend="pt2e").quantize(model, calib)
    quantized.eval()  # pt2e's GraphModule accepts eval() (returning None) and exports in eval mode
    torch.onnx.export(quantized, (calib[0],), str(path), dynamo=True, opset_version=18, verbose=False)
    return path


def export_float(model: nn.Module, sample: torch.Tensor, path: Path) -> Path:
    torch.onnx.export(model, (sample,), str(path), dynamo=True, opset_version=18, verbose=False,
                      external_data=False)
    return path


def to_uint8_activations(src: Path, dst: Path) -> Path:
    """Restate every activation Q/DQ pair (int8, zero-point 0) as uint8 with zero-point 128."""
    from quantship.inspect.loading import load_onnx
    from quantship.inspect.view import GraphView

    model = load_onnx(src)
    view = GraphView.of(model)
    inits = {t.name: t for t in model.graph.initializer}
    done = set()
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and node.input[0] not in view.constant:
            name = node.input[2]
            if name in done:
                continue
            value = onnx.numpy_helper.to_array(inits[name]) if name in inits else None
            assert value is not None and value.dtype == np.int8 and not value.any()
            inits[name].CopyFrom(onnx.numpy_helper.from_array(np.full(value.shape, 128, np.uint8), name))
            done.add(name)
    del model.graph.value_info[:]
    onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data")
    return dst


@pytest.fixture(scope="session")
def files(tmp_path_factory) -> dict[str, Path]:
    """pt2e MobileNetV2 (96x96) and ResNet-18 (64x64) files, batch 1, and a uint8 restatement."""
    from torchvision.models import mobilenet_v2, resnet18

    root = tmp_path_factory.mktemp("pt2e")
    out = {}
    for name, build, size in (("mobilenetv2", mobilenet_v2, 96), ("resnet18", resnet18, 64)):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        calib = [torch.randn(1, 3, size, size, generator=g) for _ in range(4)]
        out[name] = export_pt2e(build(weights=None).eval(), calib, root / f"{name}.onnx")
    out["resnet18_uint8"] = to_uint8_activations(out["resnet18"], root / "resnet18_uint8.onnx")
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
