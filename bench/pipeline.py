"""Wall time and peak memory of the quantship pipeline: quantize (pt2e) and export_qdq.

Each case runs in a fresh subprocess so its peak RSS is its own.

    python bench/pipeline.py [--models resnet18 mobilenet_v2] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_one(model_name: str, batch: int, target: str) -> dict:
    warnings.filterwarnings("ignore")
    import torch
    import torchvision

    from quantship import Quantizer, export_qdq

    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(weights=None).eval()
    calib = [torch.randn(batch, 3, 224, 224) for _ in range(4)]
    rss_model = _peak_rss_mb()
    t0 = time.perf_counter()
    qmodel = Quantizer.for_target(target).quantize(model, calib, max_calibration_samples=4 * batch)
    t1 = time.perf_counter()
    rss_quantize = _peak_rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        export_qdq(qmodel, calib[0], Path(tmp) / "model.onnx", target=target)
    t2 = time.perf_counter()
    return {"model": model_name, "batch": batch, "target": target, "quantize_s": t1 - t0,
            "export_s": t2 - t1, "peak_rss_mb_after_load": rss_model,
            "peak_rss_mb_after_quantize": rss_quantize, "peak_rss_mb": _peak_rss_mb()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--target", default="onnxruntime-cpu")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.batch, args.target)))
        return 0
    print("| model | batch | target | quantize s | export_qdq s | peak RSS MB (model loaded / after quantize / end) |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        out = subprocess.run([sys.executable, __file__, "--one", name, "--batch", str(args.batch),
                              "--target", args.target], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['batch']} | {r['target']} | {r['quantize_s']:.1f} | {r['export_s']:.1f} | "
              f"{r['peak_rss_mb_after_load']:.0f} / {r['peak_rss_mb_after_quantize']:.0f} / {r['peak_rss_mb']:.0f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
