"""``quantship quantize-onnx``: a float ONNX file to a QDQ INT8 file that passes a target's check.

quantship's own engine does the work (``quantship.quantize_onnx``): normalise (each pass proven in
ONNX Runtime), calibrate in ONNX Runtime with quantship's observers, place Q/DQ pairs where the
target's runtime runs integer kernels (or everywhere, for targets that need a fully integer graph),
then the post-conditions, the target's rules, both ONNX Runtime readings, the census of integer
kernels and the ``check --run`` verdict. ``--engine ort`` runs ONNX Runtime's ``quantize_static``
with the preset's settings instead, for comparison. Calibration: ``.npy`` (one input), ``.npz``
(one array per input, keyed by input name) of the dtype each input declares, or an image folder.
The file appears only when every check passes.

``--eval LABELLED`` scores top-1 of the float file and of the written file in ONNX Runtime (default
optimizations, Wilson 95% intervals); with ``--max-drop POINTS`` the accuracy search
(``quantize_onnx.search``) gives the worst-SQNR nodes 16-bit activations (where the target runs
them) or keeps them in float, one at a time, until the drop fits,
and exits 1, writing nothing, when no step does.
"""

from __future__ import annotations

import argparse

from quantship import targets
from quantship.cli import common, options
from quantship.cli import fidelity as fidelity_cli
from quantship.cli import speed as speed_cli
from quantship.cli.check import exit_code
from quantship.cli.usage import UsageError

