"""``quantship quantize-onnx --engine ort``: ONNX Runtime's own quantizer with the preset's settings, for comparison."""

from __future__ import annotations

import argparse

from quantship import targets
from quantship.cli import common
from quantship.cli.check import exit_code


def run(args: argparse.Namespace, out) -> int:
    """``--engine ort``: ONNX Runtime's quantize_static with the target's preset settings, then its check."""
    # late: `quantize-onnx --help` answers before onnx and onnxruntime load
    from quantship.export.ort_quantize import float_input, ort_settings, quantize_onnx_file, refuse_quantized
    from quantship.inspect.read.loading import file_size, load_onnx

    ui = common.Output(args)
    target = targets.get(args.target)
    model = load_onnx(args.float_model)
    refuse_quantized(model, args.float_model)  # up front: ORT's quantizer loops on a quantized file
    fixed = float_input(model, args.float_model).dims[0]
    del model
    if fixed and fixed != args.batch_size:
        ui.say(f"{args.float_model} has a fixed batch of {fixed}: calibrating with batch size {fixed}")
        args.batch_size = fixed
    batches = common.read_calibration(args, keep_last=True)
    ui.say(f"quantizing with ONNX Runtime: {ort_settings(target, per_tensor=args.per_tensor).describe()}")
    result = quantize_onnx_file(args.float_model, out, batches, target, per_tensor=args.per_tensor,
                                keep_refused=args.keep_refused)
    size = file_size(result.path) if result.path else None
    stats, verdict = result.stats, result.verdict
    report = {"version": 1, "input": args.float_model, "target": target.target, "engine": "ort",
              "path": str(result.path) if result.path else None, "kernel_shape_written": result.kernel_shape_written,
              "qdq_stats": stats.as_dict(), "check": verdict.as_dict()}
    ui.report(report, [
        ("file", f"{result.path} ({size / 1e6:.2f} MB)" if result.path else "nothing written (refused)"),
        ("Q / DQ nodes", f"{stats.n_quantize} / {stats.n_dequantize}, {stats.n_per_channel} per-channel, "
                         f"{stats.n_uint8} uint8"),
        (f"check {target.target}", common.verdict_line(verdict)),
    ])
    return exit_code(verdict)
