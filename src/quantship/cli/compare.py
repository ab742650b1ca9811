"""``quantship compare FLOAT.onnx INT8.onnx [--target X] [--inputs DATA]``: the three-way check in output LSB.

Exit code 0: measured; 1: inconclusive (the float output is constant over the inputs); 2: bad input.
"""

from __future__ import annotations

import argparse

from quantship.cli import common, inputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("float_file", help="the float ONNX file (the reference)")
    parser.add_argument("int8_file", help="the INT8 QDQ file made from it")
    common.add_target_argument(parser, default="tigris",
                               help="the runtime whose execution of the INT8 file is compared (default tigris)")
    parser.add_argument("--n", type=common.positive_int, default=20,
                        help="number of generated input batches when no --inputs is given (default 20)")
    inputs.add_arguments(parser, "for all three runs")
    parser.add_argument("--json", action="store_true", help="print the versioned JSON report")


def run(args: argparse.Namespace) -> int:
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    from quantship.inspect.judge.compare import compare_files

    real = inputs.read(args, args.int8_file)
    report = compare_files(args.float_file, args.int8_file, target=args.target, n_inputs=args.n, inputs=real)
    code = 1 if report.inconclusive else 0  # an inconclusive comparison is never a pass
    if args.json:
        common.emit_json(args.command, report.as_dict())
        return code
    source = f"from {args.inputs}" if args.inputs else "generated"
    print(f"{report.n_samples} {source} input(s) in {report.n_batches} batch(es), errors in the INT8 file's output LSB")
    if not args.inputs:
        print(f"  inputs {report.inputs}: no --inputs given")
    for row in report.rows:
        print(f"  {row}")
    if report.inconclusive:
        print(f"inconclusive: {report.inconclusive}")
    return code
