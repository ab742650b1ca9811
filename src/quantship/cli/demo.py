"""``quantship demo``: the main job, end to end, on the built-in reference task.

A small residual CNN trained on scikit-learn's digits (cached after the first run) is quantized
with a deployment preset, exported to QDQ ONNX, and every figure in the table is measured on the
artifacts: accuracy with Wilson intervals, sizes, Q/DQ counts, error in output LSB, ORT latency,
and each target's verdict on the file.
"""

from __future__ import annotations

import argparse

from quantship import targets
from quantship.cli import common
from quantship.cli.check import exit_code

BATCH = 40  # divides the 360 held-out images; the graph is captured at this batch size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_target_argument(parser, default="onnxruntime-cpu", help="deployment preset")
    parser.add_argument("--out-dir", default="quantship-demo", help="where the FP32 and INT8 files are written")
    parser.add_argument("--runs", type=int, default=20, help="interleaved timed runs per file")
    common.add_output_arguments(parser)


def _ort_accuracy(path, x, y) -> tuple[int, int]:
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    import numpy as np

    from quantship.inspect.run.consumers import ort_session

    session = ort_session(path, optimized=True)
    name = session.get_inputs()[0].name
    correct = 0
    for start in range(0, len(y), BATCH):
        logits = session.run(None, {name: x[start:start + BATCH].numpy()})[0]
        correct += int((np.argmax(logits, axis=1) == y[start:start + BATCH].numpy()).sum())
    return correct, len(y)


def _latency_ratio(fp32_path, int8_path, x, runs: int) -> tuple[float, float, float]:
    """Median ms of each file and FP32/INT8, interleaved in one process after a warm-up."""
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    import statistics
    import time

    from quantship.inspect.run.consumers import ort_session

    sessions = [ort_session(p, optimized=True) for p in (fp32_path, int8_path)]
    feeds = [{s.get_inputs()[0].name: x} for s in sessions]
    for s, f in zip(sessions, feeds):
        s.run(None, f)
        s.run(None, f)
    times: list[list[float]] = [[], []]
    for _ in range(runs):
        for i, (s, f) in enumerate(zip(sessions, feeds)):
            t0 = time.perf_counter()
            s.run(None, f)
            times[i].append((time.perf_counter() - t0) * 1000)
    fp32_ms, int8_ms = statistics.median(times[0]), statistics.median(times[1])
    return fp32_ms, int8_ms, fp32_ms / int8_ms


