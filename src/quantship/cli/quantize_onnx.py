"""``quantship quantize-onnx``: a float ONNX file to a QDQ INT8 file that passes a target's check.

ONNX Runtime's quantizer does the work (``quantship.export.ort_quantize``) with the settings of the
target's preset: QDQ format, static scales, every operator quantized (its defaults leave e.g. a
Reshape in float, which TiGrIS refuses), and the activation type the target runs best. The file
appears only when the check passes.
"""

from __future__ import annotations

import argparse

from quantship.cli import common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("float_model", metavar="FLOAT.onnx", help="the float ONNX model to quantize")
    parser.add_argument("--out", required=True, help="the QDQ ONNX file to write")
    common.add_target_argument(parser, default="onnxruntime-cpu", help="deployment preset")
    parser.add_argument("--per-tensor", action="store_true", help="per-tensor weights (default per channel)")
    parser.add_argument("--keep-refused", action="store_true",
                        help="keep the file even when the target's check refuses it")
    common.add_calibration_arguments(parser)
    common.add_writer_arguments(parser)
    common.add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    with common.writing(args) as out:
        return _run(args, out)


def _run(args: argparse.Namespace, out) -> int:
    from quantship.export.ort_quantize import float_input, ort_settings, quantize_onnx_file, refuse_quantized
    from quantship.inspect.loading import file_size, load_onnx
    from quantship.precision import preset

    ui = common.Output(args)
    target = preset(args.target)
    model = load_onnx(args.float_model)  # validates: exists, is ONNX, has a graph (one-line errors)
    refuse_quantized(model, args.float_model)  # up front: ORT's quantizer loops on a quantized file
    fixed = float_input(model, args.float_model).dims[0]
    del model
    if fixed and fixed != args.batch_size:
        ui.say(f"{args.float_model} has a fixed batch of {fixed}: calibrating with batch size {fixed}")
        args.batch_size = fixed
    batches = common.read_calibration(args)
    ui.say(f"quantizing with ONNX Runtime: {ort_settings(target, per_tensor=args.per_tensor).describe()}")
    result = quantize_onnx_file(args.float_model, out, batches, target.target, per_tensor=args.per_tensor,
                                keep_refused=args.keep_refused)
    size = file_size(result.path) if result.path else None
    stats, verdict = result.stats, result.verdict
    report = {"version": 1, "input": args.float_model, "target": target.target,
              "path": str(result.path) if result.path else None, "kernel_shape_written": result.kernel_shape_written,
              "qdq_stats": stats.as_dict(), "check": verdict.as_dict()}
    ui.report(report, [
        ("file", f"{result.path} ({size / 1e6:.2f} MB)" if result.path else "nothing written (refused)"),
        ("Q / DQ nodes", f"{stats.n_quantize} / {stats.n_dequantize}, {stats.n_per_channel} per-channel, "
                         f"{stats.n_uint8} uint8"),
        (f"check {target.check_target}", common.verdict_line(verdict)),
    ])
    return 0 if verdict.ok else 1