ENGINES = ("quantship", "ort")
ACTIVATIONS = ("static", "dynamic")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from quantship.precision import ACT_OBSERVERS  # late: every subcommand's parser is built for --help

    parser.add_argument("float_model", metavar="FLOAT.onnx", help="the float ONNX model to quantize")
    parser.add_argument("--out", required=True, help="the QDQ ONNX file to write")
    common.add_target_argument(parser, default="onnxruntime-cpu", help="deployment preset (default onnxruntime-cpu)")
    parser.add_argument("--engine", choices=ENGINES, default="quantship",
                        help="quantship's own quantizer (default), or ONNX Runtime's quantize_static for comparison")
    parser.add_argument("--exclude", nargs="+", action="extend", default=[], metavar="NODE",
                        help="keep these nodes float: node names, name patterns (glob) or op types")
    parser.add_argument("--int16", type=_names, action="extend", default=[], metavar="NAME[,NAME]",
                        help="16-bit activations (weights int8) for these nodes: names, name patterns (glob) or op "
                             "types, as --exclude; for targets that run them (onnxruntime-cpu)")
    parser.add_argument("--shared-scale", type=_names, action="extend", default=[], metavar="CONCAT[,CONCAT]",
                        help="one scale for these Concat nodes' inputs and output whatever their ranges (names or "
                             "globs, as --exclude; by default inputs whose ranges differ > 8x keep their own)")
    parser.add_argument("--observer", choices=ACT_OBSERVERS, default=None,
                        help="activation range rule (default: the preset's, histogram)")
    parser.add_argument("--per-tensor", action="store_true", help="per-tensor weights (default per channel)")
    parser.add_argument("--equalize", action="store_true",
                        help="cross-layer equalization of Conv -> ReLU -> Conv pairs before calibration (data-free)")
    parser.add_argument("--bias-correction", action="store_true",
                        help="correct each quantized layer's bias for the shift of its output mean (on the calibration data)")
    parser.add_argument("--smooth-quant", type=float, nargs="?", const=0.5, default=None, metavar="ALPHA",
                        help="SmoothQuant: move activation outliers into MatMul/Gemm/1x1 Conv weights before "
                             "calibration, migration strength ALPHA in [0, 1] (0.5 when given alone; put it after "
                             "FLOAT.onnx or give ALPHA)")
    parser.add_argument("--seq-mse", action="store_true",
                        help="search each weight's scale per output channel for the least layer output error "
                             "(on the calibration data)")
    parser.add_argument("--adaround", nargs="?", const="default", default=None, metavar="STEPS",
                        help="learn each weight's rounding up or down (AdaRound, on the calibration data); STEPS "
                             "per layer (default 300)")
    parser.add_argument("--keep-refused", action="store_true",
                        help="--engine ort: keep the file even when the target's check refuses it")
    parser.add_argument("--eval", metavar="LABELLED",
                        help="labelled data (.npz with x and y, or a folder of class folders): top-1 of the float "
                             "file and of the INT8 file in ONNX Runtime, with Wilson 95%% intervals")
    parser.add_argument("--max-drop", type=float, default=None, metavar="POINTS",
                        help="accuracy search: give the worst-SQNR nodes 16-bit activations (where the target runs "
                             "them) or keep them in float until the top-1 drop on --eval "
                             "is at most POINTS percentage points (exit 1, nothing written, if no step fits)")
    parser.add_argument("--speed-search", action="store_true",
                        help="onnxruntime-cpu: time the file in ONNX Runtime on this CPU (1 thread, batch 1 and 8) "
                             "and keep float the Convs/MatMuls whose integer form made it slower (stem and small "
                             "layers); the file records what was kept and the measured speed-ups")
    parser.add_argument("--plain-placement", action="store_true",
                        help="ONNX Runtime targets: skip the placement by profile (by default the weighted ops "
                             "whose integer form, with its Q/DQ and layout nodes, profiles slower here are kept "
                             "float when the whole file, timed once, is faster)")
    parser.add_argument("--max-steps", type=int, default=None, metavar="N",
                        help="--max-drop: at most N nodes kept in float by the search; --speed-search: at most N "
                             "files timed after the first; otherwise at most N fidelity repair steps (default: "
                             "every candidate)")
    parser.add_argument("--activations", choices=ACTIVATIONS, default="static",
                        help="static (default): calibrated Q/DQ pairs; dynamic: int8 per-column weights and each "
                             "MatMul/Gemm's activation quantized at run time (the batch-1 transformer form; Convs "
                             "stay float; data-free: --calib optional, the file is then read on seeded inputs)")
    common.add_calibration_arguments(parser, required=False,
                                     help=".npy (one input), .npz keyed by the file's input names, or a folder of "
                                          "images; each input in its declared dtype (required unless --activations "
                                          "dynamic)")
    fidelity_cli.add_arguments(parser)
    speed_cli.add_arguments(parser)
    common.add_writer_arguments(parser)
    common.add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    speed_cli.refuse(args, targets.get(args.target), not_timed="--engine ort" if args.engine == "ort" else
                     "--activations dynamic" if args.activations == "dynamic" else None)
    if args.activations == "dynamic":
        from quantship.cli.quantize_onnx_dynamic import refuse_combinations  # late: it loads onnx

        refuse_combinations(args)
        with common.writing(args) as out:
            return _run_dynamic(args, out)
    if not args.calib:
        raise UsageError("--calib DATA is required: static activations are calibrated on it (--activations dynamic "
                         "needs none)")
    args.budget = fidelity_cli.budget(args)  # a bound out of range: one line, exit 2, before any work
    if args.fidelity_data and args.no_fidelity:
        raise UsageError("--fidelity-data is the data fidelity is judged on: drop it or --no-fidelity")
    if args.max_drop is not None and not args.eval:
        raise UsageError("--max-drop needs --eval labelled data to measure top-1 on")
    if args.max_drop is not None and args.max_drop < 0:
        raise UsageError(f"--max-drop {args.max_drop:g}: give a budget in percentage points, >= 0")
    if args.speed_search and args.max_drop is not None:
        raise UsageError("--speed-search and --max-drop are two searches: run one (keep what the speed search kept "
                         "float with --exclude in an accuracy search)")
    if args.speed_search and (args.engine == "ort" or not _runs_on_ort_cpu(args.target)):
        raise UsageError(f"--speed-search times the file in ONNX Runtime on this CPU: it serves --target "
                         f"onnxruntime-cpu with quantship's engine, not --target {args.target}"
                         f"{' --engine ort' if args.engine == 'ort' else ''}")
    if args.max_steps is not None and args.max_steps < 0:
        raise UsageError("--max-steps N bounds a search or the fidelity repair: give N >= 0")
    if args.engine == "ort" and args.eval:
        raise UsageError("--eval and --max-drop run with quantship's engine, not --engine ort")
    args.adaround = _adaround_steps(args.adaround)
    if args.smooth_quant is not None and not 0.0 <= args.smooth_quant <= 1.0:
        raise UsageError(f"--smooth-quant {args.smooth_quant:g}: give the migration strength ALPHA in [0, 1] "
                         "(0.5 when given without a value)")
    smoothing = args.smooth_quant is not None
    if args.engine == "ort" and (args.equalize or args.bias_correction or smoothing or args.seq_mse or args.adaround
                                 or args.int16):
        flags = [f for f, on in (("--equalize", args.equalize), ("--bias-correction", args.bias_correction),
                                 ("--smooth-quant", smoothing), ("--seq-mse", args.seq_mse),
                                 ("--adaround", args.adaround), ("--int16", args.int16)) if on]
        raise UsageError(f"{' and '.join(flags)} run in quantship's engine only: drop --engine ort")
    if args.shared_scale and (args.engine == "ort" or args.max_drop is not None):
        raise UsageError("--shared-scale runs in quantship's engine without --max-drop: drop --engine ort / --max-drop")
    with common.writing(args) as out:
        if args.engine == "ort":
            return _run_ort(args, out)
        return _run(args, out)


