"""The accuracy-aware search on the harder digits task, and what its exclusions cost in ONNX Runtime.

For each case (an observer and a top-1 budget in points), the search (``Quantizer.for_target(
'onnxruntime-cpu', max_accuracy_drop=...)``) runs on the 360 held-out noisy images; the model it
chooses and the same recipe with nothing kept in float are both exported for onnxruntime-cpu. The
table gives, per case: FP32 and INT8 top-1, the layers kept in float, quantizations tried, the
float compute ops in the file, what ORT fuses (QLinearConv / float Conv in its optimized graph),
the top-1 of each file in ORT, and the latency of both files at their default ORT optimizations,
timed in this one process, interleaved round by round (``bench/latency.py``'s loop), median ms.

    python bench/accuracy_budget.py [--runs 200] [--batches 1 40]
    python bench/accuracy_budget.py --smoke   # one case (minmax, 0 points), batch 1, one run (bench/_smoke.py)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))

BS = 40  # calibration and evaluation batch (the tests' choice)
CASES = (("histogram", 0.5), ("histogram", 0.0), ("minmax", 0.5), ("minmax", 0.0))


@dataclass
class Case:
    observer: str
    budget: float
    fp32: str
    int8_plain: str  # top-1 in torch with nothing kept float (the search's step 0)
    int8: str
    kept_float: tuple[str, ...]
    n_quantizations: int
    met: bool
    n_float_compute: tuple[int, int]  # (with the exclusions, without)
    fused: tuple[str, str]
    ort_top1: tuple[str, str]
    latency_ms: dict[int, tuple[float, float]]  # batch -> (with, without) median ms
    seconds: float


def _ort_top1(path: Path, x: np.ndarray, y: np.ndarray) -> str:
    from quantship.inspect import ort_session

    session = ort_session(path, optimized=True)
    name = session.get_inputs()[0].name
    pred = np.concatenate([session.run(None, {name: x[i:i + BS]})[0].argmax(-1) for i in range(0, len(y), BS)])
    return f"{int((pred == y).sum())}/{len(y)}"


def _fused(path: Path) -> str:
    from quantship.inspect import ort_optimized_ops

    ops = ort_optimized_ops(path)
    return f"{ops.get('QLinearConv', 0)} QLinearConv, {ops.get('Conv', 0) + ops.get('FusedConv', 0)} float Conv"


def run_case(observer: str, budget: float, batches: list[int], runs: int, workdir: Path) -> Case:
    from latency import _time

    from quantship import BudgetMissed, Quantizer, quant_spec
    from quantship.examples import digits
    from quantship.export import export_qdq
    from quantship.inspect import qdq_stats

    split = digits.load_noisy_split()
    model = digits.noisy_trained_model()
    calib = [split.x_train[i:i + BS] for i in range(0, 3 * BS, BS)]
    labelled = [(split.x_test[i:i + BS], split.y_test[i:i + BS]) for i in range(0, len(split.y_test), BS)]
    start = time.perf_counter()
    searcher = Quantizer.for_target("onnxruntime-cpu", act_observer=observer, max_accuracy_drop=budget)
    try:
        chosen = searcher.quantize(model, calib, labelled_data=labelled)
        search = searcher.accuracy_search
    except BudgetMissed as missed:  # the row shows the best set found, quantized again
        search = missed.search
        chosen = Quantizer.for_target("onnxruntime-cpu", act_observer=observer,
                                      skip_activations=list(search.chosen.excluded) or None).quantize(model, calib)
    plain = Quantizer.for_target("onnxruntime-cpu", act_observer=observer).quantize(model, calib)
    seconds = time.perf_counter() - start
    files = {}
    for name, qmodel in (("with", chosen), ("without", plain)):
        files[name] = export_qdq(qmodel, split.x_test[:BS], workdir / f"{observer}_{budget}_{name}.onnx",
                                 target="onnxruntime-cpu")
    x, y = split.x_test.numpy(), split.y_test.numpy()
    latency = {}
    for batch in batches:
        times = _time(files, batch, runs, warmup=10, feed=x[:batch])
        latency[batch] = (statistics.median(times["with"]), statistics.median(times["without"]))
    step = search.chosen
    assert set(step.excluded) == set(quant_spec(chosen).skip_activations or ())  # the file is the row's model
    return Case(
        observer, budget, f"{search.fp32_correct}/{search.n}", f"{search.steps[0].correct}/{search.n}",
        f"{step.correct}/{step.n}",
        tuple(quant_spec(chosen).skip_activations or ()), len(search.steps), search.met,
        (qdq_stats(files["with"]).n_float_compute, qdq_stats(files["without"]).n_float_compute),
        (_fused(files["with"]), _fused(files["without"])),
        (_ort_top1(files["with"], x, y), _ort_top1(files["without"], x, y)), latency, seconds)


def table(cases: list[Case], batches: list[int]) -> str:
    head = ("| observer | budget (points) | FP32 top-1 | INT8 top-1, nothing float / chosen (torch) | kept in float | quantizations | met | "
            "float compute ops in file | ORT fuses (with / without) | ORT top-1 (with / without) | "
            + " | ".join(f"ORT ms batch {b} (with / without, cost)" for b in batches) + " |")
    lines = [head, "|" + "---|" * (10 + len(batches))]
    for c in cases:
        cost = " | ".join(f"{w:.3f} / {wo:.3f} ({100 * (w / wo - 1):+.1f}%)" for w, wo in
                          (c.latency_ms[b] for b in batches))
        lines.append(f"| {c.observer} | {c.budget:g} | {c.fp32} | {c.int8_plain} / {c.int8} | {', '.join(c.kept_float) or '(none)'} | "
                     f"{c.n_quantizations} | {'yes' if c.met else 'no'} | {c.n_float_compute[0]} / "
                     f"{c.n_float_compute[1]} | {c.fused[0]} / {c.fused[1]} | {c.ort_top1[0]} / {c.ort_top1[1]} | "
                     f"{cost} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import _smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="timed runs per file and batch")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, BS])
    parser.add_argument("--cases", nargs="+", default=[f"{o}:{b:g}" for o, b in CASES],
                        help="observer:budget pairs (default: histogram and minmax at 0.5 and 0)")
    args = _smoke.parse_args(parser, argv, runs=1, batches=[1], cases=["minmax:0"])
    torch.set_num_threads(1)  # the quantization is deterministic whatever the core count
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.cases:
            observer, budget = spec.split(":")
            cases.append(run_case(observer, float(budget), args.batches, args.runs, Path(tmp)))
            print(f"{spec}: done in {cases[-1].seconds:.0f} s", file=sys.stderr, flush=True)
    print(table(cases, args.batches))


if __name__ == "__main__":
    main()
