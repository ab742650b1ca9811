"""Held-out perplexity of the reference language model: FP32, W8A16, W4A16 (groups 32, 128, and 128 rounded by
GPTQ), and the ONNX files.

Each figure is the perplexity over the held-out standard-library files with a bootstrap 95% interval
over files, and the change against FP32 with a paired bootstrap interval (the same resampled files
for both). The torch models and the files ONNX Runtime reads are measured on the same windows. GPTQ
calibrates on CALIBRATION_WINDOWS random windows of the training files (never the held-out ones).

    python bench/lm_perplexity.py [--per-file 2] [--out BENCHMARKS-LM.md]
    python bench/lm_perplexity.py --smoke [--out FILE]   # a tiny untrained LM, 4 files (bench/_smoke.py)
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
CALIBRATION_WINDOWS = 128  # GPTQ's calibration: windows of the training files, in batches of 8
CALIBRATION_SEED = 1


def calibration_batches(corpus, n: int, seq_len: int) -> list:
    """``n`` random windows of ``seq_len`` bytes from the training files, as int64 batches of 8."""
    import numpy as np
    import torch

    stream = np.concatenate(corpus.train)
    starts = np.random.default_rng(CALIBRATION_SEED).integers(0, len(stream) - seq_len, size=n)
    windows = np.stack([stream[s:s + seq_len] for s in starts]).astype(np.int64)
    return [torch.from_numpy(windows[i:i + 8]) for i in range(0, n, 8)]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    import _smoke
    import torch

    from quantship import Quantizer, export_qdq
    from quantship.examples import lm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-file", type=int, default=2, help="128-byte windows per held-out file")
    parser.add_argument("--files", type=int, default=None, help="only the first N held-out files (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="default: BENCHMARKS-LM.md")
    args = _smoke.parse_args(parser, argv, per_file=1, files=4)
    args.out = _smoke.output(args, args.out, ROOT / "BENCHMARKS-LM.md")
    load_start = os.getloadavg()[0]

    if args.smoke:
        model = _smoke.tiny_lm()
    else:
        model = lm.trained_model(log=lambda m: print(f"training the reference LM: {m}", flush=True))
    corpus = lm.load_corpus()
    windows = lm.eval_windows(corpus, per_file=args.per_file)[:args.files]
    n_windows = sum(len(w) for w in windows)
    variants = {"FP32 (torch)": lm.torch_logits(model)}
    quantized, seconds = {}, {}
    calibration = calibration_batches(corpus, 16 if args.smoke else CALIBRATION_WINDOWS, lm.SEQ_LEN)
    n_calibration = sum(len(b) for b in calibration)
    for label, kwargs in [("W8A16", dict(method="int8_weight_only")),
                          ("W4A16 g32", dict(method="int4_weight_only", group_size=32)),
                          ("W4A16 g128", dict(method="int4_weight_only", group_size=128)),
                          ("W4A16 g128 + GPTQ", dict(method="int4_weight_only", group_size=128,
                                                     weight_algorithm="gptq"))]:
        data = calibration if "weight_algorithm" in kwargs else None
        t0 = time.perf_counter()
        quantized[label] = Quantizer("torchao", **kwargs).quantize(model, data, max_calibration_samples=n_calibration)
        seconds[f"{label} (torch)"] = time.perf_counter() - t0
        print(f"quantize {label}: {seconds[f'{label} (torch)']:.1f} s", flush=True)
        variants[f"{label} (torch)"] = lm.torch_logits(quantized[label])
    sample = torch.from_numpy(windows[0][0][None, :-1])
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label in ("W8A16", "W4A16 g32", "W4A16 g128", "W4A16 g128 + GPTQ"):
            for target, form in [(None, "DequantizeLinear"), ("onnxruntime-cpu", "MatMulNBits")]:
                path = export_qdq(quantized[label], sample, Path(tmp) / f"{label}_{form}.onnx".replace(" ", "_"),
                                  target=target)
                variants[f"{label} ({form} file, ORT)"] = lm.onnx_logits(path)
        for name, fn in variants.items():
            t0 = time.perf_counter()
            rows[name] = lm.file_nll(fn, windows)
            print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    fp32 = rows["FP32 (torch)"]
    lines = ["| model | held-out perplexity [95% CI] | vs FP32 [paired 95% CI] | quantize time |", "|---|---|---|---|"]
    for name, r in rows.items():
        p = lm.perplexity(r, None if r is fp32 else fp32)
        change = "-" if p.ratio is None else (f"{100 * (p.ratio - 1):+.2f}% "
                                              f"[{100 * (p.ratio_low - 1):+.2f}, {100 * (p.ratio_high - 1):+.2f}]")
        took = f"{seconds[name]:.1f} s" if name in seconds else "-"
        lines.append(f"| {name} | {p.value:.4f} [{p.low:.4f}, {p.high:.4f}] | {change} | {took} |")
    table = "\n".join(lines)
    print(table)
    text = "\n".join([
        "# Language-model perplexity (weight-only)", "", *_smoke.banner(args),
        "Generated by `python bench/lm_perplexity.py`; do not edit by hand. The reference byte-level Llama of",
        "`quantship.examples.lm` (4 layers, hidden 256, trained briefly on this Python's standard library).",
        f"Held-out: {len(windows)} files (one in ten, by a hash of the path), {n_windows} windows of",
        f"{lm.SEQ_LEN} bytes. Perplexity per byte; intervals: 2,000 bootstrap resamples of the held-out files.",
        "GPTQ (`weight_algorithm='gptq'`; its damping and block width: src/quantship/quantize/gptq.py): sequential",
        f"per Linear, natural column order, calibrated on {n_calibration} random {lm.SEQ_LEN}-byte "
        "windows of the",
        "training files. Quantize time: wall clock of `Quantizer.quantize` in this run (plain rows need no data).",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {os.cpu_count()} cores, load average "
        f"(1 min) {load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (times scale with it).", "",
        table, "",
    ])
    args.out.write_text(text)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
