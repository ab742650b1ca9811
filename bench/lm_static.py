"""Held-out perplexity of the byte-level LMs as static W8A8 (the onnxruntime-cpu preset): the reference Llama
and a GPT-2 trained the same way, FP32 against the quantized torch model and its QDQ file in ONNX Runtime.

Each figure is the perplexity over the held-out standard-library files with a bootstrap 95% interval over
files, and the change against FP32 with a paired bootstrap interval (the same resampled files for both),
as bench/lm_perplexity.py measures the weight-only rows. Calibration: random windows of the training
files (never the held-out ones). The LSB column is export_qdq's literal reading of the file (ONNX Runtime,
optimizations off) against the quantized torch model on the export sample.

    python bench/lm_static.py [--per-file 1] [--calibration 32] [--out BENCHMARKS-LM-static.md]
    python bench/lm_static.py --smoke [--out FILE]   # tiny untrained LMs, 4 files (bench/_smoke.py)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
GPT2_STEPS = 150  # GPT-2's training: the reference recipe, fewer steps (bounded time on shared cores)


def _models(smoke: bool) -> dict:
    """label -> (model, how it was trained)."""
    import _smoke

    from quantship.examples import lm

    if smoke:
        import torch

        torch.manual_seed(0)
        return {"Llama": (_smoke.tiny_lm(), "untrained"), "GPT-2": (lm.build_gpt2(64, 1, 2, 128), "untrained")}
    log = lambda m: print(f"training: {m}", flush=True)  # noqa: E731
    return {"Llama": (lm.trained_model(log=log), "the reference LM: hidden 256, 4 layers, 400 steps"),
            "GPT-2": (lm.trained_model(architecture="gpt2", steps=GPT2_STEPS, log=log),
                      f"hidden 128, 2 layers, 4 heads, MLP 512, {GPT2_STEPS} steps")}


def main(argv: list[str] | None = None) -> int:
    import _smoke
    import torch
    from lm_perplexity import calibration_batches

    from quantship import Quantizer, export_qdq
    from quantship.examples import lm
    from quantship.inspect import ort_optimized_ops

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-file", type=int, default=1, help="128-byte windows per held-out file")
    parser.add_argument("--files", type=int, default=None, help="only the first N held-out files (default: all)")
    parser.add_argument("--calibration", type=int, default=32, help="calibration windows (batches of 8)")
    parser.add_argument("--out", type=Path, default=None, help="default: BENCHMARKS-LM-static.md")
    args = _smoke.parse_args(parser, argv, per_file=1, files=4, calibration=8)
    args.out = _smoke.output(args, args.out, ROOT / "BENCHMARKS-LM-static.md")
    load_start = os.getloadavg()[0]

    corpus = lm.load_corpus()
    windows = lm.eval_windows(corpus, per_file=args.per_file)[:args.files]
    n_windows = sum(len(w) for w in windows)
    calibration = calibration_batches(corpus, args.calibration, lm.SEQ_LEN)
    sample = torch.from_numpy(windows[0][0][None, :-1])
    lines = ["| model | variant | held-out perplexity [95% CI] | vs FP32 [paired 95% CI] | LSB literal / fused | quantize s |",
             "|---|---|---|---|---|---|"]
    trained, census = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for label, (model, how) in _models(args.smoke).items():
            trained.append(f"{label}: {how}")
            t0 = time.perf_counter()
            quantizer = Quantizer.for_target("onnxruntime-cpu")
            quantized = quantizer.quantize(model, calibration, max_calibration_samples=args.calibration)
            seconds = time.perf_counter() - t0
            print(f"{label}: quantize {seconds:.1f} s; left float: {quantizer.report.unannotated_ops}", flush=True)
            path = export_qdq(quantized, sample, Path(tmp) / f"{label}.onnx", target="onnxruntime-cpu")
            lsb, fused = path.readings.literal_lsb, path.readings.fused_lsb
            ops = ort_optimized_ops(path)
            census.append(f"{label}: " + ", ".join(f"{ops[k]} {k}" for k in ("QGemm", "QLinearMatMul", "Gemm", "MatMul",
                                                                             "FusedMatMul") if ops[k]))
            rows = {}
            for variant, fn in [("FP32 (torch)", lm.torch_logits(model)),
                                ("W8A8 (torch)", lm.torch_logits(quantized)),
                                ("W8A8 (QDQ file, ORT)", lm.onnx_logits(path))]:
                t0 = time.perf_counter()
                rows[variant] = lm.file_nll(fn, windows)
                print(f"{label} {variant}: {time.perf_counter() - t0:.1f} s", flush=True)
            fp32 = rows["FP32 (torch)"]
            for variant, r in rows.items():
                p = lm.perplexity(r, None if r is fp32 else fp32)
                change = "-" if p.ratio is None else (f"{100 * (p.ratio - 1):+.2f}% "
                                                      f"[{100 * (p.ratio_low - 1):+.2f}, {100 * (p.ratio_high - 1):+.2f}]")
                lsb_cell = f"{lsb:.1f} / {fused:.1f}" if "file" in variant and lsb is not None else "-"
                took = f"{seconds:.1f}" if variant == "W8A8 (torch)" else "-"
                lines.append(f"| {label} | {variant} | {p.value:.4f} [{p.low:.4f}, {p.high:.4f}] | {change} | "
                             f"{lsb_cell} | {took} |")
    table = "\n".join(lines)
    print(table)
    text = "\n".join([
        "# Language-model perplexity (static W8A8, onnxruntime-cpu)", "", *_smoke.banner(args),
        "Generated by `python bench/lm_static.py`; do not edit by hand. Byte-level LMs of `quantship.examples.lm`",
        "trained on this Python's standard library (" + "; ".join(trained) + ").",
        "Quantized by `Quantizer.for_target('onnxruntime-cpu')` (its default observer), calibrated on "
        f"{args.calibration} random {lm.SEQ_LEN}-byte windows of the training files; the file is `export_qdq`'s.",
        f"Held-out: {len(windows)} files (one in ten, by a hash of the path), {n_windows} windows of",
        f"{lm.SEQ_LEN} bytes. Perplexity per byte; intervals: 2,000 bootstrap resamples of the held-out files.",
        f"With {args.per_file} window(s) per file (one: each file's first bytes) the set differs from BENCHMARKS-LM.md's",
        "two per file: compare the changes against FP32, not the perplexities across the two tables.",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {os.cpu_count()} shared cores, load "
        f"average (1 min) {load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (times scale with it).",
        "LSB: export_qdq's two readings of the file on the export sample against the quantized torch model, in",
        "the output's quantization steps: literal (ONNX Runtime, optimizations off) and fused (its default level).",
        "The products ONNX Runtime runs at its default level (integer kernels first): " + "; ".join(census) + ".",
        "", table, "",
    ])
    args.out.write_text(text)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
