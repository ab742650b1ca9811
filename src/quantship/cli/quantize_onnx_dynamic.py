"""``quantship quantize-onnx --activations dynamic``: the dynamic-activation form (``quantize_onnx.dynamic``).

Int8 per-column weights stored in the file, each MatMul/Gemm's activation quantized at run time, nothing
else quantized: the form ONNX Runtime serves a transformer fastest in at batch 1. Data-free: ``--calib``
is optional and only chooses what the file is read on (else generated inputs). Options that shape
static activations (calibration algorithms, 16-bit activations, observers) and targets without a run-time
quantization kernel are refused in one line before anything is read.
"""

from __future__ import annotations

import argparse

from quantship.cli import common
from quantship.cli.check import exit_code
from quantship.cli.onnx_input import read_feeds, read_float_file
from quantship.cli.quantize_onnx_eval import labelled as read_labelled
from quantship.cli.quantize_onnx_eval import top1_of
from quantship.cli.usage import UsageError

# options of the static form that have nothing to act on here: no calibrated activation scale exists
STATIC_ONLY = (("--int16", "int16"), ("--shared-scale", "shared_scale"), ("--observer", "observer"),
               ("--equalize", "equalize"), ("--bias-correction", "bias_correction"),
               ("--smooth-quant", "smooth_quant"), ("--seq-mse", "seq_mse"), ("--adaround", "adaround"),
               ("--max-drop", "max_drop"), ("--max-steps", "max_steps"), ("--keep-refused", "keep_refused"))


def refuse_combinations(args: argparse.Namespace) -> None:
    """One line, exit 2, nothing read or written, for what the dynamic form cannot honour."""
    from quantship.quantize_onnx.dynamic_file import refuse_target  # late: loads onnx

    if args.engine != "quantship":
        raise UsageError("--activations dynamic is quantship's engine: drop --engine ort (ONNX Runtime's own is "
                         "quantize_dynamic)")
    given = [flag for flag, key in STATIC_ONLY if getattr(args, key) not in (None, False, [])]
    if given:
        verb, them = ("acts", "it") if len(given) == 1 else ("act", "them")
        raise UsageError(f"{' and '.join(given)} {verb} on calibrated static activations; --activations dynamic "
                         f"has none: drop {them}, or use --activations static")
    refuse_target(args.target)


def quantize(args: argparse.Namespace, out, batches):
    """Write the dynamic file (``batches``: the --calib feeds it is read on, or None: generated inputs)."""
    from quantship.quantize_onnx.dynamic_file import quantize_dynamic_file  # late: loads onnxruntime

    common.Output(args).say("quantizing with quantship: dynamic activations (quantized at run time), int8 "
                            f"{'per-tensor' if args.per_tensor else 'per-column'} weights; read on "
                            + ("the --calib data" if batches else "inputs generated per input dtype and range (no --calib)"))
    return quantize_dynamic_file(args.float_model, out, batches, target=args.target, exclude=args.exclude,
                                 per_tensor=args.per_tensor, wait=not args.no_wait)


def _kernels(counts: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items()) or "none"


def report(args: argparse.Namespace, result, accuracy: dict) -> int:
    """The report (text or --json) of a written dynamic file; the exit code of its check."""
    from quantship.inspect.read.loading import file_size  # late: loads onnx

    ui = common.Output(args)
    size = file_size(result.path)
    report = {"version": 1, "input": args.float_model, **result.as_dict(), "size_bytes": size}
    if accuracy:
        report["accuracy"] = {"float_file_ort": accuracy["float"].as_dict(), "int8_file_ort": accuracy["int8"].as_dict()}
    census, plan, fused = result.census, result.plan, result.fidelity["fused"]
    first = next(iter(result.sqnr_db.values()), None)
    agreement = "" if fused["argmax_agreement"] is None else f"argmax agreement {fused['argmax_agreement']:.3f}, "
    passes = ", ".join(f"{p.name} {p.changes}" for p in result.normalised if p.changes) or "nothing to do"
    kept = f", {len(plan.kept_float)} MatMul/Gemm kept float" if plan.kept_float else ""
    ui.report(report, [
        ("file", f"{result.path} ({size / 1e6:.2f} MB)"),
        ("normalised", passes),
        ("form", f"dynamic: {len(plan.layers)} MatMul/Gemm with int8 weights (+-{result.weights['bound']} "
                 f"{'per output column' if result.weights['qscheme'] == 'per_channel' else 'per tensor'}), {plan.n_quantize_nodes} DynamicQuantizeLinear{kept}"
                 + (f", {len(plan.tables)} table(s) read in 8 bits" if plan.tables else "") + "; no QuantizeLinear"),
        ("ORT runs", f"{census['n_integer']} of {result.n_matmul_gemm} MatMul/Gemm as integer kernels "
                     f"({_kernels(census['integer'])}), {census['n_float']} float ({_kernels(census['float'])})"),
        (f"vs FP32 ({result.inputs} inputs)", f"{agreement}max abs error {fused['max_abs_error']:.4g}"
         + (f", SQNR {first['fused']:.1f} dB" if first else "") + " (float outputs: no LSB)"),
        ("ORT readings", f"literal vs fused max abs {result.fidelity['fused_vs_literal_max_abs']:.4g}"
         + (f"; SQNR literal {first['literal']:.1f} dB, fused {first['fused']:.1f} dB" if first else "")),
        *([("top-1 float file (ORT)", accuracy["float"].describe()),
           ("top-1 INT8 file (ORT)", accuracy["int8"].describe())] if accuracy else []),
        *[(f"run {r.consumer}", str(r).split(": ", 1)[-1]) for r in result.verdict.runs],
        (f"check {result.target} --run", common.verdict_line(result.verdict)),
    ])
    return exit_code(result.verdict)


def run(args: argparse.Namespace, out) -> int:
    """``--activations dynamic``: the data is read here (optional), the rest is ``quantize_onnx_dynamic``'s."""
    # late: --help answers before onnx, onnxruntime and numpy load
    model, inputs = read_float_file(args.float_model)
    del model
    batches = read_feeds(args, inputs) if args.calib else None
    labelled = read_labelled(args, inputs)
    result = quantize(args, out, batches)
    return report(args, result, top1_of(args, labelled, result.path) if labelled is not None else {})
