"""``quantship quantize-onnx``: a float ONNX file to a QDQ INT8 file that passes a target's check.

ONNX Runtime's quantizer does the work, with the settings each target needs: QDQ format, static
scales, every operator quantized (its defaults leave e.g. a Reshape in float, which TiGrIS refuses),
and the activation type the target runs best. The file appears only when the check passes.
"""

from __future__ import annotations

import argparse

from quantship.cli import common

# preset -> ONNX Runtime quantizer settings (activation type, symmetric activations)
_SETTINGS = {
    "onnxruntime-cpu": ("QUInt8", False),
    "openvino": ("QUInt8", False),
    "tensorrt": ("QInt8", True),
    "tigris": ("QInt8", True),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("float_model", metavar="FLOAT.onnx", help="the float ONNX model to quantize")
    parser.add_argument("--out", required=True, help="the QDQ ONNX file to write")
    common.add_target_argument(parser, default="onnxruntime-cpu", help="deployment preset")
    parser.add_argument("--per-tensor", action="store_true", help="per-tensor weights (default per channel)")
    parser.add_argument("--keep-refused", action="store_true",
                        help="keep the file even when the target's check refuses it")
    common.add_calibration_arguments(parser)
    common.add_output_arguments(parser)


def _batch_dim(path: str) -> int | None:
    import onnx

    model = onnx.load(path, load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    dim = inputs[0].type.tensor_type.shape.dim[0] if inputs else None
    return dim.dim_value if dim is not None and dim.HasField("dim_value") else None


def run(args: argparse.Namespace) -> int:
    import shutil
    import tempfile
    from pathlib import Path

    import onnx
    import onnx_ir as ir
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from quantship.cli.main import UsageError
    from quantship.export.kernel_shape import write_kernel_shapes
    from quantship.export.onnx_float import CalibrationReader
    from quantship.inspect.check import check_file
    from quantship.inspect.loading import file_size, load_onnx
    from quantship.inspect.stats import qdq_stats
    from quantship.precision import preset

    ui = common.Output(args)
    target = preset(args.target)
    load_onnx(args.float_model)  # validates: exists, is ONNX, has a graph (one-line errors)
    fixed = _batch_dim(args.float_model)
    if fixed and fixed != args.batch_size:
        ui.say(f"{args.float_model} has a fixed batch of {fixed}: calibrating with batch size {fixed}")
        args.batch_size = fixed
    batches = common.read_calibration(args)
    activation, symmetric = _SETTINGS[target.target]
    out = Path(args.out).expanduser().resolve()
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent} does not exist: create the directory first")
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        pre, staged = Path(tmp) / "pre.onnx", Path(tmp) / out.name
        quant_pre_process(args.float_model, str(pre))
        name = onnx.load(str(pre), load_external_data=False).graph.input[0].name

        ui.say(f"quantizing with ONNX Runtime: QDQ, static, {activation} activations"
               f"{' (symmetric)' if symmetric else ''}, int8 weights per {'tensor' if args.per_tensor else 'channel'}")
        quantize_static(
            str(pre), str(staged), CalibrationReader(batches, name), quant_format=QuantFormat.QDQ,
            activation_type=getattr(QuantType, activation), weight_type=QuantType.QInt8,
            per_channel=not args.per_tensor,
            extra_options={"ForceQuantizeNoInputCheck": True, "ActivationSymmetric": symmetric,
                           "WeightSymmetric": True},
        )
        model = ir.load(staged)
        written = write_kernel_shapes(model)  # TensorRT's parser needs it; nothing else changes
        ir.save(model, staged)
        verdict = check_file(staged, target.check_target)
        stats = qdq_stats(staged)
        kept = verdict.ok or args.keep_refused
        if kept:
            shutil.move(str(staged), out)
    result = {"version": 1, "input": args.float_model, "target": target.target, "path": str(out) if kept else None,
              "kernel_shape_written": written, "qdq_stats": stats.as_dict(), "check": verdict.as_dict()}
    ui.report(result, [
        ("file", f"{out} ({file_size(out) / 1e6:.2f} MB)" if kept else "nothing written (refused)"),
        ("Q / DQ nodes", f"{stats.n_quantize} / {stats.n_dequantize}, {stats.n_per_channel} per-channel, "
                         f"{stats.n_uint8} uint8"),
        (f"check {target.check_target}", common.verdict_line(verdict)),
    ])
    return 0 if verdict.ok else 1
