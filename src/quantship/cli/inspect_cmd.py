"""``quantship inspect FILE [--json]``: what an ONNX file contains."""

from __future__ import annotations

import argparse

from quantship.cli import common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="an ONNX file (QDQ, QOperator, dynamic or float)")
    parser.add_argument("--json", action="store_true", help="print the versioned JSON report")


def _size(n: int) -> str:
    for unit, step in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= step:
            return f"{n / step:.2f} {unit}"
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    from rich.console import Console
    from rich.table import Table

    from quantship.inspect.read.float_ops import describe_float_ops
    from quantship.inspect.read.graph import inspect_file

    report = inspect_file(args.file)
    if args.json:
        common.emit_json(args.command, report.as_dict())
        return 0
    mem = report.memory
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("file", f"{report.path}  (opset {report.opset}, {report.producer or 'unknown producer'})")
    table.add_row("format", report.format + (f", activations {'/'.join(report.activation_dtypes)}"
                                             if report.activation_dtypes else ""))
    ops = ", ".join(f"{k} {v}" for k, v in sorted(report.operators.items(), key=lambda kv: -kv[1]))
    table.add_row("operators", f"{report.n_operators} ({report.n_compute_operators} compute): {ops}")
    table.add_row("tensors", f"{report.n_tensors} ({report.n_activations} activations, {report.n_weights} weights)")
    table.add_row("Q/DQ", f"{report.n_quantize} Q, {report.n_dequantize} DQ, {report.n_per_channel} per-channel")
    table.add_row("weights", _size(report.weight_bytes))
    for tensor in report.inputs:
        table.add_row("input", f"{tensor.name}  {tensor.describe()}")
    for tensor in report.outputs:
        table.add_row("output", f"{tensor.name}  {tensor.describe()}")
    if mem.largest_tensor:
        table.add_row("naive peak", f"{_size(mem.naive_peak_bytes)} as stored, "
                                    f"{_size(mem.naive_peak_bytes_int8)} at 1 byte/element")
        largest = mem.largest_tensor_int8
        table.add_row("largest tensor", f"{'x'.join(map(str, largest.shape))} ({largest.name}): "
                                        f"{_size(mem.largest_tensor.bytes)} as stored, {_size(largest.bytes)} at 1 byte")
    if mem.unknown_shapes:
        table.add_row("unknown shapes", f"{len(mem.unknown_shapes)} tensors left out of the peak")
    if report.float_ops:  # the same words as quantize's "left in float" row
        table.add_row("left in float", describe_float_ops(report.float_ops))
    if report.float_tensors:
        shown = ", ".join(report.float_tensors[:8])
        table.add_row("float tensors", f"{len(report.float_tensors)}: {shown}")
    if report.quant_spec:
        table.add_row("quantship spec", str(report.quant_spec))
    Console(highlight=False).print(table)
    return 0