def _runs_on_ort_cpu(target: str) -> bool:
    return targets.get(target).runtime_is_onnxruntime


def _adaround_steps(value: str | None) -> bool | int:
    """``--adaround [STEPS]`` as ``quantize_onnx_file(adaround=...)`` takes it (False: not given)."""
    steps = options.adaround_steps(value)
    return False if steps is None else steps


def check_memory(path: str, feeds=()) -> None:
    """Refuse a file (and data) whose quantization needs more memory than is available (``memory``)."""
    from pathlib import Path

    # late: `quantize-onnx --help` answers before numpy loads
    from quantship.quantize_onnx.memory import refuse_if_too_large

    if Path(path).is_file():
        refuse_if_too_large(path, feeds)


def read_feeds(args: argparse.Namespace, inputs):
    """Checked calibration batches for the file's inputs (``feeds.read_data``: the one loader)."""
    # late: `quantize-onnx --help` answers before onnx and numpy load
    from quantship.inspect.read.feeds import cut, read_data

    arrays = read_data(args.calib, inputs, key=args.key, preprocessing=common.preprocessing(args),
                       limit=args.max_samples, what="--calib")
    return cut(inputs, arrays, batch_size=args.batch_size, max_samples=args.max_samples, source=args.calib)


def read_feeds_held_out(args: argparse.Namespace, inputs):
    """Calibration batches, the batches fidelity is judged on (``--fidelity-data``, else held out of --calib:
    ``fidelity.split_held_out``) and a line saying which."""
    from pathlib import Path

    # late: --help answers before numpy loads; the one loader (``inspect.read.feeds``)
    from quantship.inspect.read.feeds import cut, read_data

    if args.fidelity_data:
        held = read_data(args.fidelity_data, inputs, key=args.key, preprocessing=common.preprocessing(args),
                         what="--fidelity-data")
        return (read_feeds(args, inputs), cut(inputs, held, batch_size=args.batch_size, max_samples=1 << 30,
                                              source=args.fidelity_data), f"--fidelity-data {args.fidelity_data}")
    if Path(args.calib).is_dir() or args.no_fidelity:
        return read_feeds(args, inputs), None, "none held out"
    arrays = read_data(args.calib, inputs, key=args.key, what="--calib")
    fixed = {i.dims[0] for i in inputs if i.dims and isinstance(i.dims[0], int)}
    calib, held, said = fidelity_cli.split_held_out(arrays, args.max_samples, max(fixed) if len(fixed) == 1 else 1)
    held_batches = None if held is None else cut(inputs, held, batch_size=args.batch_size, max_samples=1 << 30,
                                                 source=args.calib)
    return cut(inputs, calib, batch_size=args.batch_size, max_samples=args.max_samples, source=args.calib), \
        held_batches, said


