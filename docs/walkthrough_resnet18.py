"""Walk-through 1: name a precision, quantize ResNet-18, export QDQ ONNX, read the file, verify it.

Run it:  .venv/bin/python docs/walkthrough_resnet18.py [--out-dir DIR]
The test suite runs it too (tests/test_docs.py) and checks the figures it prints.

The model is an untrained torchvision ResNet-18 (no weights can be downloaded here): the numbers
are about the graph and the file, not about accuracy. Accuracy is the demo's job
(`quantship demo`, a CNN trained on scikit-learn's digits).
"""

import warnings
from pathlib import Path

import torch
from _walkthrough import run
from torchvision.models import resnet18

from quantship import Quantizer, export_onnx, export_qdq, qdq_stats, quant_spec, verify_qdq
from quantship.inspect import compare_logits, quant_spec_of_file


def setup() -> tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor]:
    """The model, the calibration batches and the export sample, the same in every process."""
    torch.manual_seed(0)
    model = resnet18(weights=None).eval()
    batch = 8  # the calibration batch; pt2e captures a symbolic batch, export_qdq writes the sample's batch
    calibration = [torch.randn(batch, 3, 224, 224) for _ in range(4)]
    sample = torch.randn(batch, 3, 224, 224)
    return model, calibration, sample


def main(out_dir: Path) -> None:
    model, calibration, sample = setup()
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters")

    # 0. The FP32 baseline first, as the seed notebook does: something to compare the INT8 file against
    fp32 = export_onnx(model, sample, out_dir / "resnet18_fp32.onnx", dynamic_batch=False)
    print(f"FP32 baseline: {fp32.name}, {fp32.stat().st_size / 1e6:.1f} MB")

    # 1. Name the precision: validated against the support matrix before any work
    quantizer = Quantizer(backend="pt2e", weight_bits=8, act_bits=8, qscheme="per_channel", symmetric=True)
    print("spec:", quantizer.spec.as_dict())
    try:
        Quantizer(backend="x86", symmetric=True)
    except ValueError as refusal:
        print("refused:", refusal)

    # 2. Quantize: a new model, tagged with the spec that produced it
    qmodel = quantizer.quantize(model, calibration_dl=calibration, max_calibration_samples=32)
    print("label:", quant_spec(qmodel).label, "| exports:", quant_spec(qmodel).exports)

    # 3. Export the QDQ file (checked on the file before it appears)
    int8 = export_qdq(qmodel, sample, out_dir / "resnet18_int8.onnx")
    print(f"FP32 {fp32.stat().st_size / 1e6:.1f} MB, INT8 {int8.stat().st_size / 1e6:.1f} MB "
          f"({fp32.stat().st_size / int8.stat().st_size:.2f}x smaller)")

    # 4. Inspect what was written
    print("qdq_stats:", qdq_stats(int8).as_dict())
    print("spec read back from the file equals the model's:", quant_spec_of_file(int8) == quant_spec(qmodel))

    # 5. Verify against PyTorch: argmax agreement (vacuous on an untrained net: it warns) and logits in LSB
    probe = torch.randn(32, 3, 224, 224)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        agreement = verify_qdq(qmodel, int8, probe, n_batches=4)
    print(f"argmax agreement: {agreement:.3f}")
    for w in caught:
        if "vacuous" in str(w.message):
            print("warning:", w.message)
    print("logits, file (ONNX Runtime) vs torch:", compare_logits(qmodel, int8, probe, n_batches=4))

    # 6. Move the Q/DQ pairs: the residual conv->add edge stays at accumulator precision
    # (one calibration batch is enough here: the placement, not the scales, is what this step shows)
    skip = Quantizer(qdq_placement="skip_conv_add", verbose=True).quantize(model, calibration[:1], 8)
    skip_path = export_qdq(skip, sample, out_dir / "resnet18_int8_skip.onnx")
    print("skip_conv_add qdq_stats:", qdq_stats(skip_path).as_dict())


if __name__ == "__main__":
    run(main)
