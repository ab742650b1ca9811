"""YOLO head choices side by side: nudenet's YOLOv8n (`320n.onnx`) through quantize-onnx, one row per choice.

The head of a YOLOv8 detector joins two branches in one output Concat: the DFL box branch (a Softmax over 16
bins per side, a 1x1 Conv with fixed weights 0..15, the box decode arithmetic) and the class scores (a
Sigmoid). Each choice here is a real option of ``quantize_onnx_file`` / ``quantship quantize-onnx`` (an
``exclude``, ``int16`` or ``shared_scale`` set), never an edit of the written file:

- default: what ``--target onnxruntime-cpu`` writes;
- shared scale, output Concat: ``--shared-scale /model.22/Concat_25`` (boxes and scores in one int8 scale);
- shared scale, per-level Concats: the three Concats that join each level's box logits and class logits;
- DFL float: ``--exclude '/model.22/dfl/*'`` (the DFL Conv and its Softmax output stay float);
- head float: ``--exclude '/model.22/*'`` (everything after the neck's last Conv stays float);
- 16-bit DFL: ``--int16 /model.22/dfl/conv/Conv`` (the DFL Conv reads the Softmax in uint16).

Per row: FP32 detections reproduced in ONNX Runtime at its default optimizations (nudenet's own decoding,
score >= 0.2 and NMS; same class at IoU >= 0.5; Wilson 95% interval), the share of class-score elements that
are exactly 0 (FP32's own share beside it), FP32 / INT8 latency at batch 1 and 8 (one ORT thread each,
interleaved, median), and what ONNX Runtime's optimized graph still runs in float. The task is
bench/real.py's ``_nudenet``: 200 crops (seed 0), 32 calibration crops (seed 1).

    python bench/yolo_head.py                 # ZOO-yolo.md
    python bench/yolo_head.py --smoke         # 8 crops, 4 calibration crops, minmax, one repetition, the
                                              # default and the shared output Concat rows only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

HEAD = "/model.22"
LEVEL_CONCATS = ("/model.22/Concat", "/model.22/Concat_1", "/model.22/Concat_2")  # box logits + class logits
OUTPUT_CONCAT = "/model.22/Concat_25"
N_BOX = 4  # output rows 0..3 are the box (cx, cy, w, h); the rest are class scores
INTEGER_KERNELS = ("QLinearConv", "QLinearMatMul", "QGemm", "MatMulIntegerToFloat", "ConvInteger")
QDQ = ("QuantizeLinear", "DequantizeLinear")
FLOAT_COMPUTE = ("Conv", "FusedConv", "MatMul", "FusedMatMul", "Gemm", "FusedGemm")


@dataclass(frozen=True)
class Choice:
    name: str
    option: str  # as a user types it
    kwargs: dict = field(default_factory=dict)


CHOICES = (
    Choice("default", "--target onnxruntime-cpu"),
    Choice("shared scale: output Concat", f"--shared-scale {OUTPUT_CONCAT}", {"shared_scale": [OUTPUT_CONCAT]}),
    Choice("shared scale: per-level box+class Concats", "--shared-scale " + ",".join(LEVEL_CONCATS),
           {"shared_scale": list(LEVEL_CONCATS)}),
    Choice("DFL float", f"--exclude '{HEAD}/dfl/*'", {"exclude": [f"{HEAD}/dfl/*"]}),
    Choice("head float", f"--exclude '{HEAD}/*'", {"exclude": [f"{HEAD}/*"]}),
    Choice("16-bit DFL", f"--int16 {HEAD}/dfl/conv/Conv", {"int16": [f"{HEAD}/dfl/conv/Conv"]}),
)


def session(path: Path, threads: int | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = options.inter_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run(path: Path, x: np.ndarray, batch: int = 8) -> np.ndarray:
    s = session(path)
    name = s.get_inputs()[0].name
    return np.concatenate([s.run(None, {name: x[i:i + batch]})[0] for i in range(0, len(x), batch)])


def latency(float_path: Path, int8_path: Path, x: np.ndarray, reps: tuple[int, int]) -> dict[str, tuple[float, float]]:
    """Median ms (FP32, INT8), one ORT thread each, interleaved, at batch 1 and 8."""
    import real  # bench/real.py: the interleaved timing REAL.md uses

    sessions = [session(float_path, threads=1), session(int8_path, threads=1)]
    result = {}
    for label, batch, n in (("b1", 1, reps[0]), ("b8", 8, reps[1])):
        result[label] = tuple(real.interleaved_ms(sessions, x[:batch], n))
    return result


def float_ops(path: Path) -> tuple[int, int, str]:
    """(float Conv/MatMul/Gemm kernels, ops of any kind neither integer kernel nor Q/DQ, the compute kernels
    listed) in ONNX Runtime's optimized graph."""
    from quantship.inspect import ort_optimized_ops

    ops = ort_optimized_ops(path)
    compute = sum(ops[k] for k in FLOAT_COMPUTE)
    other = sum(v for k, v in ops.items() if k not in INTEGER_KERNELS and k not in QDQ)
    return compute, other, ", ".join(f"{k} {ops[k]}" for k in FLOAT_COMPUTE if ops[k]) or "-"