def _run(args: argparse.Namespace, out) -> int:
    # late: `quantize-onnx --help` answers before onnx, onnxruntime and torch load
    from quantship.inspect.read.feeds import model_inputs
    from quantship.inspect.read.loading import file_size, load_onnx
    from quantship.quantize_onnx.quantizer import placement_for, refuse_unusable

    ui = common.Output(args)
    target = targets.get(args.target)
    check_memory(args.float_model)  # before reading it: a file that cannot fit is refused with the figure
    model = load_onnx(args.float_model)  # validates: exists, is ONNX, has a graph (one-line errors)
    refuse_unusable(model, args.float_model)  # already quantized, external data: refused before any work
    inputs = model_inputs(model)
    batches, held, held_said = read_feeds_held_out(args, inputs)
    del model
    check_memory(args.float_model, batches)
    labelled = _labelled(args, inputs)
    placement, _, _ = placement_for(target.target, per_tensor=args.per_tensor)
    n = sum(len(next(iter(b.values()))) for b in batches)
    ui.say(f"quantizing with quantship: {placement.mode} placement, {placement.activation_dtype} activations, "
           f"{len(batches)} calibration batch(es), {n} sample(s)")
    search, accuracy, speed, repair = None, {}, None, None
    if args.speed_search:
        # late: --help answers before numpy, onnx and onnxruntime load
        from quantship.quantize_onnx.speed import speed_search_onnx

        result, speed = speed_search_onnx(args.float_model, out, batches, target=target, exclude=args.exclude,
                                          max_steps=args.max_steps, wait=not args.no_wait, log=ui.say,
                                          observer=args.observer, per_tensor=args.per_tensor, equalize=args.equalize,
                                          bias_correction=args.bias_correction, seq_mse=args.seq_mse,
                                          adaround=args.adaround, int16=args.int16, smooth_quant=args.smooth_quant,
                                          shared_scale=args.shared_scale)
        if labelled is not None:
            accuracy = _top1_of(args, labelled, result.path)
    elif args.max_drop is not None:
        # late: --help answers before numpy, onnx and onnxruntime load
        from quantship.quantize_onnx.search import OnnxBudgetMissed, search_onnx

        try:
            result, search = search_onnx(args.float_model, out, batches, target=target, max_drop=args.max_drop,
                                         labelled=(labelled.x, labelled.y), exclude=args.exclude,
                                         observer=args.observer, per_tensor=args.per_tensor,
                                         max_steps=args.max_steps, batch_size=args.batch_size, equalize=args.equalize,
                                         bias_correction=args.bias_correction, smooth_quant=args.smooth_quant,
                                         seq_mse=args.seq_mse, adaround=args.adaround, int16=args.int16,
                                         wait=not args.no_wait, log=ui.say)
        except OnnxBudgetMissed as missed:
            return _budget_missed(args, ui, missed)
        accuracy = {"float": search.float_step, "int8": search.chosen}
    else:
        from quantship.errors import FidelityMissed, SpeedMissed
        from quantship.quantize_onnx.repair import quantize_onnx  # late: --help answers before onnx loads

        ui.say(f"fidelity to FP32 judged on {held_said}" if not args.no_fidelity else "fidelity not judged")
        try:
            result, repair = quantize_onnx(
                args.float_model, out, batches, target=target, budget=args.budget, fidelity_data=held,
                repair=not args.no_repair, max_steps=args.max_steps, exclude=args.exclude, int16=args.int16,
                observer=args.observer, per_tensor=args.per_tensor, wait=not args.no_wait, equalize=args.equalize,
                bias_correction=args.bias_correction, seq_mse=args.seq_mse, adaround=args.adaround,
                smooth_quant=args.smooth_quant, shared_scale=args.shared_scale, log=ui.say,
                speed=not args.no_speed, require_faster=args.require_faster,
                profile_placement=not args.plain_placement)
        except SpeedMissed as slower:
            return speed_cli.missed("quantize-onnx", ui, slower, {"version": 1, "input": args.float_model,
                                                                  "engine": "quantship", "target": target.target})
        except FidelityMissed as missed:
            return fidelity_cli.missed("quantize-onnx", ui, missed, {"version": 1, "input": args.float_model,
                                                                     "engine": "quantship", "target": target.target})
        if labelled is not None:
            accuracy = _top1_of(args, labelled, result.path)
    if result.speed is None and not args.no_speed and target.runtime_is_onnxruntime:
        # late: --help answers before onnxruntime loads; the searches write their own file: timed in place
        from quantship.errors import SpeedMissed
        from quantship.quantize_onnx.speed import time_written_file

        try:
            result.speed = time_written_file(result.path, args.float_model, batches, require_faster=args.require_faster)
        except SpeedMissed as slower:
            return speed_cli.missed("quantize-onnx", ui, slower, {"version": 1, "input": args.float_model,
                                                                  "engine": "quantship", "target": target.target})
    speed_cli.warn("quantize-onnx", result.speed, args.quiet)
    stats, verdict, census = result.qdq_stats, result.verdict, result.census
    size = file_size(result.path)
    report = {"version": 1, "input": args.float_model, "target": target.target, "engine": "quantship",
              **{k: v for k, v in result.as_dict().items() if k not in ("target", "engine")},
              "size_bytes": size}
    if accuracy:
        report["accuracy"] = {"float_file_ort": accuracy["float"].as_dict(), "int8_file_ort": accuracy["int8"].as_dict()}
    if search is not None:
        report["accuracy_search"] = search.as_dict()
    if speed is not None:
        report["speed_search"] = speed.as_dict()
    if repair is not None:
        report["repair"] = repair.as_dict()
    fused = result.fidelity["fused"]
    agreement = "" if fused["argmax_agreement"] is None else f"argmax agreement {fused['argmax_agreement']:.3f}, "
    passes = ", ".join(f"{p.name} {p.changes}" for p in result.normalised if p.changes) or "nothing to do"
    ui.report(report, [
        *fidelity_cli.rows(result.fp32, repair),  # first: does the file still do the model's job
        *speed_cli.rows(result.speed),
        *speed_cli.profile_rows(result.profile),
        ("file", f"{result.path} ({size / 1e6:.2f} MB)"),
        ("normalised", passes),
        ("placement", f"{placement.mode}: {result.plan['n_tensors']} activation pairs, {result.plan['n_weighted']} "
                      f"weighted ops" + (f", {len(result.plan['kept_float'])} kept float for speed"
                                         if result.plan["kept_float"] else "")
                      + (f", {result.plan['n_tables']} stored table(s) read by Gather in 8 bits"
                         if result.plan.get("n_tables") else "")
                      + "".join(f", {rule} keeps {len(island['tensors'])} tensors float"
                                for rule, island in result.plan["float_islands"].items())),
        ("Q / DQ nodes", f"{stats.n_quantize} / {stats.n_dequantize}, {stats.n_per_channel} per-channel, "
                         f"{stats.n_uint8} uint8"),
        *([("16-bit activations", f"{len(result.int16)} tensor(s): {', '.join(result.int16)}")] if result.int16 else []),
        ("ORT runs", f"{census['n_integer']} integer kernels ({_kernels(census['integer'])}), {census['n_float']} "
                     f"float compute kernels ({_kernels(census['float'])})"),
        ("vs FP32 (calibration data)", f"{agreement}max abs error {fused['max_abs_error']:.4g}"
         + _other_outputs(result.fidelity)),
        ("ORT readings", f"{result.readings}" if result.readings.literal_lsb is not None else
         f"literal vs fused max abs {result.fidelity['fused_vs_literal_max_abs']:.4g} (float outputs)"),
        *([("top-1 float file (ORT)", accuracy["float"].describe()),
           ("top-1 INT8 file (ORT)", accuracy["int8"].describe())] if accuracy else []),
        *(_search_rows(search) if search is not None else []),
        *([("speed search", f"{len(speed.steps)} file(s) timed; {speed.describe()}"),
           ("kept float for speed", ", ".join(speed.added) or "nothing")] if speed is not None else []),
        *[(f"run {r.consumer}", str(r).split(": ", 1)[-1]) for r in verdict.runs],
        (f"check {target.target} --run", common.verdict_line(verdict)),
    ])
    if result.fp32.status == "inconclusive":
        return 1  # a constant float output tells nothing (a missed budget raised above, writing nothing)
    return exit_code(verdict)  # 1 for refused, failed or inconclusive, as every command that writes a file


