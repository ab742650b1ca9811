"""``quantship quantize-onnx FLOAT.onnx --method int8_weight_only|int4_weight_only``: weight-only from an ONNX file.

Every MatMul over a stored 2-D float weight becomes one com.microsoft ``MatMulNBits`` node
(``quantize_onnx.weight_only_file``): no calibration, the weights alone are read. ``--calib`` is optional and
only chooses what the file is read on (else inputs generated per input dtype and range). The report gives
the fidelity to the float file as written (``--accuracy-level``; by default 4, int8 activations, for INT8 and 0
for INT4) and at level 0 (float activations), and the speed against the float file on this CPU.
"""

from __future__ import annotations

import argparse

from quantship.cli import common
from quantship.cli import speed as speed_cli
from quantship.cli.usage import UsageError

METHODS = ("static", "int8_weight_only", "int4_weight_only")
BITS = {"int8_weight_only": 8, "int4_weight_only": 4}
# quantize-onnx options that shape calibrated activations or the static placement: nothing to act on here
STATIC_ONLY = (("--int16", "int16"), ("--shared-scale", "shared_scale"), ("--observer", "observer"),
               ("--per-tensor", "per_tensor"), ("--equalize", "equalize"), ("--bias-correction", "bias_correction"),
               ("--smooth-quant", "smooth_quant"), ("--seq-mse", "seq_mse"), ("--adaround", "adaround"),
               ("--max-drop", "max_drop"), ("--max-steps", "max_steps"), ("--keep-refused", "keep_refused"),
               ("--speed-search", "speed_search"), ("--plain-placement", "plain_placement"), ("--eval", "eval"),
               ("--exclude", "exclude"), ("--max-memory", "max_memory"), ("--fidelity-data", "fidelity_data"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """quantize-onnx's --method, and the weight-only options it brings."""
    parser.add_argument("--method", choices=METHODS, default="static",
                        help="static: Q/DQ INT8 (default, see --activations); int8_weight_only / int4_weight_only: "
                             "each weighted MatMul as com.microsoft MatMulNBits (no calibration)")
    parser.add_argument("--group-size", type=common.positive_int, default=None, metavar="G",
                        help="weight-only: weights per scale along K (default: the largest of 128/64/32 dividing "
                             "every weighted MatMul's K)")
    parser.add_argument("--accuracy-level", type=int, choices=range(5), default=None, metavar="{0..4}",
                        help="weight-only: MatMulNBits' accuracy_level (default: 4, int8 activations, for INT8, "
                             "whose level-0 kernel is far slower than FP32; 0, float activations, exact, for INT4; "
                             "see docs/weight-only.md)")


def refuse_combinations(args: argparse.Namespace) -> None:
    """One line, exit 2, before anything is read, for what the weight-only form cannot honour."""
    from quantship import targets  # the registry: data only

    if args.method == "static":
        given = [flag for flag, key in (("--group-size", "group_size"), ("--accuracy-level", "accuracy_level"))
                 if getattr(args, key) is not None]
        if given:
            verb, them = ("applies", "it") if len(given) == 1 else ("apply", "them")
            raise UsageError(f"{' and '.join(given)} {verb} to --method int8_weight_only / int4_weight_only: drop "
                             f"{them}, or give a weight-only --method")
        return
    if args.engine != "quantship" or args.activations != "static":
        raise UsageError(f"--method {args.method} is quantship's weight-only writer: drop "
                         + ("--engine ort" if args.engine != "quantship" else "--activations dynamic"))
    given = [flag for flag, key in STATIC_ONLY if getattr(args, key, None) not in (None, False, [])]
    if given:
        verb, them = ("acts", "it") if len(given) == 1 else ("act", "them")
        raise UsageError(f"{' and '.join(given)} {verb} on the static INT8 form; --method {args.method} stores the "
                         f"weights alone: drop {them}, or use --method static")
    if targets.get(args.target).weight_only_form is None:
        raise UsageError(f"--target {args.target} has no weight-only operator: --method {args.method} writes "
                         "com.microsoft MatMulNBits for --target onnxruntime-cpu")
    group = args.group_size
    if group is not None and (group < 16 or group & (group - 1)):
        raise UsageError(f"--group-size {group}: MatMulNBits needs a power of two, at least 16 (e.g. 32, 64, 128)")
    speed_cli.refuse(args)


def run(args: argparse.Namespace, out) -> int:
    """Read the file and the optional data, write the weight-only file, report (exit 0; 1: --require-faster missed)."""
    # late: --help answers before onnx, onnxruntime and numpy load
    from quantship.cli.onnx_input import read_feeds, read_float_file
    from quantship.errors import SpeedMissed
    from quantship.export.weight_only import default_accuracy_level
    from quantship.inspect.read.feeds import generated
    from quantship.inspect.read.loading import file_size
    from quantship.quantize_onnx.weight_only_file import choose_group, quantize_weight_only_file

    ui = common.Output(args)
    model, inputs = read_float_file(args.float_model)
    samples = read_feeds(args, inputs) if args.calib else generated(model, inputs=inputs).batches
    del model
    bits = BITS[args.method]
    group = args.group_size or choose_group(args.float_model)
    level = default_accuracy_level(bits) if args.accuracy_level is None else args.accuracy_level
    ui.say(f"quantizing with quantship: weight-only int{bits}, groups of {group} along K, MatMulNBits at "
           f"accuracy_level {level}; read on " + ("the --calib data" if args.calib else
                                                  "inputs generated per input dtype and range (no --calib)"))
    try:
        done = quantize_weight_only_file(args.float_model, out, samples, bits=bits, group=group,
                                         accuracy_level=level, speed=not args.no_speed,
                                         require_faster=args.require_faster, wait=not args.no_wait)
    except SpeedMissed as slower:
        return speed_cli.missed("quantize-onnx", ui, slower, {"version": 1, "input": args.float_model,
                                                              "method": args.method})
    size = file_size(done.path)
    speed_cli.warn("quantize-onnx", done.speed, args.quiet)
    report = {"version": 1, "input": args.float_model, "method": args.method, **done.as_dict(), "size_bytes": size,
              "data": "given" if args.calib else "generated"}
    kept = f"; kept float: {', '.join(done.kept_float)}" if done.kept_float else ""
    exact = done.exact if done.exact is not None else done.fp32
    ui.report(report, [
        *speed_cli.rows(done.speed),
        ("file", f"{done.path} ({size / 1e6:.2f} MB)"),
        ("form", f"{done.n_matmul_nbits} MatMulNBits, int{bits}, groups of {group}, accuracy_level {level}{kept}"),
        (f"vs FP32 (accuracy_level {level})", done.fp32.describe()),
        *([("vs FP32 (accuracy_level 0)", exact.describe())] if done.exact is not None else []),
    ])
    return 0
