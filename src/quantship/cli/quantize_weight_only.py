"""``quantship quantize --method int8_weight_only|int4_weight_only``: torchao weight-only to ONNX.

No calibration: the weights alone are quantized. The file is MatMulNBits for ONNX Runtime
(``--weight-format matmulnbits``, the default) or the standard DequantizeLinear form
(``--weight-format standard``). ``--gptq`` (int4): weights rounded by GPTQ on the ``--calib``
batches (token ids for an ``hf:`` model) instead of to nearest.
"""

from __future__ import annotations

import argparse

from quantship import targets
from quantship.cli import common, quantize_decoder
from quantship.cli import speed as speed_cli
from quantship.cli.usage import UsageError
from quantship.errors import SpeedMissed

WEIGHT_ONLY_METHODS = ("int8_weight_only", "int4_weight_only")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The weight-only options ``quantship quantize`` adds to its own (and --seq-len, which static hf: takes too)."""
    parser.add_argument("--method", default="static", choices=["static", "int8_weight_only", "int4_weight_only"],
                        help="static W8A8 (pt2e, default), or torchao weight-only W8A16 / W4A16 (no calibration)")
    parser.add_argument("--group-size", type=int, help="weight-only: weights per scale (default: int4 takes the "
                        "largest of 128/64/32 dividing every Linear layer; int8 one scale per output channel)")
    parser.add_argument("--weight-format", choices=["matmulnbits", "standard"], default="matmulnbits",
                        help="weight-only file form: com.microsoft MatMulNBits for ONNX Runtime (default), or "
                             "standard int8/int4 + DequantizeLinear (opset 21)")
    parser.add_argument("--seq-len", type=int, default=128,
                        help="hf: models: tokens per sample without --calib (static: generated ids; weight-only: "
                             "the traced sample)")
    parser.add_argument("--embedding", choices=["quantized", "float"], default=None,
                        help="weight-only hf: models: the token embedding table stored in the weights' bits "
                             "(GatherBlockQuantized / DequantizeLinear; a tied LM head reads the same table) or "
                             "float (default: quantized for int8, float for int4, as measured in docs/decoder.md)")
    parser.add_argument("--gptq", action="store_true",
                        help="int4_weight_only: round the weights with GPTQ on the --calib batches (token ids "
                             "[N, T] for an hf: model) instead of to nearest")
    quantize_decoder.add_arguments(parser)


def check_request(args: argparse.Namespace) -> None:
    """Refuse --gptq and --decoder where they do not apply, before any model or data work."""
    quantize_decoder.check_request(args)
    if getattr(args, "embedding", None) and args.method not in WEIGHT_ONLY_METHODS:
        raise UsageError(f"--embedding applies to --method int8_weight_only or int4_weight_only, not --method "
                         f"{args.method}; drop --embedding")
    if getattr(args, "plain_placement", False) and args.method != "static":
        raise UsageError(f"--plain-placement skips the static file's placement by profile; --method {args.method} "
                         "places no activation: drop --plain-placement")
    if getattr(args, "gptq", False):
        if args.method != "int4_weight_only":
            raise UsageError(f"--gptq applies to --method int4_weight_only (grouped int4 weights), not --method "
                             f"{args.method}; drop --gptq or use --method int4_weight_only")
        if not args.calib:
            raise UsageError("--gptq needs --calib: the calibration inputs (token ids [N, T] as .npy for an hf: "
                             "model) whose Hessians GPTQ rounds the weights against")


def gptq_batches(model, args: argparse.Namespace) -> list:
    """The --calib batches as torch tensors, for GPTQ, read as ``quantize`` reads them (token ids for an hf: model:
    a .npy, or an .npz keyed by the forward's argument name)."""
    # imported when the command runs (torch, numpy behind these), so --help answers at once
    from quantship.export.torch_file import read_calibration

    return read_calibration(model, args.calib, batch_size=args.batch_size, max_samples=args.max_samples, key=args.key,
                            preprocessing=common.preprocessing(args), judged=False).batches


def sample_for(model, args: argparse.Namespace):
    """The export sample: token ids [1, --seq-len] for a language model, else the first --calib batch."""
    import torch


    if args.model.startswith("hf:"):
        vocab = int(model.lm.config.vocab_size)
        text = b"def main():\n    return 0\n" * (args.seq_len // 8 + 1)
        ids = [b % vocab for b in text[:args.seq_len]]
        return torch.tensor([ids], dtype=torch.long)
    if not args.calib:
        raise UsageError("--calib is needed for a non-language model: the file is traced on its first batch")
    return torch.from_numpy(common.read_calibration(args)[0])


def choose_group_size(model, method: str, given: int | None, ui: common.Output) -> int | None:
    """The group size: as given, else int4's largest of 128/64/32 dividing every Linear layer (said aloud)."""
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    from quantship.quantize.torchao_backend import GROUP_SIZES, auto_group_size, linear_layers

    if given is not None or method != "int4_weight_only":
        return given
    chosen = auto_group_size(model)
    widths = sorted({m.in_features for m in linear_layers(model).values()})
    if chosen is None:
        raise UsageError(f"no group size of {'/'.join(map(str, GROUP_SIZES))} divides every Linear layer's input "
                         f"features {widths}; give --group-size (a power of two dividing them)")
    ui.say(f"group size: {chosen} (the largest of {'/'.join(map(str, GROUP_SIZES))} dividing every Linear "
           f"layer's in_features {widths})")
    return chosen


LM_TIMING_BATCH = 4  # an hf: model's file is timed at batch 1 and this many rows of --seq-len tokens


def run(args: argparse.Namespace) -> int:
    if args.decoder:  # a decoder file for generation (KV cache, dynamic lengths): its own writer
        return quantize_decoder.run(args, choose_group_size, gptq_batches)
    ui = common.Output(args)
    try:
        return _write_and_report(args, ui)
    except SpeedMissed as slower:
        return speed_cli.missed("quantize", ui, slower, {"version": 1, "model": args.model, "method": args.method})


def accuracy_level(args: argparse.Namespace, nbits_form: bool) -> int | None:
    """--accuracy-level, else the MatMulNBits form's default for its bits (``default_accuracy_level``: 4 for INT8,
    0 for INT4); the standard form has no such attribute (None)."""
    # imported when the command runs (onnx behind it), so --help answers at once
    from quantship.export.weight_only import default_accuracy_level

    if not nbits_form:
        return None
    if args.accuracy_level is not None:
        return args.accuracy_level
    return default_accuracy_level(8 if args.method == "int8_weight_only" else 4)


def _write_and_report(args: argparse.Namespace, ui: common.Output) -> int:
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    import warnings

    import onnx

    from quantship import Quantizer, quant_spec
    from quantship.export import speed_gate
    from quantship.export.weight_only import export_weight_only, speed_hint
    from quantship.inspect.read.loading import file_size
    from quantship.inspect.run.outputs import output_arrays
    from quantship.inspect.run.weight_only import (
        ACCURACY_OPTION,
        DEFAULT,
        EXACT,
        READINGS,
        read_both,
        run_reading,
        without_accuracy_level,
        worst_relative_error,
    )
    from quantship.sources import load_model

    chosen = targets.get(args.target or "onnxruntime-cpu")  # the runtime with a weight-only operator
    if chosen.weight_only_form is None:
        raise UsageError(f"--target {args.target}: a weight-only file is written for onnxruntime-cpu; choose its form "
                         "with --weight-format matmulnbits (default) or standard (int8/int4 + DequantizeLinear, opset 21)")
    target = chosen if args.weight_format == "matmulnbits" else None
    if args.qscheme:
        raise UsageError("--qscheme is for pt2e; weight-only granularity is per channel, or per group with --group-size")
    level = accuracy_level(args, target is not None)
    model = load_model(args.model, args.weights)
    group = choose_group_size(model, args.method, args.group_size, ui)
    kwargs = {"group_size": group, **quantize_decoder.embedding_request(args)}
    if args.method == "int8_weight_only" and group is not None:
        kwargs["qscheme"] = "per_group"
    sample = sample_for(model, args)
    calibration = None
    if args.gptq:
        kwargs["weight_algorithm"] = "gptq"
        calibration = gptq_batches(model, args)
    form = "MatMulNBits" if target else "int + DequantizeLinear (opset 21)"
    timed: dict = {}
    batches = (1, LM_TIMING_BATCH if args.model.startswith("hf:") else len(sample))

    def time_it(staged, float_file) -> None:  # the checked file against its float export, before it is moved into place
        first = onnx.load(str(float_file), load_external_data=False).graph.input[0].name
        timed["speed"] = speed_gate.gate(staged, float_file, {first: sample.numpy()}, batches,
                                         require_faster=args.require_faster, hint=speed_hint(level))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = Quantizer("torchao", method=args.method, verbose=ui.verbose, **kwargs).quantize(
            model, calibration, max_calibration_samples=args.max_samples)
        spec = quant_spec(qmodel)
        path = export_weight_only(qmodel, sample, args.out, spec, target=target, dynamic_batch=True,
                                  accuracy_level=level,
                                  before_commit=None if args.no_speed else time_it)
        _, expected = output_arrays(qmodel, [sample])
    # both ways ONNX Runtime reads the file: the standard form in a default session (it fuses DequantizeLinear +
    # MatMul into MatMulNBits with int8 activations) and with float activations; the MatMulNBits form at the level
    # its nodes carry, and at level 0 (float activations: the arithmetic the file stores, held to 2e-3 of torch)
    feeds = [{onnx.load(str(path), load_external_data=False).graph.input[0].name: sample.numpy()}]
    if target is None:
        outputs = read_both(path, feeds)
    else:
        outputs = {DEFAULT.name: run_reading(path, feeds, DEFAULT),
                   EXACT.name: run_reading(without_accuracy_level(path), feeds, DEFAULT)}
    errors = {name: worst_relative_error(got, [expected]) for name, got in outputs.items()}
    size = file_size(path)
    if target is not None:
        form += f", accuracy_level {level}"
    nbits_options = {DEFAULT.name: {"accuracy_level": level}, EXACT.name: {"accuracy_level": 0}}
    readings = [{"reading": r.name, "session_options": dict(r.options) if target is None else {},
                 **({"file_as": nbits_options[r.name]} if target is not None else {}),
                 "relative_error_vs_torch": errors[r.name]} for r in READINGS]
    speed = timed.get("speed")
    result = {
        "version": 1, "model": args.model, "target": target.target if target else "standard", "path": args.out, "spec": spec.as_dict(),
        "label": spec.label, "size_bytes": size, "form": form, "accuracy_level": level, "readings": readings,
        "relative_error_vs_torch": errors[DEFAULT.name], "relative_error_vs_torch_float_activations": errors[EXACT.name],
        "speed": speed.as_dict() if speed is not None else None,
    }
    granularity = f"groups of {spec.group_size}" if spec.qscheme == "per_group" else "per output channel"
    if spec.weight_algorithm == "gptq":
        granularity += f", rounded by GPTQ on {sum(len(b) for b in calibration)} calibration samples"
    if target is None:
        why = {DEFAULT.name: f"{ACCURACY_OPTION} unset: 4; ORT fuses DequantizeLinear + MatMul into MatMulNBits with "
                             "int8 activations",
               EXACT.name: f"{ACCURACY_OPTION}=0; float activations"}
    else:
        why = {DEFAULT.name: f"the file as written: accuracy_level {level}" + (
                   "; int8 activations" if level == 4 else "; float activations" if level == 0 else ""),
               EXACT.name: "the same file at accuracy_level 0: float activations, the stored arithmetic"}
    speed_cli.warn("quantize", speed, args.quiet)
    ui.report(result, [
        *speed_cli.rows(speed),
        ("file", f"{args.out} ({size / 1e6:.2f} MB)"),
        ("precision", f"{spec.label} {spec.method}, {granularity}"),
        ("form", form),
        *([quantize_decoder.embedding_row(spec, target is not None)] if args.model.startswith("hf:") else []),
        ("ORT vs torch", f"max |difference| / max |output| on a sample of shape {tuple(sample.shape)}, in two readings:"),
    ] + [(f"  {r.name} session", f"{errors[r.name]:.2e} ({why[r.name]})") for r in READINGS])
    return 0
