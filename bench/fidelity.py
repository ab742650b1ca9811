"""Fidelity to FP32 of the default file of every real model (bench/real.py's tasks), and what it costs: each
output's SQNR and agreement against the float file on samples of the evaluation set (held out from
calibration), the task metric of the same file beside it, and the quantize time with and without the fidelity
judgement and its repair, per preset, through the ONNX path (``quantize_onnx``, what ``quantize-onnx`` runs) and,
for the models that have PyTorch weights, the PyTorch path (``quantize_export_judged``, what ``quantize`` runs).

Per file, interleaved in one run (A B B A ... so a drift of the machine's load falls on both): the quantize call
with fidelity off (``--no-fidelity``: no held-out data, no budget), the default call (held-out samples, the default
budget, the repair when it runs), and, where the repair ran, the same call with a budget every file keeps (fidelity
measured and judged, nothing repaired), which splits the default call's time into the measurement and the
repair. Each time is the median over the repeats of wall seconds and of CPU seconds (this process and its
children: what the call itself used, whatever else runs on the machine).

    python bench/fidelity.py                                  # every model, onnxruntime-cpu and tigris, both paths
    python bench/fidelity.py --models ocr_cls --targets onnxruntime-cpu --paths onnx --repeats 1
    python bench/fidelity.py --models ocr_det --paths onnx --held calib   # judged on quantize-onnx's own held-out split
    python bench/fidelity.py --record                         # ... and rewrite bench/fidelity_results.md's tables
    python bench/fidelity.py --smoke                          # tiny sizes, one repeat
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import _smoke
import numpy as np
from real import MODELS, batched, make_task, run_ort, static_batch

from quantship import Budget, QuantshipError, one_line

HELD = 64  # evaluation samples fidelity is measured on
RECORD = Path(__file__).resolve().parent / "fidelity_results.md"
KEEPS_ANY = Budget(0.0, 0.0)  # a budget every real file keeps: fidelity measured and judged, never repaired
DEFAULT_BUDGET = Budget()  # the default call's (--min-sqnr)
HELD_FROM_CALIB = False  # --held calib: the ONNX path holds out of the calibration set as quantize-onnx does
FIDELITY_HEAD = ("| model | path | target | output SQNR (dB, worst part) | each part: SQNR, agreement of decisions "
                 "(rule) | default budget (margin) | task metric |")
COST_HEAD = ("| model | path | target | quantize s, --no-fidelity (wall / CPU) | default (wall / CPU) | "
             "default / --no-fidelity (CPU) | measured, not repaired (CPU s) | measurement / --no-fidelity (CPU) | "
             "repair steps (s each) | repair s (CPU) |")


@dataclass
class Timing:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, wall: float, cpu: float) -> None:
        self.wall.append(wall)
        self.cpu.append(cpu)

    @property
    def median_cpu(self) -> float:
        return statistics.median(self.cpu)

    def cell(self) -> str:
        return f"{statistics.median(self.wall):.1f} / {self.median_cpu:.1f}"


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(call):
    """``call()``'s result (or the QuantshipError it raised), its wall and CPU seconds."""
    wall, cpu = time.perf_counter(), _cpu()
    try:
        result = call()
    except QuantshipError as exc:
        result = exc
    return result, time.perf_counter() - wall, _cpu() - cpu


def onnx_call(task, target: str, out: Path, mode: str):
    """The ONNX path's quantize call in one mode: ``off`` (--no-fidelity), ``default``, ``measured``."""
    from quantship.quantize_onnx import quantize_onnx

    calibration = batched(task.calib, task.calib_batch)
    held = task.eval_x[:min(HELD, len(task.eval_x))]
    if HELD_FROM_CALIB and mode != "off":  # as quantize-onnx holds out of --calib (export.data.split_held_out)
        from quantship.export import split_held_out

        kept, held_out, _ = split_held_out({"x": task.calib}, len(task.calib))
        if held_out is not None:
            calibration, held = batched(kept["x"], task.calib_batch), held_out["x"]
    if mode == "off":
        return lambda: quantize_onnx(task.float_path, out, calibration, target=target, budget=None)
    budget = DEFAULT_BUDGET if mode == "default" else KEEPS_ANY
    return lambda: quantize_onnx(task.float_path, out, calibration, target=target, budget=budget, fidelity_data=held)


