"""Placement on REAL.md's models: the plain placement, the default placement by profile, and the whole-file
speed search, each against FP32 on this CPU, with what each costs to quantize.

For each model (``bench/real.py``'s tasks: weights from installed packages, data generated here), three
``quantship quantize-onnx --target onnxruntime-cpu`` runs as a user runs them (a subprocess each):
``--plain-placement``, the default, and ``--speed-search`` (bounded by ``real.SPEED_MAX_STEPS`` on the
large models, as REAL.md's rows are). Quantize time: the subprocess's wall time and CPU time (user + sys,
every thread). Speed: FP32 and the three INT8 files in ONNX Runtime, one thread each, thread CPU time,
interleaved round after round, median (REAL.md's method, ``bench/_real_timing.steady_ms``), at batch 1 and
8 on the task's evaluation inputs. "profile / search": the profile file's speed-up over FP32 as a fraction
of the search's (geometric mean over the two batches); the issue's goal is >= 95% in <= 2x plain's time.

    python bench/placement.py                               # the default models into bench/placement_results.md
    python bench/placement.py --models ocr_cls,mtcnn_rnet   # only these
    python bench/placement.py --smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _smoke
import numpy as np
import real
from _real_timing import DEFAULT_ROUNDS, SMOKE_ROUNDS, session, steady_ms

PUBLISHED = Path(__file__).resolve().parent / "placement_results.md"
MODELS = ("ocr_cls", "nudenet", "mtcnn_pnet", "mtcnn_rnet", "mtcnn_onet", "ocr_det")
MODES = {"plain": ("--plain-placement",), "profile": (), "search": ("--speed-search",)}
BATCHES = (1, 8)


def quantize(task: real.Task, out: Path, mode: str, smoke: bool, steps: int | None = None) -> tuple[float, float, str]:
    """One ``quantize-onnx`` run: wall s, CPU s of the process, and its refusal or note. ``steps``: the speed
    search's bound (None: REAL.md's for the model)."""
    extra = MODES[mode]
    steps = steps if steps is not None else real.SPEED_MAX_STEPS.get(task.model)
    if mode == "search" and (steps or smoke):
        extra = (*extra, "--max-steps", str(1 if smoke else steps))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    try:
        note = real.quantship_cli(task, out, "onnxruntime-cpu", extra)
    except real.Refused as exc:
        note = str(exc)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return time.perf_counter() - started, cpu, note


def kept_float(path: Path, mode: str) -> str:
    """What the file records it kept float for speed (the profile's or the search's record)."""
    import onnx

    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    said = props.get("quantship.speed_search")
    if said is None:
        return "-"
    if mode == "search":
        return said.split("; measured on")[0]
    record = json.loads(said)
    gain = ", ".join(f"b{b} {g:.2f}x" for b, g in record["gain_vs_plain"].items())
    if record["chosen"]:
        return f"{', '.join(record['kept_float'])} (verified {gain} plain)"
    why = record["not_run"] or f"{len(record['candidates'])} candidate(s) not faster ({gain} plain)"
    return f"none: {why}"


def speeds(task: real.Task, files: dict[str, Path], rounds) -> dict[str, dict[int, float]]:
    """FP32 ms / each file's ms at each batch, all interleaved in one set of rounds per batch."""
    names = [n for n, p in files.items() if p.exists()]
    sessions = [session(task.float_path)] + [session(files[n]) for n in names]
    fixed = real.static_batch(task.float_path)
    out: dict[str, dict[int, float]] = {n: {} for n in names}
    for b in BATCHES:
        if fixed not in (None, b) or len(task.eval_x) < b:
            continue
        ms = steady_ms(sessions, np.ascontiguousarray(task.eval_x[:b]), rounds).median_ms
        for n, m in zip(names, ms[1:]):
            out[n][b] = ms[0] / m
    return out


def same_graph(a: Path, b: Path) -> bool:
    """The two files hold the same graph (their metadata aside): the same placement, timed twice."""
    import onnx

    if not (a.exists() and b.exists()):
        return False
    return onnx.load(str(a)).graph.SerializeToString() == onnx.load(str(b)).graph.SerializeToString()


def cell(ratio: dict, cost: dict, mode: str) -> str:
    """A file's speed-ups over FP32 (b1 / b8), or why there is no file."""
    got = ratio.get(mode)
    return " / ".join(f"{got[b]:.2f}x" for b in BATCHES if b in got) if got else cost[mode][2][:80]


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from " + ", ".join(MODELS))
    parser.add_argument("--out", default=None, help=f"the table (default {PUBLISHED.name} beside this script)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ", ".join(MODES))
    parser.add_argument("--keep", default=None, metavar="DIR", help="copy every INT8 file written into DIR")
    parser.add_argument("--search-steps", type=int, default=None,
                        help="--max-steps of the speed search (default: REAL.md's bound for the large models)")
    args = _smoke.parse_args(parser, argv, models="mtcnn_pnet")
    out_md = _smoke.output(args, args.out, PUBLISHED)
    rounds = SMOKE_ROUNDS if args.smoke else DEFAULT_ROUNDS
    lines = [*_smoke.banner(args), *_smoke.cpu_lines("Placement: plain vs by profile (default) vs speed search"),
             "Speed-up over FP32 in ONNX Runtime (1 thread, thread CPU time, interleaved, median; b1 / b8); quantize "
             "time of `quantize-onnx --target onnxruntime-cpu` (wall s / CPU s of the process).", "",
             "| model | plain | profile | search | profile / search | quantize plain | quantize profile | "
             "quantize search | profile / plain time | kept float by profile | kept float by search |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="quantship-placement-") as folder:
        work = Path(folder)
        for name in args.models.split(","):
            task = real.make_task(name, args.smoke, work)
            files = {mode: work / f"{name}_{mode}.onnx" for mode in MODES}
            cost = {mode: quantize(task, files[mode], mode, args.smoke, args.search_steps) if mode in args.modes
                    else (math.nan, math.nan, "not run (--modes)") for mode in MODES}
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                for path in files.values():
                    if path.exists():
                        shutil.copy(path, Path(args.keep) / path.name)
            for mode, (wall, cpu, note) in cost.items():
                print(f"{name} {mode}: {wall:.1f} s wall, {cpu:.1f} s CPU{'; ' + note if note else ''}", flush=True)
            ratio = speeds(task, files, rounds)

            share = {m: geomean(ratio[m].values()) if ratio.get(m) else float("nan") for m in MODES}
            fraction = (share["profile"] - 1) / (share["search"] - 1) if share["search"] > 1 else float("nan")
            lines.append(
                f"| {name} | {cell(ratio, cost, 'plain')} | {cell(ratio, cost, 'profile')} | {cell(ratio, cost, 'search')} | "
                f"{share['profile'] / share['search']:.0%} of the speed-up"
                + (f" ({fraction:.0%} of the gain over 1x)" if math.isfinite(fraction) else "") + " | "
                + " | ".join(f"{cost[m][0]:.0f} / {cost[m][1]:.0f}" for m in MODES)
                + f" | {cost['profile'][1] / cost['plain'][1]:.2f}x | "
                + " | ".join((kept_float(files[m], m) + (" (the plain file's graph)" if same_graph(files[m], files["plain"])
                                                          else "")) if files[m].exists() else "-"
                             for m in ("profile", "search"))
                + " |")
            print(lines[-1], flush=True)
    lines += ["", "Two files with the plain file's graph are the same placement timed twice: their difference is the "
              "timing's noise on this machine, not a placement's.", "",
              f"Load average at the end: {os.getloadavg()[0]:.1f}."]
    out_md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out_md}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
