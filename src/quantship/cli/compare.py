"""``quantship compare FLOAT.onnx INT8.onnx [--target X]``: the three-way check in output LSB."""

from __future__ import annotations

import argparse

from quantship.cli import common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("float_file", help="the float ONNX file (the reference)")
    parser.add_argument("int8_file", help="the INT8 QDQ file made from it")
    common.add_target_argument(parser, default="tigris",
                               help="the runtime whose execution of the INT8 file is compared (default tigris)")
    parser.add_argument("--n", type=common.positive_int, default=20, help="number of seeded inputs (default 20)")
    parser.add_argument("--inputs", help=".npy array (N x C x H x W) of real inputs, cut at the file's batch "
                        "size; default: --n seeded random inputs")
    parser.add_argument("--json", action="store_true", help="print the versioned JSON report")


def run(args: argparse.Namespace) -> int:
    from quantship.inspect.compare import compare_files

    inputs = None
    if args.inputs:
        from quantship.cli.sources import load_array

        inputs = load_array(args.inputs)
    report = compare_files(args.float_file, args.int8_file, target=args.target, n_inputs=args.n, inputs=inputs)
    if args.json:
        print(report.to_json())
        return 0
    source = f"batches from {args.inputs}" if args.inputs else "seeded random inputs"
    print(f"{report.n_inputs} {source}, errors in the INT8 file's output LSB")
    for row in report.rows:
        print(f"  {row}")
    return 0
