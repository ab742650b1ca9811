"""What the commands that write or judge a file share about fidelity to FP32: the budget's flags, the
held-out data, the report rows, and the exit code when the budget decides it (``quantship.fidelity``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser, *, repairs: bool = True) -> None:
    from quantship.fidelity import DEFAULT_MIN_SQNR_DB, HELD_OUT_MAX, default_agreements  # a leaf: numpy only

    parser.add_argument("--min-sqnr", type=float, default=None, metavar="DB",
                        help=f"fidelity budget: least SQNR of every output against the float model, in dB "
                             f"(default {DEFAULT_MIN_SQNR_DB:g})")
    parser.add_argument("--min-agreement", type=float, default=None, metavar="P",
                        help=f"fidelity budget: least agreement with the float model (argmax, thresholded "
                             f"probabilities or signs, by output kind), in [0, 1], every output (default "
                             f"{default_agreements()})")
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
        if repair.set_aside:
            shown.append(("  set aside", f"{', '.join(repair.set_aside)}: float gave no file, the next nodes tried"))
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


def add_reference_arguments(parser: argparse.ArgumentParser) -> None:
    """``--reference FLOAT.onnx`` and the budget: what lets ``check`` and ``compare`` gate a release."""
    parser.add_argument("--reference", metavar="FLOAT.onnx",
                        help="the float file the INT8 file was made from: judge each output's fidelity to it "
                             "(SQNR and agreement, the budget below) and exit 1 beyond it; default: the float "
                             "file the INT8 file's metadata names, when it lies beside it unchanged")
    add_arguments(parser, repairs=False)


def judge_reference(args: argparse.Namespace, int8_path: str, target, data, n: int,
                    reference: str | None = None) -> tuple[Any, str]:
    """The INT8 file's fidelity to its float reference on the run's inputs (``data``: the --inputs batches or
    None for generated ones), and a line saying which reference; (None, why) when fidelity is not judged."""
    from pathlib import Path

    # late: onnx, numpy and onnxruntime load when a file is judged, so --help answers at once
    from quantship.inspect.judge.reference import judge_reference as judge
    from quantship.inspect.judge.reference import named_reference
    from quantship.inspect.read.feeds import for_run
    from quantship.inspect.read.loading import load_onnx

    if args.no_fidelity:
        return None, "not judged (--no-fidelity)"
    given = reference or args.reference
    if given:
        found, said = Path(given), f"{given}, given"
    else:
        found, said = named_reference(int8_path)
        if found is None:
            return None, f"not judged: {said}"
    feeds = for_run(load_onnx(str(found)), data, n=n if data is None else 1 << 30, path=str(found))  # all given
    if data is None:  # generated inputs are not the model's data: measured and shown, never a verdict
        said += "; measured on generated inputs, not judged (give --inputs real data to judge it)"
    return judge(int8_path, found, feeds.batches, target, budget(args) if data is not None else None,
                 f"{sum(len(next(iter(f.values()))) for f in feeds.batches)} input(s), {feeds.describe()}"), said


def reference_exit(fidelity, code: int) -> int:
    """The command's exit code with fidelity's verdict joined: a missed or inconclusive judgement is 1."""
    if fidelity is not None and fidelity.status in ("missed", "inconclusive"):
        return 1
    return code
