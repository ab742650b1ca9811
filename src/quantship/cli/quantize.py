"""``quantship quantize``: a PyTorch model to a checked QDQ ONNX file for a deployment target.

The file is first held to the float model (``export.judged``: its fidelity to FP32 on inputs held out
from calibration, repaired by the same loop as quantize-onnx when it misses the budget; nothing is
written, exit 1, when no step keeps it). The summary's verdict is ``quantship check FILE --target T
--run``'s, on the calibration inputs: the target's rules, then its consumer run on the file wherever
it is installed here (ONNX Runtime, OpenVINO, TiGrIS). Exit code 0: accepted; 1: failed or
inconclusive (the file is written), or no file kept the fidelity budget (nothing written); 2: bad
input, or a refusal (the export refuses a file the target's rules would not accept, and writes
nothing).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from quantship import targets
from quantship.cli import common, options, quantize_weight_only
from quantship.cli import fidelity as fidelity_cli
from quantship.cli import speed as speed_cli
from quantship.cli.check import exit_code
from quantship.cli.usage import UsageError
from quantship.errors import DataRefused, FidelityMissed, SpeedMissed, cause
from quantship.progress import step
from quantship.targets import Target

DEFAULT_TARGET = "onnxruntime-cpu"  # without --target and without one in the --config file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser, hf=True)
    parser.add_argument("--out", required=True, help="the QDQ ONNX file to write")
    common.add_target_argument(parser, default=None, required=False,
                               help=f"deployment preset (default: the --config file's target, else {DEFAULT_TARGET})")
    parser.add_argument("--backend", default="pt2e", help="quantization backend (only pt2e exports QDQ ONNX)")
    parser.add_argument("--qscheme", choices=["per_channel", "per_tensor"], help="weight granularity override")
    parser.add_argument("--opset", type=int, default=18, help="ONNX opset of the INT8 file: 17 or 18 (default 18; the float file of export-onnx may go higher)")
    parser.add_argument("--static-batch", type=int, metavar="N",
                        help="write a file fixed at batch N (default: the file serves any batch; tigris: batch 1)")
    parser.add_argument("--eval", metavar="LABELLED",
                        help="labelled data (.npz with x and y, or a folder of class folders): top-1 of FP32, "
                             "INT8 torch and the INT8 file in ONNX Runtime, with Wilson 95%% intervals")
    options.add_quantizer_arguments(parser)
    parser.add_argument("--method", default="static", choices=["static", "int8_weight_only", "int4_weight_only"],
                        help="static W8A8 (pt2e, default), or torchao weight-only W8A16 / W4A16 (no calibration)")
    parser.add_argument("--group-size", type=int, help="weight-only: weights per scale (default: int4 takes the "
                        "largest of 128/64/32 dividing every Linear layer; int8 one scale per output channel)")
    parser.add_argument("--weight-format", choices=["matmulnbits", "standard"], default="matmulnbits",
                        help="weight-only file form: com.microsoft MatMulNBits for ONNX Runtime (default), or "
                             "standard int8/int4 + DequantizeLinear (opset 21)")
    parser.add_argument("--seq-len", type=int, default=128, help="weight-only hf: models: tokens in the traced sample")
    quantize_weight_only.add_arguments(parser)
    common.add_calibration_arguments(parser)
    for action in parser._actions:  # weight-only needs no calibration; the static path still insists below
        if action.dest == "calib":
            action.required = False
    parser.add_argument("--max-steps", type=int, default=None, metavar="N",
                        help="at most N fidelity repair steps (default: every step)")
    fidelity_cli.add_arguments(parser)
    speed_cli.add_arguments(parser)
    common.add_writer_arguments(parser)
    common.add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    quantize_weight_only.check_request(args)  # before the --out lock and any import
    speed_cli.refuse(args, not_timed=f"--method {args.method}" if args.method != "static" else None)
    with common.writing(args) as out:  # the --out lock is held to the end: the report reads the file this run wrote
        with step("quantize: importing torch, torchao and the exporter"):  # seconds before anything else shows
            import torch  # noqa: F401
            import torchao.quantization.pt2e  # noqa: F401

            import quantship.export.qdq  # noqa: F401
        if args.method != "static":  # torchao weight-only (W8A16 / W4A16): no calibration, its own writer
            return quantize_weight_only.run(args)
        return _static(args, out)


@dataclass
class _Run:
    """What one static run has in hand, step by step: the request, the data, the model and the file."""

    args: argparse.Namespace
    ui: common.Output
    target: Target
    overrides: dict[str, Any]
    model: Any = None
    batches: list = field(default_factory=list)
    labelled: Any = None  # the --eval data (x, y), and the same cut into calibration-sized batches
    labelled_batches: list | None = None
    quantizer: Any = None
    qmodel: Any = None
    path: Any = None  # the written file (a MeasuredPath: it carries the export's ORT readings)
    served: int | None = None  # the file's static batch, None when it serves any batch
    error: Any = None  # ORT vs torch INT8 on the first output
    held: list | None = None  # inputs held out from calibration, fidelity to FP32 is judged on
    held_label: str = ""
    judged: Any = None  # export.judged.Judged: the file's fidelity to FP32 and the repair


def _static(args: argparse.Namespace, out) -> int:
    """Static W8A8: refuse bad options, read the model and data, quantize and export, then report."""
    run = _request(args)
    _read_model_and_data(run)
    sample, dynamic = _export_sample(run.batches, args.static_batch)
    _read_labelled(run)
    try:
        _quantize_and_export(run, out, sample, dynamic)
    except FidelityMissed as missed:
        return fidelity_cli.missed("quantize", run.ui, missed, {"version": 1, "model": args.model,
                                                                "target": run.target.target})
    except SpeedMissed as slower:
        return speed_cli.missed("quantize", run.ui, slower, {"version": 1, "model": args.model,
                                                             "target": run.target.target})
    return _report(run)


def _request(args: argparse.Namespace) -> _Run:
    """The options, refused before any model or data work; the target resolved once, here."""
    if not args.calib:
        raise UsageError("--calib is required for static W8A8 quantization")
    ui = common.Output(args)
    config = options.read_config(args.config)
    target = targets.get(args.target or config.get("target") or DEFAULT_TARGET)
    overrides = options.quantizer_options(args, config)  # option refusals come before any model or data work
    if args.backend != "pt2e":
        raise UsageError(f"--backend {args.backend}: only pt2e produces a QDQ ONNX file; FX and torchao "
                         "models stay in PyTorch (use the Python API for them)")
    if args.opset not in (17, 18):
        raise UsageError(f"--opset {args.opset}: quantship writes opset 17 or 18")
    if args.static_batch is not None and args.static_batch < 1:
        raise UsageError(f"--static-batch {args.static_batch} must be at least 1")
    if args.max_steps is not None and args.max_steps < 0:
        raise UsageError("--max-steps N bounds the fidelity repair: give N >= 0")
    if args.fidelity_data and args.no_fidelity:
        raise UsageError("--fidelity-data is the data fidelity is judged on: drop it or --no-fidelity")
    args.budget = fidelity_cli.budget(args)  # a bound out of range: one line, exit 2, before any work
    speed_cli.refuse(args, target)
    return _Run(args, ui, target, overrides)


def _read_model_and_data(run: _Run) -> None:
    """The model and the calibration batches; a model that cannot run on the data is bad input, found
    before any quantization."""
    # imported when the command runs (torch, numpy behind these), so --help answers at once
    import torch

    from quantship.cli.sources import load_model

    args = run.args
    with step(f"quantize: loading {args.model}"):
        run.model = load_model(args.model, args.weights, trust_pickle=args.trust_pickle)
    with step(f"quantize: reading {args.calib}"):
        run.batches, run.held, run.held_label = _calibration_and_held_out(args)
    with torch.no_grad():
        try:
            run.model(run.batches[0])
        except Exception as exc:
            raise DataRefused(f"{args.model} cannot run on a calibration batch of shape "
                              f"{list(run.batches[0].shape)}: {cause(exc)}") from None
    run.ui.say(f"calibration: {sum(len(b) for b in run.batches)} sample(s) in {len(run.batches)} batch(es) of up "
               f"to {args.batch_size} from {args.calib}")


def _calibration_and_held_out(args: argparse.Namespace) -> tuple[list, list | None, str]:
    """Calibration batches (torch), the batches fidelity is judged on (``--fidelity-data``, else held out of
    --calib: ``fidelity.split_held_out``) and a line saying which."""
    import numpy as np
    import torch

    from quantship.cli.sources import read_calibration  # numpy and Pillow: loaded when data is read

    def batches(x: np.ndarray) -> list:
        return [torch.from_numpy(x[i:i + args.batch_size]) for i in range(0, len(x), args.batch_size)]

    if args.fidelity_data:
        held = read_calibration(args.fidelity_data, key=args.key, prep=common.preprocessing(args),
                                batch_size=args.batch_size, max_samples=fidelity_cli.HELD_OUT_MAX, keep_last=True)
        return ([torch.from_numpy(b) for b in common.read_calibration(args, keep_last=True)],
                [torch.from_numpy(b) for b in held], f"sample(s) of --fidelity-data {args.fidelity_data}")
    if args.no_fidelity:
        return [torch.from_numpy(b) for b in common.read_calibration(args, keep_last=True)], None, ""
    read = read_calibration(args.calib, key=args.key, prep=common.preprocessing(args), batch_size=args.batch_size,
                            max_samples=args.max_samples + fidelity_cli.HELD_OUT_MAX, keep_last=True)
    calib, held, said = fidelity_cli.split_held_out({"x": np.concatenate(read)}, args.max_samples,
                                                    args.static_batch or 1)  # whole batches of a fixed-batch file
    return batches(calib["x"]), (batches(held["x"]) if held is not None else None), f"sample(s): {said}"


def _read_labelled(run: _Run) -> None:
    """``--eval``: the labelled data, and the same cut into batches of the calibration batch size."""
    if not run.args.eval:
        return
    # imported when the command runs (torch, numpy behind these), so --help answers at once
    import torch

    from quantship.cli.labelled import read_labelled

    run.labelled = labelled = read_labelled(run.args.eval, common.preprocessing(run.args))
    bs = run.batches[0].shape[0]
    run.labelled_batches = [(torch.from_numpy(labelled.x[i:i + bs]), torch.from_numpy(labelled.y[i:i + bs]))
                            for i in range(0, (len(labelled.y) // bs) * bs, bs)]


def _quantize_and_export(run: _Run, out, sample, dynamic: bool | None) -> None:
    """Quantize for the target and write the checked file; warnings measured on the file are said."""
    # imported when the command runs (torch, onnx behind these), so --help answers at once
    import warnings

    from quantship import Quantizer
    from quantship.export.judged import quantize_export_judged
    from quantship.inspect.run.verify import FusedKernelDrift

    args, ui = run.args, run.ui
    searching = run.overrides.get("max_accuracy_drop") is not None  # the labelled search decides instead
    if not args.no_fidelity:
        ui.say(f"fidelity to FP32 judged on {run.held_label or 'calibration samples (none held out)'}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", FusedKernelDrift)  # measured on the file: the user hears it
        run.judged = quantize_export_judged(
            run.model, run.batches, sample, out, target=run.target, overrides=run.overrides, held=run.held,
            held_label=run.held_label, budget=None if searching else args.budget,
            make_quantizer=lambda target, **kw: Quantizer.for_target(target, verbose=ui.verbose, **kw),
            quantize_kwargs={"max_calibration_samples": args.max_samples,
                             "labelled_data": run.labelled_batches if searching else None},
            export_kwargs={"opset_version": args.opset, "dynamic_batch": dynamic},
            repair=not args.no_repair, max_steps=args.max_steps, log=ui.say, speed=not args.no_speed,
            require_faster=args.require_faster)
        run.quantizer, run.qmodel, run.path = run.judged.quantizer, run.judged.qmodel, run.judged.path
        run.served = _file_batch(run.path)
        run.error = _output_error(run.qmodel, run.path, sample if run.served is None else sample[:run.served])
    for warning in caught:
        ui.say(f"warning: {warning.message}")


def _report(run: _Run) -> int:
    """The file read back and checked as ``quantship check --run`` would, printed as one table or JSON."""
    # imported when the command runs (onnx, numpy behind these), so --help answers at once
    import numpy as np

    from quantship import quant_spec
    from quantship.cli.sources import weights_origin
    from quantship.inspect.judge.check import check_file
    from quantship.inspect.read.facts import read_file
    from quantship.inspect.read.float_ops import describe_float_ops
    from quantship.inspect.read.loading import file_size

    args, target, path, served, error = run.args, run.target, run.path, run.served, run.error
    spec = quant_spec(run.qmodel)
    facts = read_file(path)
    stats = facts.stats
    size = file_size(path)
    # every --calib sample (calibration and held out): real inputs for the run
    real = np.concatenate([b.numpy() for b in [*run.batches, *(run.held or [])]])
    verdict = check_file(path, target, run=True, inputs=real)
    readings = path.readings
    weights = weights_origin(args.model, args.weights)
    result = {
        "version": 1, "model": args.model, "weights": weights, "target": target.target, "path": args.out,
        "spec": spec.as_dict(), "label": spec.label,
        "size_bytes": size, "batch": "any" if served is None else served, "qdq_stats": stats.as_dict(),
        "logit_error_vs_torch": error if isinstance(error, dict) else error.as_dict(),
        "ort_readings": readings.as_dict() if readings else None,
        "verdict": verdict.verdict, "check": verdict.as_dict(),
        "fidelity_fp32": run.judged.fidelity.as_dict(),
        "repair": run.judged.repair.as_dict() if run.judged.repair is not None else None,
        "speed": run.judged.speed.as_dict() if run.judged.speed is not None else None,
    }
    result["float_ops"] = left_float = _left_float(run.quantizer, facts)
    del facts
    rows_eval = _accuracy_rows(run, result)
    speed_cli.warn("quantize", run.judged.speed, run.args.quiet)
    rows = [
        *fidelity_cli.rows(run.judged.fidelity, run.judged.repair),  # first: does the file still do the job
        *speed_cli.rows(run.judged.speed),
        ("file", f"{args.out} ({size / 1e6:.2f} MB)"),
        ("weights", weights),
        ("precision", f"{result['label']} {target.target} preset ({target.activation_dtype} activations)"),
        ("batch", "any (symbolic 'batch' dimension)" if served is None else f"static {served}"),
        ("left in float", describe_float_ops(left_float)),
        *([("no INT8 rule (torch ops)", "; ".join(f"{m}: {', '.join(ops)}" for m, ops in left_float["no_int8_rule"].items()))]
          if left_float["no_int8_rule"] else []),
        *([("kept float on request, yet INT8", ", ".join(left_float["requested_but_int8"])
            + " (other ops quantize what these modules read and write, so their compute ops run in INT8)")]
          if left_float["requested_but_int8"] else []),
        ("Q / DQ nodes", f"{stats.n_quantize} / {stats.n_dequantize}, {stats.n_per_channel} per-channel, "
                         f"{stats.n_nonzero_zero_point} non-zero zero-points, {stats.n_uint8} uint8"),
        ("ORT vs torch INT8", error["describe"] if isinstance(error, dict) else str(error)),
        *rows_eval,
    ]
    if readings is not None:
        rows.append(("ORT readings (sample)", str(readings)))
    rows += [(f"run {r.consumer}", str(r).split(": ", 1)[-1]) for r in verdict.runs]
    rows.append((f"check {target.target} --run", common.verdict_line(verdict)))
    run.ui.report(result, rows)
    if run.judged.fidelity.status == "inconclusive":
        return 1  # a constant float output tells nothing (a missed budget wrote nothing, above)
    return exit_code(verdict)


def _accuracy_rows(run: _Run, result: dict) -> list[tuple[str, str]]:
    """``--eval``'s top-1 of FP32, INT8 torch and the INT8 file, and the accuracy-aware search (into ``result``)."""
    # imported when the command runs (torch, onnxruntime behind these), so --help answers at once
    from quantship.cli.labelled import file_runner, top1, torch_runner

    rows: list[tuple[str, str]] = []
    labelled = run.labelled
    if labelled is not None:
        bs = run.batches[0].shape[0]
        runners = {"fp32_torch": ("FP32 torch", lambda: torch_runner(run.model)),
                   "int8_torch": ("INT8 torch", lambda: torch_runner(run.qmodel)),
                   "int8_file_ort": ("INT8 file in ORT", lambda: file_runner(run.path))}
        accuracy = {}
        for key, (what, runner) in runners.items():
            with step(f"--eval: top-1 of {what} on {len(labelled.y)} sample(s)"):
                accuracy[key] = top1(runner(), labelled, bs)
        result["accuracy"] = {k: v.as_dict() for k, v in accuracy.items()}
        rows = [("top-1 FP32 (torch)", accuracy["fp32_torch"].describe()),
                ("top-1 INT8 (torch)", accuracy["int8_torch"].describe()),
                ("top-1 INT8 (file, ORT)", accuracy["int8_file_ort"].describe())]
    search = run.quantizer.accuracy_search
    if search is not None:
        result["accuracy_search"] = search.as_dict()
        rows.append(("accuracy-aware search", f"{len(search.steps)} quantization(s); kept in "
                     f"float: {', '.join(search.chosen.excluded) or 'nothing'}"))
    return rows


