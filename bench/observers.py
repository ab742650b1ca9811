"""Activation observers side by side: what each calibration method does to accuracy and logits.

Two models, one run, same calibration and evaluation data for every observer:

- the reference task (digits, trained TinyResNet): FP32 vs INT8 held-out accuracy (k/n, Wilson
  95%) and logit SQNR;
- MobileNetV2 at 96x96, untrained but with BatchNorm statistics set by a few train-mode batches
  (so activations have realistic, uneven ranges): logit SQNR against float. Its accuracy would be
  meaningless (no trained weights), so none is printed.

Run: ``.venv/bin/python bench/observers.py`` (a few minutes on 2 cores). Prints Markdown.
``--smoke``: one calibration batch of digits, MobileNetV2 at 32x32 on batches of 2 (bench/_smoke.py).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

from quantship import Quantizer, sqnr_db
from quantship.examples.real import Count

sys.path.insert(0, str(Path(__file__).resolve().parent))
OBSERVER_NAMES = ("minmax", "histogram", "percentile", "mse")


def logit_sqnr(reference: torch.nn.Module, quantized: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """SQNR (dB) of the quantized model's logits against the float model's, over all batches."""
    signal = noise = 0.0
    with torch.no_grad():
        for x in batches:
            ref, out = reference(x).double(), quantized(x).double()
            signal += float((ref * ref).sum())
            noise += float(((out - ref) ** 2).sum())
    return sqnr_db(signal, noise)


def quantize(model: torch.nn.Module, calib: list[torch.Tensor], observer: str) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Quantizer(backend="pt2e", act_observer=observer).quantize(model, calib)


def digits_rows(n_calib: int = 128) -> list[str]:
    """One Markdown row per observer on the trained reference task."""
    from quantship.examples import digits

    model, split = digits.trained_model(), digits.load_split()
    calib = [split.x_train[i:i + 32] for i in range(0, n_calib, 32)]
    evals = [split.x_test[i:i + 32] for i in range(0, len(split.y_test) - 31, 32)]
    fp_k, n = digits.evaluate(model, split.x_test, split.y_test, batch_size=32)
    rows = []
    for name in OBSERVER_NAMES:
        start = time.perf_counter()
        q = quantize(model, calib, name)
        k, _ = digits.evaluate(q, split.x_test, split.y_test, batch_size=32)
        rows.append(f"| digits TinyResNet | {name} | {Count(fp_k, n)} | {Count(k, n)} | "
                    f"{k / fp_k:.4f} | {logit_sqnr(model, q, evals):.2f} | {time.perf_counter() - start:.1f} |")
    return rows


def mobilenet_rows(size: int = 96, batch: int = 8) -> list[str]:
    """One Markdown row per observer on a BN-calibrated, untrained MobileNetV2."""
    from torchvision.models import mobilenet_v2

    torch.manual_seed(0)
    model = mobilenet_v2(weights=None)
    gen = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None  # cumulative average: the statistics of exactly these batches
    model.train()
    with torch.no_grad():  # set BatchNorm running statistics, no weight update
        for _ in range(4):
            model(torch.randn(batch, 3, size, size, generator=gen))
    model.eval()
    calib = [torch.randn(batch, 3, size, size, generator=gen) for _ in range(2)]
    evals = [torch.randn(batch, 3, size, size, generator=gen) for _ in range(3)]
    rows = []
    for name in OBSERVER_NAMES:
        start = time.perf_counter()
        q = quantize(model, calib, name)
        rows.append(f"| MobileNetV2 {size}px (BN-calibrated, untrained) | {name} | n/a | n/a | n/a | "
                    f"{logit_sqnr(model, q, evals):.2f} | {time.perf_counter() - start:.1f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    import _smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits-calib", type=int, default=128, help="digits calibration images (batches of 32)")
    parser.add_argument("--size", type=int, default=96, help="MobileNetV2 input size")
    parser.add_argument("--batch", type=int, default=8, help="MobileNetV2 batch")
    args = _smoke.parse_args(parser, argv, digits_calib=32, size=32, batch=2)
    header = ["| model | act_observer | FP32 accuracy | INT8 accuracy | INT8/FP32 | logit SQNR (dB) | s |",
              "|---|---|---|---|---:|---:|---:|"]
    rows = digits_rows(args.digits_calib) + mobilenet_rows(args.size, args.batch)
    print("\n".join(header + rows))
    print(f"\nAll observers calibrated on the same batches (digits: {args.digits_calib} training images; MobileNetV2: "
          f"{2 * args.batch} random {args.size}x{args.size} inputs) and evaluated on the same inputs (digits: 352 "
          f"held-out images; MobileNetV2: {3 * args.batch} random inputs). Weights: int8 per-channel symmetric in "
          "every row.")


if __name__ == "__main__":
    main()
