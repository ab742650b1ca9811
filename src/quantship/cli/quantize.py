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
from dataclasses import dataclass
from typing import Any

from quantship import heap, targets
from quantship.cli import common, options, quantize_decoder, quantize_report, quantize_weight_only
from quantship.cli import fidelity as fidelity_cli
from quantship.cli import speed as speed_cli
from quantship.cli.check import exit_code
from quantship.cli.usage import UsageError
from quantship.errors import FidelityMissed, SpeedMissed
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
    quantize_weight_only.add_arguments(parser)
    # weight-only needs no calibration, nor an hf: model (generated ids): the static path checks it itself
    common.add_calibration_arguments(parser, required=False, help=(
        ".npz keyed by the forward's argument names (several inputs, int64 token ids and masks, each in its "
        "dtype), .npy (one input) or a folder of images; an hf: model without it: generated token ids"))
    parser.add_argument("--max-steps", type=int, default=None, metavar="N",
                        help="at most N fidelity repair steps (default: every step)")
    fidelity_cli.add_arguments(parser)
    speed_cli.add_arguments(parser)
    common.add_writer_arguments(parser)
    common.add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    quantize_weight_only.check_request(args)  # before the --out lock and any import
    # weight-only files are timed too; a weight-only decoder file is not (its static one is: a prefill)
    speed_cli.refuse(args, not_timed="--decoder" if args.decoder and args.method != "static" else None)
    with common.writing(args) as out:  # the --out lock is held to the end: the report reads the file this run wrote
        with step("quantize: importing torch, torchao and the exporter"):  # seconds before anything else shows
            import torch  # noqa: F401
            import torchao.quantization.pt2e  # noqa: F401

            import quantship.export.qdq  # noqa: F401
        if args.method != "static":  # torchao weight-only (W8A16 / W4A16): no calibration, its own writer
            return quantize_weight_only.run(args)
        if args.decoder:  # W8A8 decoder file: the float decoder file through the ONNX engine
            return quantize_decoder.run_static(args, out, targets.get(args.target or DEFAULT_TARGET))
        return _static(args, out)


@dataclass
class _Run:
    """What one static run has in hand, step by step: the request, the data, the model and the file."""

    args: argparse.Namespace
    ui: common.Output
    target: Target
    overrides: dict[str, Any]
    model: Any = None
    labelled: Any = None  # the --eval data (x, y), and the same cut into calibration-sized batches
    labelled_batches: list | None = None
    quantizer: Any = None
    qmodel: Any = None
    path: Any = None  # the written file (a MeasuredPath: it carries the export's ORT readings)
    served: int | None = None  # the file's static batch, None when it serves any batch
    error: Any = None  # ORT vs torch INT8 on the first output
    data: Any = None  # export.torch_file.Calibration: the batches, those held out, their input names
    judged: Any = None  # export.judged.Judged: the file's fidelity to FP32 and the repair


def _static(args: argparse.Namespace, out) -> int:
    """Static W8A8: refuse bad options, read the model and data, quantize and export, then report."""
    run = _request(args)
    _read_model_and_data(run)
    from quantship.export.torch_file import export_sample  # torch loads with it: when the command runs
    sample, dynamic = export_sample(run.data.batches, args.static_batch)
    quantize_report.read_labelled_batches(run)
    try:
        _quantize_and_export(run, out, sample, dynamic)
    except FidelityMissed as missed:
        return fidelity_cli.missed("quantize", run.ui, missed, {"version": 1, "model": args.model,
                                                                "target": run.target.target})
    except SpeedMissed as slower:
        return speed_cli.missed("quantize", run.ui, slower, {"version": 1, "model": args.model,
                                                             "target": run.target.target})
    with heap.large_blocks_mapped(heap.module_bytes(run.model)):  # the checks' sessions freed back as they go
        return _report(run)


def _request(args: argparse.Namespace) -> _Run:
    """The options, refused before any model or data work; the target resolved once, here."""
    if not args.calib and not args.model.startswith("hf:"):
        raise UsageError("--calib is required for static W8A8 quantization (an hf: model without it is calibrated "
                         "on generated token ids)")
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
    """The model and its calibration batches (``export.torch_file.read_calibration``): an .npz keyed by the
    forward's argument names, or generated token ids for an hf: model; a model that cannot run on them is
    bad input, found before any quantization."""
    # imported when the command runs (torch, numpy behind these), so --help answers at once
    from quantship.export.torch_file import read_calibration
    from quantship.sources import load_model

    args = run.args
    with step(f"quantize: loading {args.model}"):
        run.model = load_model(args.model, args.weights, trust_pickle=args.trust_pickle)
    with step(f"quantize: reading {args.calib or 'generated token ids'}"):
        run.data = read_calibration(run.model, args.calib, batch_size=args.batch_size, max_samples=args.max_samples,
                                    key=args.key, preprocessing=common.preprocessing(args),
                                    fidelity_data=args.fidelity_data, judged=not args.no_fidelity,
                                    multiple=args.static_batch or 1, seq_len=args.seq_len)
    batches = run.data.batches
    run.ui.say(f"calibration: {sum(len(f[run.data.names[0]]) for f in run.data.feeds[:len(batches)])} sample(s) "
               f"in {len(batches)} batch(es) of up to {args.batch_size} from {run.data.source} "
               f"(input(s) {', '.join(run.data.names)})")


