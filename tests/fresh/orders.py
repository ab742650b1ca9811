"""Run in a child process by tests/test_fresh_process.py: the export calls in the order a user makes them.

    python -m tests.fresh.orders ORDER OUT_DIR

ORDER is ``reverse`` (ResNet-18 of docs/walkthrough_resnet18.py: quantize, INT8 export, then the FP32
export), ``interleaved`` (two small models, float and INT8 exports interleaved), ``alone-a`` or
``alone-b`` (one small model, float then INT8, in a process of its own). Every file goes to OUT_DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

from quantship import Quantizer, export_onnx, export_qdq
from quantship.examples.models import TinyResNet

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _model_a() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(1)
    return TinyResNet(in_channels=1, classes=10, width=8).eval(), [torch.randn(4, 1, 16, 16) for _ in range(2)]


def _model_b() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(2)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()
    return net, [torch.randn(4, 3, 12, 12) for _ in range(2)]


def _quantize(model: nn.Module, calibration: list[torch.Tensor]) -> nn.Module:
    return Quantizer.for_target("onnxruntime-cpu").quantize(model, calibration_dl=calibration)


def main(order: str, out: Path) -> None:
    if order == "reverse":
        sys.path.insert(0, str(DOCS))
        from walkthrough_resnet18 import setup

        model, calibration, sample = setup()
        quantizer = Quantizer(backend="pt2e", weight_bits=8, act_bits=8, qscheme="per_channel", symmetric=True)
        qmodel = quantizer.quantize(model, calibration_dl=calibration, max_calibration_samples=32)
        export_qdq(qmodel, sample, out / "resnet18_int8.onnx")
        export_onnx(model, sample, out / "resnet18_fp32.onnx", dynamic_batch=False)
        return
    (a, cal_a), (b, cal_b) = _model_a(), _model_b()
    if order == "interleaved":
        export_onnx(a, cal_a[0], out / "a_fp32.onnx")
        qa = _quantize(a, cal_a)
        export_onnx(b, cal_b[0], out / "b_fp32.onnx")
        export_qdq(qa, cal_a[0], out / "a_int8.onnx", target="onnxruntime-cpu")
        qb = _quantize(b, cal_b)
        export_qdq(qb, cal_b[0], out / "b_int8.onnx", target="onnxruntime-cpu")
        return
    name, (model, calibration) = {"alone-a": ("a", (a, cal_a)), "alone-b": ("b", (b, cal_b))}[order]
    export_onnx(model, calibration[0], out / f"{name}_fp32.onnx")
    export_qdq(_quantize(model, calibration), calibration[0], out / f"{name}_int8.onnx", target="onnxruntime-cpu")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