def run(args: argparse.Namespace) -> int:
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    import time
    import warnings
    from pathlib import Path

    from quantship import Quantizer, quant_spec
    from quantship.cli.common import format_accuracy
    from quantship.examples import digits
    from quantship.export import export_onnx, export_qdq
    from quantship.export.judged import judge_file
    from quantship.fidelity import Budget
    from quantship.inspect.judge.check import check_file
    from quantship.inspect.read.loading import file_size
    from quantship.inspect.read.stats import qdq_stats
    from quantship.inspect.run.verify import compare_logits, verify_qdq

    started = time.perf_counter()
    ui = common.Output(args)
    target = targets.get(args.target)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    ui.say("reference task: scikit-learn digits (1,797 8x8 images, upsampled to 32x32), 360 held out")
    model = digits.trained_model()
    split = digits.load_split()
    calibration = [split.x_train[i:i + BATCH] for i in range(0, 200, BATCH)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = Quantizer.for_target(target, verbose=ui.verbose).quantize(
            model, calibration, max_calibration_samples=200)
        fp32_path = export_onnx(model, split.x_test[:BATCH], out_dir / "digits_fp32.onnx", dynamic_batch=False)
        # the demo feeds batches of BATCH: a preset's static file (tigris) is written at that batch here
        int8_path = export_qdq(qmodel, split.x_test[:BATCH], out_dir / f"digits_int8_{target.target}.onnx",
                               target=target, dynamic_batch=None if target.dynamic_batch else False)
        agreement = verify_qdq(qmodel, int8_path, split.x_test, n_batches=len(split.y_test) // BATCH)
        error = compare_logits(qmodel, int8_path, split.x_test, n_batches=len(split.y_test) // BATCH)

    # the file held to the float model on the 360 held-out images (none calibrated on), as quantize does
    fidelity = judge_file(int8_path, model, [split.x_test], target, Budget(), "held-out test image(s)")
    fp32_acc = digits.evaluate(model, split.x_test, split.y_test)
    int8_acc = digits.evaluate(qmodel, split.x_test, split.y_test, batch_size=BATCH)
    file_acc = _ort_accuracy(int8_path, split.x_test, split.y_test)
    fp32_size, int8_size = file_size(fp32_path), file_size(int8_path)
    stats = qdq_stats(int8_path)
    fp32_ms, int8_ms, speedup = _latency_ratio(fp32_path, int8_path, split.x_test[:BATCH].numpy(), args.runs)
    # every target's rules; the preset's own target is also run (where installed) on the held-out images,
    # the same code as `quantship check --run --inputs`, and the demo's exit code follows that verdict
    verdicts = {each.name: check_file(int8_path, each, run=each is target, inputs=split.x_test.numpy())
                for each in targets.ALL}
    elapsed = time.perf_counter() - started

    result = {
        "version": 1, "target": target.target, "spec": quant_spec(qmodel).as_dict(),
        "files": {"fp32": str(fp32_path), "int8": str(int8_path)},
        "accuracy": {"fp32_torch": fp32_acc, "int8_torch": int8_acc, "int8_onnxruntime": file_acc},
        "agreement_int8_file_vs_torch": agreement,
        "size_bytes": {"fp32": fp32_size, "int8": int8_size, "ratio": fp32_size / int8_size},
        "qdq_stats": stats.as_dict(), "logit_error_vs_torch": error.as_dict(),
        "latency_ms": {"batch": BATCH, "fp32": fp32_ms, "int8": int8_ms, "speedup": speedup, "runs": args.runs},
        "ort_readings": int8_path.readings.as_dict() if int8_path.readings else None,
        "checks": {t: {"ok": v.ok, "verdict": v.verdict, "errors": [f.rule for f in v.errors],
                       "runs": [r.as_dict() for r in v.runs]} for t, v in verdicts.items()},
        "fidelity_fp32": fidelity.as_dict(), "seconds": elapsed,
    }
    rows = [
        ("fidelity vs FP32", fidelity.describe()),
        ("precision", f"{quant_spec(qmodel).label}, {target.target} preset ({target.activation_dtype} activations)"),
        ("FP32 accuracy (torch)", format_accuracy(*fp32_acc)),
        ("INT8 accuracy (torch)", format_accuracy(*int8_acc)),
        ("INT8 accuracy (file, ORT)", format_accuracy(*file_acc)),
        ("file vs torch INT8", f"{agreement:.3f} argmax agreement; {error}"),
        ("ORT literal / fused", str(agreement.readings)),
        ("size on disk", f"FP32 {fp32_size / 1e3:.1f} kB, INT8 {int8_size / 1e3:.1f} kB ({fp32_size / int8_size:.2f}x smaller)"),
        ("qdq_stats", ", ".join(f"{k} {v}" for k, v in stats.as_dict().items())),
        (f"ORT CPU latency, batch {BATCH}", f"FP32 {fp32_ms:.2f} ms, INT8 {int8_ms:.2f} ms ({speedup:.2f}x; "
                                            f"median of {args.runs} interleaved runs)"),
    ]
    for t, v in verdicts.items():
        rows.append((f"check {t}{' --run' if v.runs else ''}", common.verdict_line(v)))
    rows.append(("wall time", f"{elapsed:.1f} s"))
    ui.report(result, rows, title=f"quantship demo: digits -> {int8_path.name}")

    return 1 if not fidelity.met else exit_code(verdicts[target.target])  # the file must still do the task
