"""One file, every batch size: calibrate on batches of 8, 8 and 5, export with a symbolic batch, and
measure the file against the torch quantized model at several batch sizes (ONNX Runtime read
literally, optimizations off), plus the fused kernels ONNX Runtime runs for it.

    python bench/dynamic_batch.py [--models resnet18 mobilenet_v2] [--size 64] [--batches 1 3 8 16]
    python bench/dynamic_batch.py --smoke   # resnet18 at 32x32, batches 1 and 3, one preset (bench/_smoke.py)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(model_name: str, size: int, batches: list[int], targets: list[str], workdir: Path) -> list[str]:
    import torchvision

    from quantship import Quantizer, export_qdq
    from quantship.inspect import compare_logits, ort_optimized_ops

    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(weights=None).eval()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(n, 3, size, size, generator=gen) for n in (8, 8, 5)]
    rows = []
    for target in targets:
        t0 = time.perf_counter()
        qmodel = Quantizer.for_target(target).quantize(model, calib)
        path = export_qdq(qmodel, calib[0], workdir / f"{model_name}_{target}.onnx", target=target)
        seconds = time.perf_counter() - t0
        errors = []
        for n in batches:
            x = torch.randn(n, 3, size, size, generator=gen)
            errors.append(f"{compare_logits(qmodel, path, x).max_lsb:.0f}")
        ops = ort_optimized_ops(path)
        convs = ops["QLinearConv"] + ops["Conv"] + ops["FusedConv"]
        rows.append(f"| {model_name} | {target} | {' / '.join(errors)} | {ops['QLinearConv']}/{convs} | "
                    f"{seconds:.1f} |")
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    import _smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 3, 8, 16])
    parser.add_argument("--targets", nargs="+", default=["onnxruntime-cpu", "tensorrt"])
    args = _smoke.parse_args(parser, argv, models=["resnet18"], size=32, batches=[1, 3], targets=["onnxruntime-cpu"])
    print(f"calibration batches 8, 8, 5 at {args.size}x{args.size}; max LSB vs torch (ORT literal) at batch "
          f"{' / '.join(map(str, args.batches))}")
    print("| model | preset | max LSB per batch | QLinearConv (ORT optimized) | quantize + export s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            run(name, args.size, args.batches, args.targets, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
