"""Fidelity to FP32 of the default file of every real model (bench/real.py's tasks), to choose and check
``quantship.fidelity``'s default budget: each output's SQNR and agreement against the float file, on
samples of the evaluation set (held out from calibration), in ONNX Runtime at default optimizations, per
preset; and the task metric of the same file beside it, so the reader sees how well the label-free
figure predicts the task.

    python bench/fidelity.py                                  # every model, onnxruntime-cpu
    python bench/fidelity.py --models ocr_cls --targets onnxruntime-cpu,tigris
    python bench/fidelity.py --smoke                          # tiny sizes, into a temp dir
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import _smoke
import numpy as np
from real import MODELS, make_task, run_ort, static_batch

from quantship.fidelity import Budget, Fidelity
from quantship.quantize_onnx import quantize_onnx

HELD = 64  # evaluation samples fidelity is measured on
RECORD = Path(__file__).resolve().parent / "fidelity_results.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--targets", default="onnxruntime-cpu")
    parser.add_argument("--record", action="store_true",
                        help="rewrite bench/fidelity_results.md's table (REAL.md's fidelity section) with this run's")
    args = _smoke.parse_args(parser, argv, models="mtcnn_pnet")
    rows = []
    with tempfile.TemporaryDirectory(prefix="quantship-fidelity-") as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            task = make_task(name, args.smoke, work)
            held = task.eval_x[:min(HELD, len(task.eval_x))]
            reference = run_ort(task.float_path, task.eval_x, task.eval_batch)
            for target in args.targets.split(","):
                out = work / f"{name}_{target}.onnx"
                started = time.perf_counter()
                try:
                    result, _ = quantize_onnx(task.float_path, out, [task.calib[i:i + task.calib_batch] for i in
                                                                     range(0, len(task.calib), task.calib_batch)],
                                              target=target, budget=None, fidelity_data=held)
                except Exception as exc:  # a row that cannot be produced keeps its reason
                    rows.append((name, target, f"not produced: {str(exc).splitlines()[0][:120]}", "", "", "", ""))
                    continue
                seconds = time.perf_counter() - started
                fp32 = result.fp32
                outputs = run_ort(out, task.eval_x, static_batch(out) or task.eval_batch)
                metric = task.metrics[0]
                score = task.score(outputs, reference)[metric]
                base = task.score(reference, None)[metric]
                parts = ", ".join(f"{o.name}: {o.sqnr_db:.1f} dB" + (f", {o.agreement:.3f} of {o.n_decisions} "
                                                                    f"({o.rule})" if o.agreement is not None else
                                                                    f" ({o.rule})") for o in fp32.outputs)
                judged = Fidelity(fp32.outputs, fp32.data, fp32.runtime, Budget(), fp32.n_samples)
                rows.append((name, target, f"{fp32.sqnr_db:.1f}", parts, f"{judged.status} ({judged.margin:+.1f})",
                             f"{metric} FP32 {base} / INT8 {score}", f"{seconds:.1f}"))
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    table = ["| model | target | output SQNR (dB, worst part) | each part: SQNR, agreement of decisions (rule) | "
             "default budget (margin) | task metric | quantize s |",
             "|---|---|---:|---|---|---|---:|", *("| " + " | ".join(row) + " |" for row in rows)]
    print("\n".join(table))
    if not args.smoke and args.record:  # REAL.md's section (bench/_real_render.py includes the record)
        head = RECORD.read_text().split("| model |")[0] if RECORD.is_file() else "## Fidelity to FP32\n\n"
        RECORD.write_text(head + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