def _run_dynamic(args: argparse.Namespace, out) -> int:
    """``--activations dynamic``: the data is read here (optional), the rest is ``quantize_onnx_dynamic``'s."""
    # late: --help answers before onnx, onnxruntime and numpy load
    from quantship.cli import quantize_onnx_dynamic as dynamic
    from quantship.inspect.read.feeds import model_inputs
    from quantship.inspect.read.loading import load_onnx
    from quantship.quantize_onnx.quantizer import refuse_unusable

    check_memory(args.float_model)
    model = load_onnx(args.float_model)
    refuse_unusable(model, args.float_model)
    inputs = model_inputs(model)
    del model
    batches = read_feeds(args, inputs) if args.calib else None
    labelled = _labelled(args, inputs)
    result = dynamic.quantize(args, out, batches)
    return dynamic.report(args, result, _top1_of(args, labelled, result.path) if labelled is not None else {})


def _other_outputs(fidelity: dict) -> str:
    """The max abs error of each output, named, when the file has several (the row above is the first's)."""
    each = fidelity.get("per_output")
    if not each:
        return ""
    return " (first output); per output: " + ", ".join(f"{name} {f['fused']['max_abs_error']:.4g}"
                                                        for name, f in each.items())


def _labelled(args: argparse.Namespace, inputs):
    """``--eval``: labelled data for a file with one input: a .npz with ``x`` (of the input's dtype kind
    and rank) and ``y`` (class indices), or a folder of class folders for an N x C x H x W float input."""
    if not args.eval:
        return None
    from pathlib import Path

    import numpy as np

    # late: --help answers before numpy and Pillow load
    from quantship.cli.labelled import Labelled, read_labelled
    from quantship.cli.usage import UsageError

    if len(inputs) != 1:
        raise UsageError(f"--eval scores top-1 of a file with one input; this file has {[i.name for i in inputs]} "
                         "(use quantize_onnx.search.search_onnx(metric=...) in Python)")
    spec = inputs[0]
    if Path(args.eval).is_dir() or Path(args.eval).suffix != ".npz":
        if spec.dtype.kind != "f" or len(spec.dims) != 4:
            raise UsageError(f"--eval {args.eval}: class folders feed an N x C x H x W float input; the file declares "
                             f"{spec.name}: {spec.describe()}; give a .npz with x and y")
        labelled = read_labelled(args.eval, common.preprocessing(args))
    else:
        labelled = read_labelled(args.eval, None) if len(spec.dims) == 4 and spec.dtype.kind == "f" else None
        if labelled is None:
            if not Path(args.eval).is_file():
                raise UsageError(f"evaluation data {args.eval} does not exist")
            try:
                with np.load(args.eval, allow_pickle=False) as archive:
                    if not {"x", "y"} <= set(archive.keys()):
                        raise UsageError(f"{args.eval} must hold arrays x and y; it holds {list(archive.keys())}")
                    x, y = archive["x"], archive["y"]
            except (ValueError, OSError, EOFError) as exc:
                raise UsageError(f"cannot read {args.eval} as a numpy archive: {exc}") from None
            if y.ndim != 1 or len(y) != len(x) or not len(y) or not np.issubdtype(y.dtype, np.integer):
                raise UsageError(f"{args.eval}: y has shape {list(y.shape)} ({y.dtype}) for {len(x)} sample(s); give "
                                 "one integer class index per sample")
            labelled = Labelled(x, y.astype(np.int64), [str(c) for c in range(int(y.max()) + 1)])
    x = labelled.x
    kind_ok = x.dtype.kind == spec.dtype.kind or (spec.dtype.kind == "f" and x.dtype.kind in "fiu")
    wrong = [i for i, (d, s) in enumerate(zip(spec.dims, x.shape)) if i and d and d != s]
    if x.ndim != len(spec.dims) or wrong or not kind_ok:
        raise UsageError(f"--eval {args.eval}: x is {x.dtype} {list(x.shape)}, the file declares {spec.name}: "
                         f"{spec.describe()}")
    return Labelled(np.ascontiguousarray(x.astype(spec.dtype, copy=False)), labelled.y, labelled.classes)


