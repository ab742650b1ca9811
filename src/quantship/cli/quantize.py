"""``quantship quantize``: a PyTorch model to a checked QDQ ONNX file for a deployment target."""

from __future__ import annotations

import argparse

from quantship.cli import common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="torchvision:NAME, timm:NAME, path/to/file.py:factory, or hf:reference|DIR|config.json")
    parser.add_argument("--weights", help="a state_dict (.pt) to load into MODEL")
    parser.add_argument("--out", required=True, help="the QDQ ONNX file to write")
    parser.add_argument("--target", default="onnxruntime-cpu",
                        help="deployment preset: onnxruntime-cpu (default), tensorrt, openvino, tigris")
    parser.add_argument("--backend", default="pt2e", help="quantization backend (only pt2e exports QDQ ONNX)")
    parser.add_argument("--qscheme", choices=["per_channel", "per_tensor"], help="weight granularity override")
    parser.add_argument("--opset", type=int, default=18, help="ONNX opset the file must declare (17 or 18)")
    parser.add_argument("--method", default="static", choices=["static", "int8_weight_only", "int4_weight_only"],
                        help="static W8A8 (pt2e, default), or torchao weight-only W8A16 / W4A16 (no calibration)")
    parser.add_argument("--group-size", type=int, help="weight-only: weights per scale (default: int4 takes the "
                        "largest of 128/64/32 dividing every Linear layer; int8 one scale per output channel)")
    parser.add_argument("--seq-len", type=int, default=128, help="weight-only hf: models: tokens in the traced sample")
    common.add_calibration_arguments(parser)
    for action in parser._actions:  # weight-only needs no calibration; the static path still insists below
        if action.dest == "calib":
            action.required = False
    common.add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import warnings

    import torch

    from quantship import Quantizer, quant_spec
    from quantship.cli.main import UsageError
    from quantship.cli.sources import load_model
    from quantship.export import export_qdq
    from quantship.inspect.check import check_file
    from quantship.inspect.loading import file_size
    from quantship.inspect.stats import qdq_stats
    from quantship.inspect.verify import compare_logits
    from quantship.precision import preset

    if args.method != "static":
        from quantship.cli import quantize_weight_only

        return quantize_weight_only.run(args)
    if not args.calib:
        raise UsageError("--calib is required for static W8A8 quantization")
    ui = common.Output(args)
    target = preset(args.target)  # unknown target -> ValueError -> exit 2
    if args.backend != "pt2e":
        raise UsageError(f"--backend {args.backend}: only pt2e produces a QDQ ONNX file; FX and torchao "
                         "models stay in PyTorch (use the Python API for them)")
    if args.opset not in (17, 18):
        raise UsageError(f"--opset {args.opset}: quantship writes opset 17 or 18")
    model = load_model(args.model, args.weights)
    batches = [torch.from_numpy(b) for b in common.read_calibration(args)]
    ui.say(f"calibration: {len(batches)} batch(es) of {batches[0].shape[0]} from {args.calib}")
    overrides = {"qscheme": args.qscheme} if args.qscheme else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantizer = Quantizer.for_target(target.target, verbose=ui.verbose, **overrides)
        qmodel = quantizer.quantize(model, batches, max_calibration_samples=args.max_samples)
        path = export_qdq(qmodel, batches[0], args.out, target=target.target, opset_version=args.opset)
        error = compare_logits(qmodel, path, batches[0])
    stats = qdq_stats(path)
    size = file_size(path)
    verdict = check_file(path, target.check_target)
    result = {
        "version": 1, "model": args.model, "target": target.target, "path": str(path),
        "spec": quant_spec(qmodel).as_dict(), "label": quant_spec(qmodel).label,
        "size_bytes": size, "qdq_stats": stats.as_dict(),
        "logit_error_vs_torch": error.as_dict(), "check": verdict.as_dict(),
    }
    ui.report(result, [
        ("file", f"{path} ({size / 1e6:.2f} MB)"),
        ("precision", f"{result['label']} {target.target} preset ({target.activation_dtype} activations)"),
        ("Q / DQ nodes", f"{stats.n_quantize} / {stats.n_dequantize}, {stats.n_per_channel} per-channel, "
                         f"{stats.n_nonzero_zero_point} non-zero zero-points, {stats.n_uint8} uint8"),
        ("ORT vs torch INT8", str(error)),
        (f"check {target.check_target}", common.verdict_line(verdict)),
    ])
    return 0 if verdict.ok else 1