def _quantize_and_export(run: _Run, out, sample, dynamic: bool | None) -> None:
    """Quantize for the target and write the checked file; warnings measured on the file are said."""
    # imported when the command runs (torch, onnx behind these), so --help answers at once
    import warnings

    from quantship import Quantizer
    from quantship.export.judged import file_batch, quantize_export_judged
    from quantship.export.torch_file import output_error
    from quantship.inspect.run.verify import FusedKernelDrift

    args, ui = run.args, run.ui
    searching = run.overrides.get("max_accuracy_drop") is not None  # the labelled search decides instead
    if not args.no_fidelity:
        ui.say(f"fidelity to FP32 judged on {run.data.held_label or 'calibration samples (none held out)'}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", FusedKernelDrift)  # measured on the file: the user hears it
        run.judged = quantize_export_judged(
            run.model, run.data.batches, sample, out, target=run.target, overrides=run.overrides,
            held=run.data.held, held_label=run.data.held_label, budget=None if searching else args.budget,
            make_quantizer=lambda target, **kw: Quantizer.for_target(target, verbose=ui.verbose, **kw),
            quantize_kwargs={"max_calibration_samples": args.max_samples,
                             "labelled_data": run.labelled_batches if searching else None},
            export_kwargs={"opset_version": args.opset, "dynamic_batch": dynamic},
            repair=not args.no_repair, max_steps=args.max_steps, log=ui.say, speed=not args.no_speed,
            require_faster=args.require_faster, profile_placement=not args.plain_placement, own_model=True)
        run.quantizer, run.qmodel, run.path = run.judged.quantizer, run.judged.qmodel, run.judged.path
        run.served = file_batch(run.path)
        run.error = output_error(run.qmodel, run.path, sample, run.served)
    for warning in caught:
        ui.say(f"warning: {warning.message}")


def _report(run: _Run) -> int:
    """The file read back and checked as ``quantship check --run`` would, printed as one table or JSON."""
    # imported when the command runs (onnx, numpy behind these), so --help answers at once
    from quantship import quant_spec
    from quantship.export.torch_file import left_float as left_float_ops
    from quantship.inspect.judge.check import check_file
    from quantship.inspect.read.facts import read_file
    from quantship.inspect.read.loading import file_size
    from quantship.sources import weights_origin

    args, target, path, served, error, judged = run.args, run.target, run.path, run.served, run.error, run.judged
    spec = quant_spec(run.qmodel)
    facts = read_file(path)
    stats = facts.stats
    left_float = left_float_ops(run.quantizer, facts, judged.kept_for_speed)
    del facts  # its model holds every weight: the check reads the file again, and not beside this copy
    size = file_size(path)
    real = run.data.whole()  # every --calib sample (calibration and held out): real inputs for the run
    verdict = check_file(path, target, run=True, inputs=real)
    readings = path.readings
    weights = weights_origin(args.model, args.weights)
    result = {
        "version": 1, "model": args.model, "weights": weights, "target": target.target, "path": args.out,
        "inputs": run.data.names, "calibration": run.data.source,
        "spec": spec.as_dict(), "label": spec.label,
        "size_bytes": size, "batch": "any" if served is None else served, "qdq_stats": stats.as_dict(),
        "logit_error_vs_torch": error if isinstance(error, dict) else error.as_dict(),
        "ort_readings": readings.as_dict() if readings else None,
        "verdict": verdict.verdict, "check": verdict.as_dict(),
        **judged.as_dict(),  # fidelity_fp32, repair, speed, placement_by_profile
    }
    result["float_ops"] = left_float
    rows_eval = quantize_report.accuracy_rows(run, result)
    speed_cli.warn("quantize", judged.speed, run.args.quiet)
    rows = [
        *fidelity_cli.rows(judged.fidelity, judged.repair),  # first: does the file still do the job
        *speed_cli.rows(judged.speed),
        *speed_cli.profile_rows(judged.profile),
        ("file", f"{args.out} ({size / 1e6:.2f} MB)"),
        ("weights", weights),
        quantize_report.precision_row(spec, target),
        ("batch", "any (symbolic 'batch' dimension)" if served is None else f"static {served}"),
        *quantize_report.float_rows(left_float),
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
    if judged.fidelity.status == "inconclusive":
        return 1  # a constant float output tells nothing (a missed budget wrote nothing, above)
    return exit_code(verdict)