def torch_call(task, target: str, out: Path, mode: str):
    """The PyTorch path's call, as ``quantship quantize`` makes it (``export.judged``), in one mode."""
    import torch

    from quantship import Quantizer, targets
    from quantship.export import quantize_export_judged

    model = task.torch_model().eval()
    batches = [torch.from_numpy(b) for b in batched(task.calib, task.calib_batch)]
    held = [torch.from_numpy(b) for b in batched(task.eval_x[:min(HELD, len(task.eval_x))], task.calib_batch)]
    budget = {"off": None, "default": DEFAULT_BUDGET, "measured": KEEPS_ANY}[mode]
    return lambda: quantize_export_judged(
        model, batches, torch.from_numpy(task.calib[:1]), out, target=targets.get(target), overrides={},
        held=None if mode == "off" else held, held_label=f"{len(task.eval_x[:HELD])} evaluation sample(s)",
        budget=budget, make_quantizer=lambda t, **kw: Quantizer.for_target(t, **kw),
        quantize_kwargs={"max_calibration_samples": len(task.calib)})


def fidelity_and_repair(result) -> tuple:
    """(Fidelity, Repair or None) of either path's result."""
    if isinstance(result, tuple):  # quantize_onnx: (OnnxQuantizeResult, Repair | None)
        return result[0].fp32, result[1]
    return result.fidelity, result.repair


def repair_cells(repair) -> tuple[str, float]:
    """The repair's steps after step 0, each with its seconds and the chosen one marked; their wall seconds."""
    if repair is None or len(repair.steps) < 2:
        return "none (step 0 met)", 0.0
    steps = [f"{s.what} ({s.seconds:.0f}){' **chosen**' if k == repair.chosen else ''}"
             for k, s in enumerate(repair.steps) if k]
    return "; ".join(steps), sum(s.seconds for s in repair.steps[1:])


def parts(fp32) -> str:
    return ", ".join(f"{o.name}: {o.sqnr_db:.1f} dB" + (
        f", {o.agreement:.3f} of {o.n_decisions} ({o.rule})" if o.agreement is not None else f" ({o.rule})")
        for o in fp32.outputs)


