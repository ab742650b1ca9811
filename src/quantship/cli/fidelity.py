"""What the commands that write or judge a file share about fidelity to FP32: the budget's flags, the
held-out data, the report rows, and the exit code when the budget decides it (``quantship.fidelity``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

HELD_OUT_MAX = 64  # samples held out from calibration to judge fidelity on


def add_arguments(parser: argparse.ArgumentParser, *, repairs: bool = True) -> None:
    from quantship.fidelity import DEFAULT_MIN_AGREEMENT, DEFAULT_MIN_SQNR_DB  # a leaf: numpy only

    parser.add_argument("--min-sqnr", type=float, default=None, metavar="DB",
                        help=f"fidelity budget: least SQNR of every output against the float model, in dB "
                             f"(default {DEFAULT_MIN_SQNR_DB:g})")
    parser.add_argument("--min-agreement", type=float, default=None, metavar="P",
                        help=f"fidelity budget: least agreement with the float model (argmax, thresholded "
                             f"probabilities or signs, by output kind), in [0, 1] (default {DEFAULT_MIN_AGREEMENT:g})")
    parser.add_argument("--no-fidelity", action="store_true",
                        help="do not judge fidelity to the float model (faster; the file is then accepted on the "
                             "runtime check alone, and the report says fidelity was not judged)")
    if repairs:
        parser.add_argument("--no-repair", action="store_true",
                            help="judge fidelity but do not repair a file that misses the budget (exit 1, nothing "
                                 "written)")
        parser.add_argument("--fidelity-data", metavar="DATA",
                            help="inputs held out from calibration to judge fidelity on (the --calib grammar); "
                                 f"default: --calib samples beyond --max-samples, else the last fifth of --calib "
                                 f"(at most {HELD_OUT_MAX})")


def budget(args: argparse.Namespace):
    """The request's ``fidelity.Budget`` (None with --no-fidelity); a bound out of range is refused."""
    from quantship.fidelity import budget_from  # late: numpy loads with it, after --help

    return budget_from(args.min_sqnr, args.min_agreement, judged=not args.no_fidelity)


def split_held_out(arrays: dict[str, Any], max_samples: int) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """Calibration arrays and the arrays held out to judge fidelity on: the samples beyond ``max_samples``
    when there are any, else the last fifth (none for fewer than 5 samples); and a line saying which."""
    n = len(next(iter(arrays.values())))
    if n > max_samples:
        stop = min(n, max_samples + HELD_OUT_MAX)
        return ({k: v[:max_samples] for k, v in arrays.items()}, {k: v[max_samples:stop] for k, v in arrays.items()},
                f"{stop - max_samples} --calib sample(s) beyond --max-samples")
    if n < 5:
        return arrays, None, "none held out (fewer than 5 --calib samples)"
    k = min(HELD_OUT_MAX, n // 5)
    return ({name: v[:n - k] for name, v in arrays.items()}, {name: v[n - k:] for name, v in arrays.items()},
            f"the last {k} of {n} --calib samples, held out from calibration")


def rows(fp32, repair) -> list[tuple[str, str]]:
    """The report's first rows: the file's fidelity to FP32, and the repair's steps when it ran."""
    shown = [("fidelity vs FP32", fp32.describe())]
    if len(fp32.outputs) > 1:
        shown.append(("per output", "; ".join(f"{o.name}: {o.describe()}" for o in fp32.outputs)))
    if repair is not None and len(repair.steps) > 1:
        shown.append(("repair", f"{len(repair.steps) - 1} step(s); chose step {repair.chosen}"))
        shown.extend((f"  step {k}", s.describe() + (f"; float: {', '.join(s.excluded)}" if s.excluded else "")
                      + (f"; 16-bit: {', '.join(s.int16)}" if s.int16 else ""))
                     for k, s in enumerate(repair.steps))
    return shown


def missed(command: str, ui, error, data: dict[str, Any]) -> int:
    """No file kept the budget: every step reported, nothing written, exit 1."""
    steps = error.record.get("steps", [])
    ui.report({**data, "path": None, "verdict": "fidelity_missed", "repair": error.record},
              [("file", "nothing written: no file kept the fidelity budget"),
               *((f"  step {k}", f"{s['what']}: SQNR {s['sqnr_db'] if isinstance(s['sqnr_db'], str) else round(s['sqnr_db'], 1)} dB"
                  f"{'' if s['agreement'] is None else ', agreement ' + format(s['agreement'], '.3f')} ({s['status']})")
                 for k, s in enumerate(steps))])
    print(f"quantship {command}: {error}", file=sys.stderr)
    return 1
