"""Crash safety of ``quantship quantize`` as a user meets it: Ctrl-C, kill -9 and two writers, in real processes.

Prints one table. Each trial runs the CLI on the TinyResNet example (1 x 32 x 32 inputs, batch 8)
and interrupts it at a seeded random moment of its measured duration:

- Ctrl-C: SIGINT at a random time. Counted: exit 130 with no new file (stopped), exit 130 with the
  new file complete (the signal came after the commit), and exit 0. While a command runs, the CLI
  records every SIGINT and exits 130 even when a library swallowed the KeyboardInterrupt, so an
  exit 0 means the signal landed after the command had returned (interpreter teardown, where the
  CLI ignores it) or as the process was exiting.
- kill -9: SIGKILL at a random time over an older file. Counted: the old file intact, the new file
  complete, anything else (corrupt). The next run in the directory must leave no temporary behind.
- Two writers start together on one path: both wait (both exit 0, one whole file), and with
  ``--no-wait`` (one exits 2 with the lock message unless the runs do not overlap).

    python bench/robustness.py [--trials 10] [--seed 0] [--work DIR]
    python bench/robustness.py --smoke [--work DIR]   # one trial of each part (bench/_smoke.py)
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
SRC = str(Path(__file__).resolve().parents[1] / "src")
FACTORY = "from quantship.examples.models import TinyResNet\n\ndef build():\n    return TinyResNet()\n"


def _argv(work: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "quantship", "quantize", f"{work / 'model.py'}:build", "--calib",
            str(work / "cal.npy"), "--out", str(out), "--batch-size", "8", "--quiet", *extra]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _whole(path: Path) -> bool:
    import onnx

    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception:
        return False
    return any(n.op_type == "QuantizeLinear" for n in model.graph.node)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".quantship-"))


def main(argv: list[str] | None = None) -> None:
    import _smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default="ctrl-c,kill,writers", help="comma-separated subset to run")
    parser.add_argument("--work", type=Path, default=None, help="work directory (default: a new temporary one)")
    args = _smoke.parse_args(parser, argv, trials=1)
    parts = set(args.parts.split(","))
    # a shell starts background jobs with SIGINT ignored, and children inherit an ignored signal:
    # handle it here so that every child starts with the default (and Python's KeyboardInterrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="quantship-robustness-")) if args.work is None else args.work
    work.mkdir(parents=True, exist_ok=True)
    (work / "model.py").write_text(FACTORY)
    np.save(work / "cal.npy", np.random.default_rng(0).standard_normal((16, 1, 32, 32)).astype(np.float32))

    start = time.perf_counter()
    done = subprocess.run(_argv(work, work / "ref.onnx"), env=_env(), capture_output=True, text=True)
    duration = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    print(f"one uninterrupted run: {duration:.1f} s (the window the signals are drawn from)")

    ctrl_c: Counter = Counter()
    for _ in range(args.trials if "ctrl-c" in parts else 0):
        out = work / "sigint.onnx"
        out.unlink(missing_ok=True)
        proc = subprocess.Popen(_argv(work, out), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        time.sleep(rng.uniform(0.2, duration))
        if proc.poll() is not None:  # the run was faster than the measured one: no signal was sent
            proc.communicate()
            ctrl_c["finished before the signal (not counted)"] += 1
            continue
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=600)
        traceback = "Traceback" in err
        if proc.returncode == 130:
            ctrl_c["exit 130, complete file" if out.exists() and _whole(out) else
                   "exit 130, no file" if not out.exists() else "exit 130, BROKEN file"] += 1
        else:
            state = "complete file" if out.exists() and _whole(out) else "no file"
            ctrl_c[f"exit {proc.returncode}, {state}"] += 1
            print(f"  exit {proc.returncode} after SIGINT; stderr: {err.strip()[-300:]!r}")
        ctrl_c["traceback printed"] += traceback
        ctrl_c["temp left (before the next run)"] += bool(_leftovers(work))

    kill: Counter = Counter()
    old = b"an older artifact"
    for _ in range(args.trials if "kill" in parts else 0):
        out = work / "killed.onnx"
        out.write_bytes(old)
        proc = subprocess.Popen(_argv(work, out), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.2, duration))
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        kill["old file intact" if out.read_bytes() == old else "new file complete" if _whole(out) else "CORRUPT"] += 1
        kill["temp left by the kill"] += bool(_leftovers(work))
    if "kill" in parts:
        done = subprocess.run(_argv(work, work / "next.onnx"), env=_env(), capture_output=True, text=True)
        kill["next run exit 0"] += done.returncode == 0
        kill["temp left after the next run"] += len(_leftovers(work))

    writers: Counter = Counter()
    for no_wait in ((False, True) if "writers" in parts else ()):
        out = work / f"shared_{int(no_wait)}.onnx"
        procs = [subprocess.Popen(_argv(work, out, *(["--no-wait"] if no_wait else [])), env=_env(),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [(p.wait(600), p.stderr.read()) for p in procs]
        label = "--no-wait" if no_wait else "waiting"
        writers[f"{label}: exit codes {sorted(code for code, _ in results)}"] += 1
        writers[f"{label}: lock message shown"] += any("another process is writing" in e for _, e in results)
        writers[f"{label}: final file whole"] += _whole(out)
    if "writers" in parts:
        writers["temp left"] += len(_leftovers(work))

    for title, counts in (("Ctrl-C", ctrl_c), ("kill -9", kill), ("two writers", writers)):
        if not counts:
            continue
        print(f"\n{title} ({args.trials} trials)" if title != "two writers" else f"\n{title}")
        for key, value in sorted(counts.items()):
            print(f"  {key:<40} {value}")
    print(f"\nwork directory: {work}")


if __name__ == "__main__":
    main()
