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
    from quantship.inspect.read.weight_only import describe_rows

    report = inspect_file(args.file)
    recorded = _recorded(args.file)
    if args.json:
        common.emit_json(args.command, {**report.as_dict(), "recorded": recorded})
        return 0
    mem = report.memory
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("file", f"{report.path}  (opset {report.opset}, {report.producer or 'unknown producer'})")
    if report.weight_only:
        table.add_row("format", f"{report.weight_only['description']}, activations float")
    else:
        table.add_row("format", report.format + (f", activations {'/'.join(report.activation_dtypes)}"
                                                 if report.activation_dtypes else ""))
    ops = ", ".join(f"{k} {v}" for k, v in sorted(report.operators.items(), key=lambda kv: -kv[1]))
    table.add_row("operators", f"{report.n_operators} ({report.n_compute_operators} compute): {ops}")
    table.add_row("tensors", f"{report.n_tensors} ({report.n_activations} activations, {report.n_weights} weights)")
    table.add_row("Q/DQ", f"{report.n_quantize} Q, {report.n_dequantize} DQ, {report.n_per_channel} per-channel")
    table.add_row("weights", _size(report.weight_bytes))
    for row in describe_rows(report.weight_only) if report.weight_only else []:
        table.add_row(*row)
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
    if recorded["made_by"]:
        table.add_row("made by", recorded["made_by"])
    for key, row in (("fidelity_fp32", "fidelity vs FP32"), ("speed", "speed vs FP32")):
        if recorded[key] is not None:
            table.add_row(f"{row} (recorded)", _recorded_line(recorded[key]))
    if report.quant_spec:
        spec = dict(report.quant_spec)
        if recorded["engine"] == "quantize_onnx":
            spec.pop("backend", None)  # the ONNX path's file: no PyTorch backend made it
        table.add_row("quantship spec", str(spec))
    Console(highlight=False).print(table)
    return 0


ENGINES = {"quantize_onnx": "quantship quantize-onnx (the ONNX path)",
           "dynamic": "quantship quantize-onnx --activations dynamic"}


def _recorded(path: str) -> dict:
    """What the file's own metadata records of how it was made and measured (None where it records nothing):
    the same words the quantize commands printed when they wrote it."""
    import json

    import onnx  # late: --help answers before onnx loads

    props = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}

    def parsed(key: str):
        try:
            return json.loads(props[key]) if key in props else None
        except ValueError:
            return {"unreadable": props[key]}

    engine = props.get("quantship.engine")
    made_by = ENGINES.get(engine, engine) if engine else (
        "quantship export_qdq (the PyTorch path)" if "quantship.spec" in props else None)
    return {"engine": engine, "made_by": made_by, "fidelity_fp32": parsed("quantship.fidelity"),
            "speed": parsed("quantship.speed"), "repair": parsed("quantship.repair")}


def _recorded_line(record: dict) -> str:
    if "unreadable" in record:
        return f"unreadable ({record['unreadable'][:60]})"
    if "status" in record and "sqnr_db" in record:
        return f"SQNR {record['sqnr_db'] if isinstance(record['sqnr_db'], str) else round(record['sqnr_db'], 1)} dB, " \
               f"{record['status']}; {record.get('runtime', '')}, {record.get('data', '')}"
    if "speedup" in record:  # export.speed_gate's record
        ups = " / ".join(f"{float(v):.2f}x" for v in record["speedup"].values())
        return (f"{ups} at b{' / b'.join(record['speedup'])} ({'SLOWER than FP32' if record.get('slower') else 'faster'}"
                f"; {record.get('cpu', '?')}, {', '.join(record.get('flags', []))}, {record.get('threads', 1)} thread)")
    return ", ".join(f"{k} {v}" for k, v in record.items() if not isinstance(v, (dict, list)))[:200]
