"""The zoo's speed against FP32: the default file, the plain placement and the speed search, per model.

For every model of a zoo family (bench/_zoo_families.py: ``torchvision``, ``timm``; the untrained model at its
ZOO.md size, prepared as bench/zoo.py prepares it) the bench writes the float model's state and a factory a
user's command can load, exports FP32 with ``quantship export-onnx``, and runs, as a user runs them (a
subprocess each, ``--json``):

- ``default``: ``quantship quantize FACTORY --weights W --calib CAL.npy`` (the PyTorch path, the zoo's path:
  fidelity judged and repaired, placement by profile, speed measured);
- ``plain``: the same with ``--plain-placement`` (the placement before the profile);
- ``search``: ``quantship quantize-onnx FP32.onnx --calib CAL.npy --speed-search --max-steps N`` (the whole-file
  search exists on the ONNX path only);
- ``unjudged``, only when the budget refused every default file (an untrained network that amplifies each
  rounding step, ZOO.md): ``quantize ... --no-fidelity``, the fast file such a user can still ask for, timed
  beside the rest and shown in the default's cell after its refusal.

Speed: FP32 and every file written in ONNX Runtime, one thread each, thread CPU time, interleaved round after
round, median (REAL.md's method, ``bench/_real_timing.steady_ms``), at batch 1 and 8 on random images. The
``said`` column is what the default run told its user: ``SLOWER`` when its report's first line says the file
is slower than FP32 (its own reading), ``-`` when it did not. A default file under 1.00x here that was not
called slower is what issue 39 forbids (the report's own reading and this one are two timings: the row shows
both).

    python bench/zoo_speed.py                                  # the torchvision family
    python bench/zoo_speed.py --family timm
    python bench/zoo_speed.py --models resnet18 mobilenet_v2
    python bench/zoo_speed.py --render
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import _smoke
import numpy as np
import torch
from _real_timing import DEFAULT_ROUNDS, SMOKE_ROUNDS, session, steady_ms
from _zoo_families import entries
from zoo import GIANT_PARAMS, IMAGE_FAMILIES, prepare_untrained, smallest_size

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
TABLE = ROOT / "ZOO-speed.md"
RESULTS = BENCH / "zoo_speed_results.json"
MODES = ("default", "plain", "search")
UNJUDGED = "unjudged"  # run only when the default wrote no file: `quantize --no-fidelity`
BATCHES = (1, 8)
CALIB = 16  # random calibration images (the CLI holds a slice out for the fidelity judgement)
SEARCH_STEPS = 3  # the speed search's bound: each step quantizes and times the whole file again
FACTORY = '''import sys
sys.path.insert(0, {bench!r})
from _zoo_families import entries


def build():
    return next(e for e in entries({family!r}) if e.name == {name!r}).build()
'''


def quantship(*argv: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """One ``quantship`` command as a user runs it: the finished process, wall s and CPU s (user + sys)."""
    exe = Path(sys.executable).parent / "quantship"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([str(exe), *argv], capture_output=True, text=True, env=env, timeout=7200)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, time.perf_counter() - start, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def one_line(done: subprocess.CompletedProcess) -> str:
    """The command's last non-empty line of stderr (its one-line refusal), else of stdout."""
    lines = [ln.strip() for ln in (done.stderr or done.stdout or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else f"exit {done.returncode}, no message"


def reported(done: subprocess.CompletedProcess) -> dict:
    """The JSON report's speed-related parts (empty when the command printed none)."""
    try:
        report = json.loads(done.stdout)
    except ValueError:
        return {}
    speed = report.get("speed") or {}
    profile = report.get("placement_by_profile") or {}
    return {"own_speedup": speed.get("speedup"), "slower": bool(speed.get("slower")),
            "kept_for_speed": (profile.get("kept_float") if profile.get("chosen") else []) or [],
            "repair": (report.get("repair") or {}).get("summary")}


def run_model(key: str, tmp: Path, smoke: bool) -> dict:
    family, name = key.split("/", 1)
    entry = next((e for e in entries(family) if e.name == name), None)
    if entry is None:
        return {"model": name, "family": family, "status": f"not a model of the {family} family"}
    torch.manual_seed(0)
    model = entry.build()
    row: dict = {"model": name, "family": family, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    if row["params_m"] * 1e6 > GIANT_PARAMS:
        return {**row, "status": f"left out: more than {GIANT_PARAMS / 1e6:.0f}M parameters"}
    size = entry.size or smallest_size(model)
    if size is None:
        return {**row, "status": "no float forward at the zoo's sizes"}
    row["size"] = size
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(1, 3, size, size, generator=gen) for _ in range(2 if smoke else CALIB)]
    if family in IMAGE_FAMILIES:
        prepare_untrained(model, size, calib[:2])
    work = tmp / name
    work.mkdir(parents=True, exist_ok=True)
    factory, weights, cal, fp32 = work / "zoo_model.py", work / "weights.pt", work / "calib.npy", work / "fp32.onnx"
    factory.write_text(FACTORY.format(bench=str(BENCH), family=family, name=name))
    torch.save(model.state_dict(), weights)
    np.save(cal, torch.cat(calib).numpy())
    done, _, _ = quantship("export-onnx", f"{factory}:build", "--weights", str(weights), "--out", str(fp32),
                           "--shape", f"1,3,{size},{size}", "--quiet")
    if done.returncode:
        return {**row, "status": f"export-onnx: {one_line(done)}"}
    steps = "1" if smoke else str(SEARCH_STEPS)
    commands = {"default": ("quantize", f"{factory}:build", "--weights", str(weights)),
                "plain": ("quantize", f"{factory}:build", "--weights", str(weights), "--plain-placement"),
                "search": ("quantize-onnx", str(fp32), "--speed-search", "--max-steps", steps)}
    files = {}
    queue = list(commands.items())
    for mode, command in queue:
        out = work / f"{mode}.onnx"
        done, wall, cpu = quantship(*command, "--calib", str(cal), "--out", str(out), "--json")
        row[mode] = {"exit": done.returncode, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), **reported(done)}
        if out.exists():
            files[mode] = out
        else:
            row[mode]["refused"] = one_line(done)
        print(f"{name} {mode}: exit {done.returncode}, {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
        if mode == "default" and "default" not in files:
            # the budget refused every file: what the user's fast file (--no-fidelity, not judged) would run at
            queue.append((UNJUDGED, (*command, "--no-fidelity")))
    x = np.random.default_rng(5).standard_normal((8, 3, size, size)).astype(np.float32)
    sessions = [session(fp32)] + [session(p) for p in files.values()]
    for b in BATCHES:
        ms = steady_ms(sessions, x[:b], SMOKE_ROUNDS if smoke else DEFAULT_ROUNDS).median_ms
        row[f"fp32_ms_b{b}"] = round(ms[0], 4)
        for mode, m in zip(files, ms[1:]):
            row[mode][f"speedup_b{b}"] = round(ms[0] / m, 3)
    return {**row, "status": "ok", "load": round(os.getloadavg()[0], 1)}


def cell(got: dict | None, fast: dict | None = None) -> str:
    """A file's speed-ups b1 / b8, or why there is none (and, given ``fast``, the unjudged file's)."""
    if not got:
        return "not run"
    if "speedup_b1" not in got:
        return f"no file: {got.get('refused', '?')[:70]}" + (f"; `--no-fidelity`: {cell(fast)}" if fast else "")
    speed = " / ".join(f"{got[f'speedup_b{b}']:.2f}x" for b in BATCHES)
    # a file written with a non-zero exit: the verdict was not "accepted" (e.g. inconclusive on a constant output)
    return f"{speed} (exit {got['exit']})" if got.get("exit") else speed


def render(records: dict, banner: list[str]) -> str:
    rows = sorted((r for r in records.values() if r.get("status") == "ok"), key=lambda r: (r["family"], r["model"]))
    slow = [r for r in rows if min(r["default"].get(f"speedup_b{b}", 9) for b in BATCHES) < 1.0]
    unsaid = [r["model"] for r in slow if not r["default"].get("slower")]
    lines = [*banner, "# The zoo's speed against FP32: default vs plain placement vs speed search", "",
             "Generated by `python bench/zoo_speed.py [--family F]` from `bench/zoo_speed_results.json`; do not edit "
             "by hand. Untrained models at ZOO.md's sizes, prepared as bench/zoo.py prepares them, 16 random "
             "calibration images; each file written by the CLI as a user runs it (`quantize` default, `quantize "
             f"--plain-placement`, `quantize-onnx --speed-search --max-steps {SEARCH_STEPS}` on the `export-onnx` "
             "file). Speed-up over FP32 in ONNX Runtime, 1 thread, thread CPU time, interleaved, median, b1 / b8 "
             "(REAL.md's method). `said`: the default run's own reading and whether its report's first line said "
             "SLOWER. `kept float`: what the default's placement by profile kept float for speed. `(exit 1)`: the "
             "file was written but its verdict was not `accepted` (e.g. `inconclusive`: an untrained model whose "
             "output is the same for every input).", "",
             f"- {len(rows)} models timed; default file under 1.00x FP32 at a batch here: {len(slow)}"
             + (f" ({', '.join(r['model'] for r in slow)})" if slow else "")
             + f"; of those, not called slower by their own report: {len(unsaid)}"
             + (f" ({', '.join(unsaid)})" if unsaid else ""),
             f"- CPUs: {', '.join(sorted({r.get('cpu', '?') for r in records.values()}))}; commits: "
             f"{', '.join(sorted({r.get('commit', '?') for r in records.values()}))}",
             *[f"- {r['model']}: {r['status']}" for r in records.values() if r.get("status") != "ok"],
             *[f"- {family}: not run yet ({len(left)}): {', '.join(left)}" for family in IMAGE_FAMILIES
               for left in [[e.name for e in entries(family) if f"{family}/{e.name}" not in records]]
               if left and any(r.get("family") == family for r in records.values())], "",
             "| family | model | params M | input | FP32 ms b1 / b8 | default | plain | search | said (own b1 / b8) | "
             "kept float | quantize CPU s default / plain / search | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["default"]
        own = d.get("own_speedup") or {}
        said = ("SLOWER" if d.get("slower") else "-") + (
            f" ({' / '.join(f'{v:.2f}x' for v in own.values())})" if own else "")
        kept = ", ".join(d.get("kept_for_speed") or []) or "-"
        lines.append(f"| {r['family']} | {r['model']} | {r['params_m']} | {r['size']} | {r['fp32_ms_b1']:.3f} / {r['fp32_ms_b8']:.3f} | "
                     f"{cell(d, r.get(UNJUDGED))} | {cell(r.get('plain'))} | {cell(r.get('search'))} | {said} | {kept[:120]} | "
                     + " / ".join(f"{r[m]['cpu_s']:.0f}" if m in r else "-" for m in MODES) + f" | {r['load']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=IMAGE_FAMILIES, default="torchvision")
    parser.add_argument("--models", nargs="*", default=None, help="default: every model of the family")
    parser.add_argument("--out", type=Path, default=None, help=f"default: {TABLE.name}")
    parser.add_argument("--results", type=Path, default=None, help=f"the records (default: bench/{RESULTS.name})")
    parser.add_argument("--render", action="store_true", help="only render the table from the records")
    args = _smoke.parse_args(parser, argv, models=["resnet18"])
    # a record per family and model (efficientnet_b0 is in both families)
    args.models = [f"{args.family}/{m}" for m in (args.models or [e.name for e in entries(args.family)])]
    _smoke.record_models(args, "bench/zoo_speed.py", TABLE, RESULTS,
                         lambda key, tmp: run_model(key, tmp, args.smoke), render)


if __name__ == "__main__":
    main()