def score_zeros(out: np.ndarray) -> float:
    return float((out[:, N_BOX:, :] == 0).mean())


@dataclass(frozen=True)
class Measured:
    choice: str
    k: int
    n: int
    interval: tuple[float, float]
    zeros: float
    ms: dict[str, tuple[float, float]]


def reading(rows: list[Measured]) -> list[str]:
    """Each choice against the first row (the default): detections, beyond noise or not (Wilson 95% intervals
    that do not overlap), and the INT8 / FP32 latency ratio of each (the interleaved pairs)."""
    if not rows:
        return []
    base = rows[0]
    lines = ["## Reading", "", f"Against `{base.choice}` ({base.k}/{base.n}); `beyond noise`: the two Wilson 95% "
             "intervals do not overlap. INT8 / FP32 latency: the ratio of the interleaved medians of each row.", ""]
    better = []
    for r in rows:
        apart = r.interval[0] > base.interval[1] or r.interval[1] < base.interval[0]
        ratio = ", ".join(f"{b} {r.ms[b][1] / r.ms[b][0]:.2f}x" for b in ("b1", "b8"))
        verdict = "-" if r is base else (f"{r.k - base.k:+d} detections, " + ("beyond noise" if apart else "within noise"))
        lines.append(f"- {r.choice}: {r.k}/{r.n} ({verdict}); class scores exactly 0: {100 * r.zeros:.2f}%; "
                     f"INT8 / FP32 latency {ratio}")
        if r is not base and apart and r.k > base.k:
            better.append(r.choice)
    lines += ["", f"Beyond noise and better than `{base.choice}` on detections: {', '.join(better)}." if better else
              f"No choice reproduces more FP32 detections than `{base.choice}` beyond noise."]
    return lines


