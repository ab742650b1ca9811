"""``quantship quantize-onnx``: a float ONNX file to a QDQ INT8 file that passes a target's check.

quantship's own engine does the work (``quantship.quantize_onnx``): normalise (each pass proven in
ONNX Runtime), calibrate in ONNX Runtime with quantship's observers, place Q/DQ pairs where the
target's runtime runs integer kernels (or everywhere, for targets that need a fully integer graph),
then the post-conditions, the target's rules, both ONNX Runtime readings, the census of integer
kernels and the ``check --run`` verdict. ``--engine ort`` runs ONNX Runtime's ``quantize_static``
with the preset's settings instead, for comparison. Calibration: ``.npy`` (one input), ``.npz``
(one array per input, keyed by input name) of the dtype each input declares, or an image folder.
The file appears only when every check passes.
"""

from __future__ import annotations

import argparse

from quantship.cli import common
from quantship.cli.check import exit_code
from quantship.cli.usage import UsageError

ENGINES = ("quantship", "ort")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from quantship.precision import ACT_OBSERVERS  # late: every subcommand's parser is built for --help

    parser.add_argument("float_model", metavar="FLOAT.onnx", help="the float ONNX model to quantize")
    parser.add_argument("--out", required=True, help="the QDQ ONNX file to write")
    common.add_target_argument(parser, default="onnxruntime-cpu", help="deployment preset")
    parser.add_argument("--engine", choices=ENGINES, default="quantship",
                        help="quantship's own quantizer (default), or ONNX Runtime's quantize_static for comparison")
    parser.add_argument("--exclude", nargs="+", action="extend", default=[], metavar="NODE",
                        help="keep these nodes float: node names, name patterns (glob) or op types")
    parser.add_argument("--observer", choices=ACT_OBSERVERS, default=None,
                        help="activation range rule (default: the preset's, histogram)")
    parser.add_argument("--per-tensor", action="store_true", help="per-tensor weights (default per channel)")
    parser.add_argument("--equalize", action="store_true",
                        help="cross-layer equalization of Conv -> ReLU -> Conv pairs before calibration (data-free)")
    parser.add_argument("--bias-correction", action="store_true",
                        help="correct each quantized layer's bias for the shift of its output mean (on the calibration data)")
    parser.add_argument("--keep-refused", action="store_true",
                        help="--engine ort: keep the file even when the target's check refuses it")
    common.add_calibration_arguments(parser)
    common.add_writer_arguments(parser)
    common.add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.engine == "ort" and (args.equalize or args.bias_correction):
        flags = [f for f, on in (("--equalize", args.equalize), ("--bias-correction", args.bias_correction)) if on]
        raise UsageError(f"{' and '.join(flags)} run in quantship's engine only: drop --engine ort")
    with common.writing(args) as out:
        if args.engine == "ort":
            return _run_ort(args, out)
        return _run(args, out)


def _calibration(args: argparse.Namespace, inputs):
    """Checked calibration batches for the file's inputs (``.npy``/``.npz`` or an image folder)."""
    from pathlib import Path

    # late: `quantize-onnx --help` answers before onnx and numpy load
    from quantship.errors import DataRefused
    from quantship.quantize_onnx.data import feeds, read_arrays

    source = Path(args.calib)
    if source.is_dir():
        from quantship.cli.sources import load_images  # late: Pillow and torchvision's transforms

        if len(inputs) != 1 or inputs[0].dtype.kind != "f" or len(inputs[0].dims) != 4:
            raise DataRefused(f"--calib {args.calib} is an image folder, but the file's inputs are "
                              f"{[f'{i.name}: {i.describe()}' for i in inputs]}; image folders feed one N x C x H x W "
                              "float input: give a .npz keyed by input name")
        arrays = {inputs[0].name: load_images(args.calib, common.preprocessing(args), args.max_samples)}
    else:
        arrays = read_arrays(args.calib, inputs, args.key)
    return feeds(inputs, arrays, batch_size=args.batch_size, max_samples=args.max_samples, source=args.calib)


