"""``quantship compare FLOAT.onnx INT8.onnx [--target X] [--inputs DATA]``: the three-way check in output LSB.

The INT8 file is also held to FLOAT.onnx (``quantship.fidelity``: each output's SQNR and agreement against
the budget, ``--min-sqnr`` / ``--min-agreement``), so the command can gate a release. Exit code 0: measured
and the budget kept; 1: inconclusive (the float output is constant over the inputs) or the budget missed;
2: bad input.
"""

from __future__ import annotations

import argparse

from quantship.cli import common, inputs
from quantship.cli import fidelity as fidelity_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("float_file", help="the float ONNX file (the reference)")
    parser.add_argument("int8_file", help="the INT8 QDQ file made from it")
    common.add_target_argument(parser, default="tigris",
                               help="the runtime whose execution of the INT8 file is compared (default tigris)")
    parser.add_argument("--n", type=common.positive_int, default=20,
                        help="number of generated input batches when no --inputs is given (default 20)")
    inputs.add_arguments(parser, "for all three runs")
    fidelity_cli.add_arguments(parser, repairs=False)
    parser.add_argument("--json", action="store_true", help="print the versioned JSON report")


def run(args: argparse.Namespace) -> int:
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    from quantship import targets
    from quantship.inspect.judge.compare import compare_files

    fidelity_cli.budget(args)  # a bound out of range: one line, exit 2, before any run
    from quantship.errors import NoOutputScale

    real = inputs.read(args, args.int8_file)
    try:
        report = compare_files(args.float_file, args.int8_file, target=args.target, n_inputs=args.n, inputs=real)
    except NoOutputScale as exc:  # no LSB rows for a float tail; fidelity to the float file is still judged
        report, no_rows = None, str(exc)
    judged, said = fidelity_cli.judge_reference(args, args.int8_file, targets.get(args.target), real, args.n,
                                                reference=args.float_file)
    inconclusive = report is not None and report.inconclusive
    code = fidelity_cli.reference_exit(judged, 1 if inconclusive else 0)  # inconclusive is never a pass
    if args.json:
        rows = report.as_dict() if report is not None else {"rows": None, "no_rows": no_rows}
        common.emit_json(args.command, {**rows, "fidelity_fp32": judged.as_dict() if judged else None})
        return code
    if report is None:
        print(f"LSB rows: not measured ({no_rows})")
        print(f"fidelity vs FP32 ({said}): {judged.describe()}" if judged else f"fidelity vs FP32: {said}")
        return code
    source = f"from {args.inputs}" if args.inputs else "generated"
    print(f"{report.n_samples} {source} input(s) in {report.n_batches} batch(es), errors in the INT8 file's output LSB")
    if not args.inputs:
        print(f"  inputs {report.inputs}: no --inputs given")
    for row in report.rows:
        print(f"  {row}")
    if report.inconclusive:
        print(f"inconclusive: {report.inconclusive}")
    print(f"fidelity vs FP32 ({said}): {judged.describe()}" if judged else f"fidelity vs FP32: {said}")
    return code