def main(argv: list[str] | None = None) -> int:
    import _smoke

    from quantship.examples.real import nudenet_yolo
    from quantship.inspect import wilson_interval
    from quantship.quantize_onnx import quantize_onnx_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200, help="evaluation crops (seed 0)")
    parser.add_argument("--calib", type=int, default=32, help="calibration crops (seed 1)")
    parser.add_argument("--observer", default=None, help="activation observer (default: the preset's, histogram)")
    parser.add_argument("--reps", type=int, nargs=2, default=(20, 8), help="latency repetitions at batch 1 and 8")
    parser.add_argument("--choices", nargs="+", default=[c.name for c in CHOICES], metavar="NAME",
                        help="the rows to measure (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="default: ZOO-yolo.md")
    args = _smoke.parse_args(parser, argv, images=8, calib=4, observer="minmax", reps=(1, 1),
                             choices=[CHOICES[0].name, CHOICES[1].name])
    unknown = sorted(set(args.choices) - {c.name for c in CHOICES})
    if unknown:
        parser.error(f"--choices {unknown}: not a choice; the choices are {[c.name for c in CHOICES]}")
    args.out = _smoke.output(args, args.out, ROOT / "ZOO-yolo.md")
    float_path = nudenet_yolo.model_path()
    images = nudenet_yolo.make_images(args.images, seed=0)
    calib = nudenet_yolo.make_images(args.calib, seed=1).x
    batches = [calib[i:i + 4] for i in range(0, len(calib), 4)]
    reference = run(float_path, images.x)
    theirs = [nudenet_yolo.detect(reference[i:i + 1], images.meta[i]) for i in range(len(reference))]
    lines = [*_smoke.banner(args), *_smoke.cpu_lines("YOLO head choices: nudenet's YOLOv8n through quantize-onnx")]
    lines += [
        f"Generated by `python bench/yolo_head.py`. Task: bench/real.py's nudenet task, {args.images} crops (seed 0) "
        f"letterboxed by nudenet's `_read_image`, decoded by its `_postprocess` (score >= 0.2, NMS); an FP32 "
        f"detection is reproduced by one of the same class at IoU >= 0.5 (Wilson 95% interval). Calibration: "
        f"{args.calib} other crops (seed 1), observer {args.observer or 'histogram (the preset default)'}. Every "
        "file: `quantize_onnx_file(..., target='onnxruntime-cpu', run_check=False)` plus the option named (the "
        "post-conditions and the target's rules ran; `check --run` skipped for time). `scores = 0`: share of "
        "the class-score elements (output rows 4..21, every anchor) that are exactly 0, FP32 "
        f"{100 * score_zeros(reference):.2f}%. Latency: FP32 / INT8 ms, ONNX Runtime at its default "
        f"optimizations, one thread each, interleaved, median of {args.reps[0]} (batch 1) and {args.reps[1]} "
        "(batch 8), on a machine shared by 5 developers: indicative only. `float in ORT`: Conv/MatMul/Gemm "
        "kernels ONNX Runtime's optimized graph still runs in float / ops of any kind that are neither an "
        "integer kernel nor Q/DQ.", "",
        f"FP32 detections: {sum(map(len, theirs))} on {len(theirs)} crops.", "",
        "| choice | option | FP32 detections reproduced | scores = 0 | b1 ms FP32 / INT8 | b8 ms FP32 / INT8 | "
        "float in ORT | float kernels | plan | quantize s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows: list[str] = []
    measured: list[Measured] = []
    with tempfile.TemporaryDirectory() as tmp:
        for choice in (c for c in CHOICES if c.name in args.choices):
            path = Path(tmp) / f"{choice.name.replace(' ', '_').replace(':', '').replace('+', '_')}.onnx"
            start = time.perf_counter()
            result = quantize_onnx_file(float_path, path, batches, target="onnxruntime-cpu", observer=args.observer,
                                        run_check=False, **choice.kwargs)
            seconds = time.perf_counter() - start
            out = run(path, images.x)
            mine = [nudenet_yolo.detect(out[i:i + 1], images.meta[i]) for i in range(len(out))]
            reproduced, _ = nudenet_yolo.reproduced(theirs, mine)
            lo, hi = wilson_interval(reproduced.k, reproduced.n) if reproduced.n else (0.0, 0.0)
            ms = latency(float_path, path, images.x, tuple(args.reps))
            compute, other, kernels = float_ops(path)
            plan = result.plan
            planned = (f"{plan['n_tensors']} pairs, {plan['n_weighted']} Conv int8"
                       + (f", shared: {len(plan['shared_scale'])}" if plan.get("shared_scale") else "")
                       + (f", 16-bit: {len(result.int16)}" if result.int16 else "")
                       + (f", float by request: {len(result.excluded)}" if result.excluded else ""))
            row = (f"| {choice.name} | `{choice.option}` | {reproduced.k}/{reproduced.n} "
                   f"[{100 * lo:.1f}, {100 * hi:.1f}] | {100 * score_zeros(out):.2f}% | "
                   f"{ms['b1'][0]:.1f} / {ms['b1'][1]:.1f} | {ms['b8'][0]:.1f} / {ms['b8'][1]:.1f} | "
                   f"{compute} / {other} | {kernels} | {planned} | {seconds:.0f} |")
            print(row, flush=True)
            rows.append(row)
            measured.append(Measured(choice.name, reproduced.k, reproduced.n, (lo, hi), score_zeros(out), ms))
    lines += rows
    lines += ["", f"Load average at the end: {os.getloadavg()[0]:.1f} (2 cores).", "", *reading(measured)]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