def _run(args: argparse.Namespace, out) -> int:
    # late: `quantize-onnx --help` answers before onnx, onnxruntime and torch load
    from quantship.inspect.loading import file_size, load_onnx
    from quantship.precision import preset
    from quantship.quantize_onnx.data import model_inputs
    from quantship.quantize_onnx.quantizer import placement_for, quantize_onnx_file, refuse_unusable

    ui = common.Output(args)
    target = preset(args.target)
    model = load_onnx(args.float_model)  # validates: exists, is ONNX, has a graph (one-line errors)
    refuse_unusable(model, args.float_model)  # already quantized, external data: refused before any work
    inputs = model_inputs(model)
    batches = _calibration(args, inputs)
    del model
    placement, _, _ = placement_for(target.target, per_tensor=args.per_tensor)
    n = sum(len(next(iter(b.values()))) for b in batches)
    ui.say(f"quantizing with quantship: {placement.mode} placement, {placement.activation_dtype} activations, "
           f"{len(batches)} calibration batch(es), {n} sample(s)")
    result = quantize_onnx_file(args.float_model, out, batches, target=target, exclude=args.exclude,
                                observer=args.observer, per_tensor=args.per_tensor, wait=not args.no_wait,
                                equalize=args.equalize, bias_correction=args.bias_correction)
    stats, verdict, census = result.qdq_stats, result.verdict, result.census
    size = file_size(result.path)
    report = {"version": 1, "input": args.float_model, "target": target.target, "engine": "quantship",
              **{k: v for k, v in result.as_dict().items() if k not in ("target", "engine")},
              "size_bytes": size}
    fused = result.fidelity["fused"]
    agreement = "" if fused["argmax_agreement"] is None else f"argmax agreement {fused['argmax_agreement']:.3f}, "
    passes = ", ".join(f"{p.name} {p.changes}" for p in result.normalised if p.changes) or "nothing to do"
    ui.report(report, [
        ("file", f"{result.path} ({size / 1e6:.2f} MB)"),
        ("normalised", passes),
        ("placement", f"{placement.mode}: {result.plan['n_tensors']} activation pairs, {result.plan['n_weighted']} "
                      f"weighted ops" + (f", {len(result.plan['kept_float'])} kept float for speed"
                                         if result.plan["kept_float"] else "")),
        ("Q / DQ nodes", f"{stats.n_quantize} / {stats.n_dequantize}, {stats.n_per_channel} per-channel, "
                         f"{stats.n_uint8} uint8"),
        ("ORT runs", f"{census['n_integer']} integer kernels ({_kernels(census['integer'])}), {census['n_float']} "
                     f"float Conv/MatMul/Gemm ({_kernels(census['float'])})"),
        ("vs FP32 (calibration data)", f"{agreement}max abs error {fused['max_abs_error']:.4g}"),
        ("ORT readings", f"{result.readings}" if result.readings.scale else
         f"literal vs fused max abs {result.fidelity['fused_vs_literal_max_abs']:.4g} (float outputs)"),
        *[(f"run {r.consumer}", str(r).split(": ", 1)[-1]) for r in verdict.runs],
        (f"check {target.target} --run", common.verdict_line(verdict)),
    ])
    return exit_code(verdict)  # 1 for refused, failed or inconclusive, as every command that writes a file


def _kernels(counts: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items()) or "none"


def _run_ort(args: argparse.Namespace, out) -> int:
    # late: `quantize-onnx --help` answers before onnx and onnxruntime load
    from quantship.export.ort_quantize import float_input, ort_settings, quantize_onnx_file, refuse_quantized
    from quantship.inspect.loading import file_size, load_onnx
    from quantship.precision import preset

    ui = common.Output(args)
    target = preset(args.target)
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