def _top1_of(args: argparse.Namespace, labelled, path) -> dict:
    """Top-1 of the float file and of the written file, both in ORT at default optimizations."""
    # late: --help answers before numpy, onnx and onnxruntime load
    from quantship.quantize_onnx.search import OnnxSearchStep, file_runner, top1

    out = {}
    for key, file in (("float", args.float_model), ("int8", path)):
        run, _, fixed = file_runner(file)
        correct, n = top1(run, labelled.x, labelled.y, args.batch_size, fixed)
        out[key] = OnnxSearchStep((), 100.0 * correct / n, correct, n)
    return out


def _search_rows(search) -> list[tuple[str, str]]:
    # late: --help answers before numpy, onnx and onnxruntime load
    from quantship.quantize_onnx.search import steps_table

    return [("accuracy search", f"{len(search.steps)} quantization(s); {search.chosen.forms()}"),
            *steps_table(search)]


def _budget_missed(args: argparse.Namespace, ui, missed) -> int:
    """No step met --max-drop: every step reported, nothing written, exit 1."""
    import sys

    # late: --help answers before numpy, onnx and onnxruntime load
    from quantship.quantize_onnx.search import steps_table

    search = missed.search
    ui.report({"version": 1, "input": args.float_model, "engine": "quantship", "path": None,
               "verdict": "budget_missed", "accuracy_search": search.as_dict()},
              [("file", "nothing written: no step met --max-drop"), *steps_table(search)])
    print(f"quantship quantize-onnx: {missed}", file=sys.stderr)
    return 1


def _names(text: str) -> list[str]:
    """``--int16 a,b``: comma-separated names (the flag may also be repeated)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no node: give NAME[,NAME]")
    return names


def _kernels(counts: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items()) or "none"


def _run_ort(args: argparse.Namespace, out) -> int:
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