def measure_file(task, path_kind: str, target: str, work: Path, reference: np.ndarray, repeats: int,
                 cap: float) -> tuple[list[str], list[str]]:
    """One file's fidelity row and cost row (module docstring)."""
    make = onnx_call if path_kind == "onnx" else torch_call
    out = {mode: work / f"{task.model}_{path_kind}_{target}_{mode}.onnx" for mode in ("off", "default", "measured")}
    times = {"off": Timing(), "default": Timing(), "measured": Timing()}
    modes, last, repaired = ["off", "default"], {}, False
    for rep in range(repeats):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            result, wall, cpu = timed(make(task, target, out[mode], mode))
            if isinstance(result, QuantshipError):
                reason = f"not produced ({mode}): {one_line(result)[:160]}"
                row = [task.model, path_kind, target]
                return [*row, reason, "", "", ""], [*row, reason, "", "", "", "", "", ""]
            times[mode].add(wall, cpu)
            last[mode] = result
            print(f"{task.model} {path_kind} {target} {mode}: {wall:.1f} s wall, {cpu:.1f} s CPU",
                  file=sys.stderr, flush=True)
        if rep == 0 and fidelity_and_repair(last["default"])[1] is not None \
                and len(fidelity_and_repair(last["default"])[1].steps) > 1:
            repaired = True  # the repair ran: the measurement alone is timed too, from here on
            modes.append("measured")
            result, wall, cpu = timed(make(task, target, out["measured"], "measured"))
            times["measured"].add(wall, cpu)
        if sum(times["off"].wall) + sum(times["default"].wall) > cap:
            break  # a slow file: fewer repeats (the table says how many ran)
    fp32, repair = fidelity_and_repair(last["default"])
    outputs = run_ort(out["default"], task.eval_x, static_batch(out["default"]) or task.eval_batch)
    metric = task.metrics[0]
    score, base = task.score(outputs, reference)[metric], task.score(reference, None)[metric]
    judged = fp32.__class__(fp32.outputs, fp32.data, fp32.runtime, Budget(), fp32.n_samples)
    row = [task.model, path_kind, target]
    fidelity = [*row, f"{fp32.sqnr_db:.1f}", parts(fp32), f"{judged.status} ({judged.margin:+.1f})",
                f"{metric} FP32 {base} / INT8 {score}"]
    steps, _ = repair_cells(repair)
    off, default = times["off"].median_cpu, times["default"].median_cpu
    measured = times["measured"].median_cpu if repaired else default
    cost = [*row, times["off"].cell(), times["default"].cell(), f"{default / off:.2f}",
            f"{measured:.1f}" if repaired else "= default", f"{measured / off:.2f}", steps,
            f"{max(0.0, default - measured):.1f}" if repaired else "0"]
    n = len(times["off"].cpu)
    cost[3] += f" (x{n})"
    return fidelity, cost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--targets", default="onnxruntime-cpu,tigris")
    parser.add_argument("--paths", default="onnx,pytorch",
                        help="onnx (quantize_onnx), pytorch (the models with PyTorch weights: Quantizer + export_qdq)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the interleaved calls per file")
    parser.add_argument("--cap", type=float, default=300.0,
                        help="no further round once a file's timed calls have taken this many wall seconds")
    parser.add_argument("--min-sqnr", type=float, default=Budget().min_sqnr_db,
                        help="the default call's budget in dB (the library's default unless given: a higher one "
                             "makes the repair run, e.g. in the smoke run)")
    parser.add_argument("--held", choices=("eval", "calib"), default="eval",
                        help="what fidelity is judged on: eval (the first 64 evaluation samples, beside calibration) "
                             "or calib (ONNX path: held out of the calibration set as quantize-onnx does, the last "
                             "fifth, at most 64)")
    parser.add_argument("--record", action="store_true",
                        help="rewrite bench/fidelity_results.md's tables (REAL.md's fidelity section) with this run's")
    args = _smoke.parse_args(parser, argv, models="mtcnn_pnet", targets="onnxruntime-cpu", repeats=1)
    global DEFAULT_BUDGET, HELD_FROM_CALIB
    DEFAULT_BUDGET, HELD_FROM_CALIB = Budget(args.min_sqnr), args.held == "calib"
    print("\n".join(_smoke.cpu_lines("Fidelity to FP32 and its cost")), flush=True)
    print("Judged on: " + ("the ONNX path's held-out set taken out of the calibration set as quantize-onnx does (the "
                           "last fifth, at most 64; the PyTorch path: 64 evaluation samples)" if HELD_FROM_CALIB else
                           f"the first {HELD} evaluation samples (none calibrated on)") + "\n", flush=True)
    fidelity_rows, cost_rows = [], []
    with tempfile.TemporaryDirectory(prefix="quantship-fidelity-") as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            task = make_task(name, args.smoke, work)
            reference = run_ort(task.float_path, task.eval_x, task.eval_batch)
            for path_kind in args.paths.split(","):
                if path_kind == "pytorch" and not name.startswith("mtcnn_"):
                    continue  # only MTCNN's weights are PyTorch's own (the others are onnx2torch conversions)
                for target in args.targets.split(","):
                    fidelity, cost = measure_file(task, path_kind, target, work, reference, args.repeats, args.cap)
                    fidelity_rows.append(fidelity)
                    cost_rows.append(cost)
                    print("| " + " | ".join(fidelity) + " |\n| " + " | ".join(cost) + " |", file=sys.stderr, flush=True)
    tables = ["| " + " | ".join(row) + " |" for row in fidelity_rows]
    fidelity_table = [FIDELITY_HEAD, "|---|---|---|---:|---|---|---|", *tables]
    cost_table = [COST_HEAD, "|---|---|---|---:|---:|---:|---:|---:|---|---:|",
                  *("| " + " | ".join(row) + " |" for row in cost_rows)]
    print("\n".join([*fidelity_table, "", *cost_table]))
    print(f"Load average at the end: {os.getloadavg()[0]:.1f}")
    if not args.smoke and args.record:  # REAL.md's section (bench/_real_render.py includes the record)
        RECORD.write_text(recorded(RECORD.read_text() if RECORD.is_file() else "## Fidelity to FP32\n",
                                   {FIDELITY_HEAD: fidelity_table, COST_HEAD: cost_table}))
    return 0


def recorded(text: str, tables: dict[str, list[str]]) -> str:
    """``text`` (paragraphs apart by blank lines) with each table's rows merged in: a row of this run replaces
    the recorded row of the same model, path and target (its first three cells), the other recorded rows stay
    (a run of some models updates theirs only); a table the text lacks is added at the end. The prose around
    them is the reader's, kept as written."""
    blocks = text.strip("\n").split("\n\n")
    for head, table in tables.items():
        at = next((k for k, block in enumerate(blocks) if block.startswith(head)), None)
        if at is None:
            blocks.append("\n".join(table))
            continue
        old_rows = blocks[at].split("\n")[2:]
        new_rows = table[2:]
        fresh = {_row_key(r): r for r in new_rows}
        merged = [fresh.pop(_row_key(r), r) for r in old_rows]
        blocks[at] = "\n".join([*table[:2], *merged, *fresh.values()])
    return "\n\n".join(blocks) + "\n"


def _row_key(row: str) -> tuple[str, ...]:
    return tuple(cell.strip() for cell in row.strip().strip("|").split("|")[:3])


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
