"""16-bit activations for the most sensitive tensors, against keeping them in float, on real models.

For each model (``bench/real.py``'s tasks: same data, calibration and metrics) and one preset, all from
one run: the FP32 file; plain INT8 (``quantize_onnx_file``); the per-node SQNR report of that file
(``sensitivity.node_sqnr``) and its ``--worst`` candidates; INT8 with those nodes' activations in 16 bits
(``int16=``); INT8 with those nodes kept in float (``exclude=``). Each file is scored in ONNX Runtime at
its default optimizations (what users run) with a Wilson 95% interval, its first output's SQNR against
the FP32 file's on the same samples (a finer reading than a top-1 that saturates), and timed there at batch 1, the
four files interleaved in the same loop (median), with ONNX Runtime's default threads and with one. The CPU and its load are printed: on a shared machine
read a latency ratio within 0.8-1.25 as a tie.

    python bench/int16.py                           # ocr_cls and mtcnn_onet, onnxruntime-cpu, 3 worst
    python bench/int16.py --models ocr_cls --worst 1
    python bench/int16.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _smoke
import numpy as np
import real

MODELS = ("ocr_cls", "mtcnn_onet")


def timed(paths: dict[str, Path], x, reps: int, threads: int = 0) -> dict[str, float]:
    """Median ms at batch 1 of each file in ONNX Runtime (default optimizations; ``threads`` intra-op
    threads, 0: ONNX Runtime's default), interleaved."""
    import onnxruntime as ort

    def session(path: Path):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = threads
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    sessions = {k: session(p) for k, p in paths.items()}
    feeds = {k: {s.get_inputs()[0].name: x[:1]} for k, s in sessions.items()}
    for k, s in sessions.items():  # warm-up
        s.run(None, feeds[k])
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(reps):
        for k, s in sessions.items():
            start = time.perf_counter()
            s.run(None, feeds[k])
            times[k].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def run_model(name: str, target: str, worst: int, reps: int, smoke: bool, workdir: Path) -> list[str]:
    from quantship import QuantshipError, one_line, sqnr_db
    from quantship.quantize_onnx import node_sqnr, quantize_onnx_file

    task = real.make_task(name, smoke, workdir)
    calibration = real.batched(task.calib, task.calib_batch)
    reference = real.run_ort(task.float_path, task.eval_x, task.eval_batch)
    paths = {"FP32": task.float_path}
    results = {}
    plain = workdir / f"{name}_plain.onnx"
    results["plain INT8"] = quantize_onnx_file(task.float_path, plain, calibration, target=target, run_check=False)
    paths["plain INT8"] = plain
    report = node_sqnr(task.float_path, calibration, target=target, quantized_path=plain)
    chosen = report.suggest_exclude(worst)
    node_db = {r.node: r.sqnr_db for r in report.rows}
    refused = {}
    for label, options in ((f"INT8, {worst} worst in 16-bit", {"int16": chosen}),
                           (f"INT8, {worst} worst in float", {"exclude": chosen})):
        out = workdir / f"{name}_{'int16' if 'int16' in options else 'float'}.onnx"
        try:
            results[label] = quantize_onnx_file(task.float_path, out, calibration, target=target, run_check=False,
                                                **options)
        except QuantshipError as exc:  # the setting gives no file: its reason is the row
            refused[label] = one_line(exc)
            continue
        paths[label] = out
    latency = timed(paths, task.eval_x, reps)
    single = timed(paths, task.eval_x, reps, threads=1)
    lines = [f"## {task.title}", "", f"Data: {task.data}. Preset `{target}`; {len(task.calib)} calibration samples; "
             f"the {worst} worst nodes of the SQNR report of the plain file: "
             + ", ".join(f"`{n}` ({node_db[n]:.1f} dB)" for n in chosen) + f"; output SQNR {report.output_sqnr_db:.1f} dB.",
             "", f"| file | {' | '.join(task.metrics)} | output SQNR vs FP32, dB | ORT ms b1 | vs FP32 | "
             "ORT ms b1, 1 thread | vs FP32 | 16-bit tensors | ORT integer / float kernels |",
             "|---|" + "---|" * len(task.metrics) + "---:|---:|---:|---:|---:|---|---|"]
    for label, path in paths.items():
        outputs = real.run_ort(path, task.eval_x, real.static_batch(path) or task.eval_batch)
        scores = task.score(outputs, None if label == "FP32" else reference)
        noise = float(np.square(outputs.astype(np.float64) - reference).sum())
        sqnr = "-" if label == "FP32" else f"{sqnr_db(float(np.square(reference.astype(np.float64)).sum()), noise):.1f}"
        cells = " | ".join(real._pct(scores[m].k, scores[m].n) if m in scores else "reference" for m in task.metrics)
        done = results.get(label)
        wide = ", ".join(done.int16) if done is not None and done.int16 else "-"
        kernels = f"{done.census['n_integer']} / {done.census['n_float']}" if done is not None else "-"
        lines.append(f"| {label} | {cells} | {sqnr} | {latency[label]:.3g} | {latency['FP32'] / latency[label]:.2f}x | "
                     f"{single[label]:.3g} | {single['FP32'] / single[label]:.2f}x | {wide} | {kernels} |")
        print(f"   {name} {label}: {cells}, {latency[label]:.3g} ms", file=sys.stderr, flush=True)
    for label, why in refused.items():
        lines.append(f"| {label} | no file: {why} |" + " |" * (len(task.metrics) + 7))
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(real.MODELS)}")
    parser.add_argument("--target", default="onnxruntime-cpu", help="the preset every file is made for")
    parser.add_argument("--worst", type=int, default=3, help="how many of the SQNR report's worst nodes")
    parser.add_argument("--reps", type=int, default=50, help="timed runs per file at batch 1")
    args = _smoke.parse_args(parser, argv, models="ocr_cls", reps=2)
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in real.MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {list(real.MODELS)}")
    if args.smoke:
        os.environ.setdefault("QUANTSHIP_CACHE", tempfile.mkdtemp(prefix="quantship-int16-smoke-"))
    lines = [*_smoke.banner(args), *_smoke.cpu_lines("16-bit activations against float for the most sensitive nodes")]
    with tempfile.TemporaryDirectory(prefix="quantship-int16-") as tmp:
        for name in chosen:
            lines += run_model(name, args.target, args.worst, args.reps, args.smoke, Path(tmp))
    lines.append(f"Load average {os.getloadavg()[0]:.1f} at the end.")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
