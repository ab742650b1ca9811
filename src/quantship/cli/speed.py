"""What the quantize commands share about speed against FP32 (``export.speed_gate``): the flags, the
refusals made before any work, the report rows, the warning on stderr and the exit when
``--require-faster`` decides it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from quantship.cli.usage import UsageError

ROW = "speed vs FP32 (this CPU, 1 thread)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-speed", action="store_true",
                        help="do not time the INT8 file against FP32 on this CPU (by default it is, for ONNX Runtime "
                             "targets: batch 1 and the calibration batch, 1 thread, a few seconds)")
    parser.add_argument("--plain-placement", action="store_true",
                        help="ONNX Runtime targets: skip the placement by profile (by default the weighted ops "
                             "whose integer form, with its Q/DQ and layout nodes, profiles slower here are kept "
                             "float when the whole file, timed once, is faster and keeps the fidelity budget)")
    parser.add_argument("--require-faster", action="store_true",
                        help="exit 1, writing nothing, when the INT8 file runs slower than FP32 on this CPU at "
                             "batch 1 or the calibration batch (ONNX Runtime targets)")


def refuse(args: argparse.Namespace, target: Any = None, *, not_timed: str | None = None) -> None:
    """``--require-faster`` without the reading it needs: one line, exit 2, before any work. ``target``: the
    resolved target (None: not known yet); ``not_timed``: the option of this request that leaves the file
    untimed."""
    if not args.require_faster:
        return
    if args.no_speed:
        raise UsageError("--require-faster needs the speed reading that --no-speed skips: drop one of them")
    if target is not None and not target.runtime_is_onnxruntime:
        raise UsageError(f"--require-faster times the file in ONNX Runtime on this CPU; --target {target.name}'s "
                         "runtime is not that: time its engine on its own hardware, and drop --require-faster")
    if not_timed:
        raise UsageError(f"--require-faster: {not_timed} is not timed against FP32 here; drop one of them")


def rows(reading: Any) -> list[tuple[str, str]]:
    """The report's first rows: the slowdown, named, when the file is slower; the speed row (None: not timed)."""
    if reading is None:
        return []
    return [*([("SLOWER than FP32", reading.warning())] if reading.slower else []), (ROW, reading.describe())]


def profile_rows(record: Any) -> list[tuple[str, str]]:
    """The placement by profile (``export.profile_place``): what it kept float for speed and why, or why
    the plain placement stayed (None: not run)."""
    if record is None:
        return []
    return [("placement by profile", record.describe())]


def warn(command: str, reading: Any, quiet: bool = False) -> None:
    """One line on stderr, before the report, when the file is slower than FP32 (``--quiet``: the report's
    "SLOWER than FP32" row says it, stderr stays empty as --quiet promises)."""
    if reading is not None and reading.slower and not quiet:
        print(f"quantship {command}: warning: {reading.warning()}", file=sys.stderr, flush=True)


def missed(command: str, ui, error, data: dict[str, Any]) -> int:
    """``--require-faster`` and a slower file: the reading reported, nothing written, exit 1."""
    reading = error.reading
    print(f"quantship {command}: {error}", file=sys.stderr, flush=True)
    ui.report({**data, "path": None, "verdict": "slower_than_fp32",
               "speed": reading.as_dict() if reading is not None else None},
              [("file", "nothing written: --require-faster and the INT8 file is not faster than FP32"),
               *([(ROW, reading.describe())] if reading is not None else [])])
    return 1
