"""Why an INT8 file runs slower than FP32 at batch 1 in ONNX Runtime: the census of the graph ORT runs
(``SessionOptions.optimized_model_filepath``), its profile by operator type (``enable_profiling``), and the
FP32 / INT8 latency ratio, interleaved in one process (median of many runs; the machine may be shared, so
only ratios are printed).

    python bench/batch1_profile.py [--runs 200]   # the PP-OCR orientation classifier, onnxruntime-cpu preset
    python bench/batch1_profile.py --smoke        # two runs, 16 calibration lines: the table, not its figures
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path

import _smoke
import numpy as np
import onnx
import onnxruntime as ort

from quantship.examples.real import ocr_cls
from quantship.quantize_onnx import quantize_onnx_file

MOVERS = ("QuantizeLinear", "DequantizeLinear", "Transpose", "Reorder", "ReorderInput", "ReorderOutput")


def session(path: Path, profile: str | None = None, optimized: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = profile
    if optimized:
        options.optimized_model_filepath = optimized
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def census(path: Path, tmp: Path) -> collections.Counter:
    saved = tmp / f"{path.stem}_optimized.onnx"
    session(path, optimized=str(saved))
    return collections.Counter(n.op_type for n in onnx.load(str(saved)).graph.node)


def profile_by_op(path: Path, x: np.ndarray, tmp: Path, runs: int) -> dict[str, float]:
    """Mean microseconds per run spent in each operator type (ORT's node events)."""
    s = session(path, profile=str(tmp / path.stem))
    name = s.get_inputs()[0].name
    for _ in range(runs):
        s.run(None, {name: x})
    trace = json.loads(Path(s.end_profiling()).read_text())
    spent: collections.Counter = collections.Counter()
    for event in trace:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            spent[event["args"]["op_name"]] += event["dur"]
    return {op: us / runs for op, us in spent.most_common()}


def interleaved(paths: list[Path], x: np.ndarray, runs: int) -> list[float]:
    """Median ms of each file, runs alternating between them."""
    sessions = [session(p) for p in paths]
    name = sessions[0].get_inputs()[0].name
    for s in sessions:
        for _ in range(10):
            s.run(None, {name: x})
    times: list[list[float]] = [[] for _ in paths]
    for _ in range(runs):
        for k, s in enumerate(sessions):
            t = time.perf_counter()
            s.run(None, {name: x})
            times[k].append(time.perf_counter() - t)
    return [float(np.median(t)) * 1e3 for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--calibration", type=int, default=64, help="calibration lines")
    args = _smoke.parse_args(parser, runs=2, calibration=16)
    calib = ocr_cls.make_lines(args.calibration, seed=1).x
    x = ocr_cls.make_lines(1, seed=0).x[:1]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fp32 = ocr_cls.model_path()
        int8 = tmp / "ocr_cls_int8.onnx"
        quantize_onnx_file(fp32, int8, [calib[i:i + 16] for i in range(0, len(calib), 16)],
                           target="onnxruntime-cpu", run_check=False)
        print(f"load: 1-min load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; batch 1")
        for path in (fp32, int8):
            ops = census(path, tmp)
            print(f"\n{path.name}: graph ORT runs: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())))
            spent = profile_by_op(path, x, tmp, args.runs)
            total = sum(spent.values())
            print("| op type | us per run | share |\n|---|---|---|")
            for op, us in spent.items():
                print(f"| {op}{' (data movement)' if op in MOVERS else ''} | {us:.1f} | {us / total:.0%} |")
        a, b = interleaved([fp32, int8], x, args.runs)
        print(f"\ninterleaved, median of {args.runs}: FP32 / INT8 = {a / b:.2f}x (above 1: INT8 faster)")


if __name__ == "__main__":
    main()