def _export_sample(batches, static_batch: int | None):
    """The export sample and dynamic_batch: the preset's choice, or a static file at ``--static-batch N``."""
    import torch  # the CLI loads torch when a command runs, not for --help

    if static_batch is None:
        return batches[0], None
    samples = torch.cat(batches)
    if len(samples) < static_batch:
        raise UsageError(f"--static-batch {static_batch}: the calibration data holds {len(samples)} sample(s); "
                         "give at least that many, or a smaller --static-batch")
    return samples[:static_batch], False


def _file_batch(path) -> int | None:
    """The file's static batch, or None when its batch dimension is symbolic."""
    import onnx

    dim = onnx.load(str(path), load_external_data=False).graph.input[0].type.tensor_type.shape.dim[0]
    return dim.dim_value if dim.HasField("dim_value") else None


def _output_error(qmodel, path, sample):
    """ORT (literal) vs torch on the first output: in output LSB, or in absolute terms when the output
    stays float (e.g. its producer was kept in float with --exclude)."""
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    import numpy as np

    from quantship.cli.labelled import torch_runner
    from quantship.inspect.read.lsb import output_scales
    from quantship.inspect.run.verify import compare_logits, ort_session, run_session

    if next(iter(output_scales(path).values()), None) is not None:
        return compare_logits(qmodel, path, sample)
    x = sample.detach().numpy()
    diff = np.abs(torch_runner(qmodel)(x) - run_session(ort_session(path), [x])[0])
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "describe": f"float output: max abs {diff.max():.4g}, mean abs {diff.mean():.4g} (no output scale)"}


def _left_float(quantizer, facts) -> dict:
    """The compute ops the written file leaves in float, by module path and why (the list ``inspect``
    prints for the file, with what only the quantizer knows: which modules its annotator had no INT8
    rule for), plus every torch op the annotator left float, compute or not (``no_int8_rule``)."""
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    from quantship.inspect.read.float_ops import float_ops

    report = getattr(quantizer, "report", None)
    no_rule = report.float_ops_by_module() if report is not None else {}
    out = float_ops(facts, no_rule_modules=no_rule)
    out["no_int8_rule"] = no_rule
    floated = [f.module for f in facts.float_compute if f.module is not None]
    requested = (facts.spec.get("skip_activations") or []) if isinstance(facts.spec, dict) else []
    # a module kept float whose compute ops all read and write INT8 in the file: the ops around it quantize
    # its inputs and outputs for their own sake (e.g. a conv whose ReLU is another module)
    out["requested_but_int8"] = [name for name in requested
                                 if not any(m == name or m.startswith(name + ".") for m in floated)]
    return out
