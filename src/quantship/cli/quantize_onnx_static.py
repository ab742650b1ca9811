"""``quantship quantize-onnx`` with quantship's engine and static activations: the run and its report."""

from __future__ import annotations

import argparse

from quantship import targets
from quantship.cli import common, quantize_onnx_eval
from quantship.cli import fidelity as fidelity_cli
from quantship.cli import speed as speed_cli
from quantship.cli.check import exit_code
from quantship.cli.onnx_input import check_memory, read_float_file
from quantship.recipe import Algorithms


def algorithms_of(args: argparse.Namespace) -> Algorithms:
    """The algorithm request ``quantize-onnx``'s flags make (validated once, by ``Algorithms``)."""
    return Algorithms(equalize=bool(args.equalize), bias_correction=bool(args.bias_correction),
                      smooth_quant=args.smooth_quant, seq_mse=bool(args.seq_mse), adaround=args.adaround or False,
                      observer=args.observer, exclude=tuple(args.exclude or ()), int16=tuple(args.int16 or ()))


def run(args: argparse.Namespace, out) -> int:
    """quantship's engine, static activations: read the file and the data, quantize (the fidelity repair, the
    accuracy search or the speed search), time the file, report."""
    # late: `quantize-onnx --help` answers before onnx, onnxruntime and torch load
    from quantship.export.data import read_held_out
    from quantship.inspect.read.feeds import fixed_batch
    from quantship.inspect.read.loading import file_size
    from quantship.quantize_onnx.quantizer import placement_for

    ui = common.Output(args)
    target = targets.get(args.target)
    asked = algorithms_of(args)  # one request for whichever entry point runs below
    model, inputs = read_float_file(args.float_model, args.max_memory)
    batches, held, held_said = read_held_out(
        args.calib, inputs, batch_size=args.batch_size, max_samples=args.max_samples, key=args.key,
        preprocessing=common.preprocessing(args), fidelity_data=args.fidelity_data, judged=not args.no_fidelity,
        multiple=fixed_batch(inputs) or 1)
    del model
    check_memory(args.float_model, batches, args.max_memory)
    labelled = quantize_onnx_eval.labelled(args, inputs)
    placement, _, _ = placement_for(target.target, per_tensor=args.per_tensor)
    n = sum(len(next(iter(b.values()))) for b in batches)
    ui.say(f"quantizing with quantship: {placement.mode} placement, {placement.activation_dtype} activations, "
           f"{len(batches)} calibration batch(es), {n} sample(s)")
    search, accuracy, speed, repair = None, {}, None, None
    if args.speed_search:
        # late: --help answers before numpy, onnx and onnxruntime load
        from quantship.errors import FidelityMissed
        from quantship.quantize_onnx.repair import speed_search

        ui.say(f"fidelity to FP32 judged on {held_said}" if not args.no_fidelity else "fidelity not judged")
        try:
            result, speed, repair = speed_search(
                args.float_model, out, batches, target=target, algorithms=asked, budget=args.budget,
                fidelity_data=held, repair=not args.no_repair, max_steps=args.max_steps, wait=not args.no_wait,
                log=ui.say, per_tensor=args.per_tensor, shared_scale=args.shared_scale)
        except FidelityMissed as missed:
            return fidelity_cli.missed("quantize-onnx", ui, missed, {"version": 1, "input": args.float_model,
                                                                     "engine": "quantship", "target": target.target})
        if labelled is not None:
            accuracy = quantize_onnx_eval.top1_of(args, labelled, result.path)
    elif args.max_drop is not None:
        # late: --help answers before numpy, onnx and onnxruntime load
        from quantship.quantize_onnx.search import OnnxBudgetMissed, search_onnx

        try:
            result, search = search_onnx(args.float_model, out, batches, target=target, max_drop=args.max_drop,
                                         labelled=(labelled.x, labelled.y), algorithms=asked,
                                         per_tensor=args.per_tensor, max_steps=args.max_steps,
                                         batch_size=args.batch_size, wait=not args.no_wait, log=ui.say)
        except OnnxBudgetMissed as missed:
            return quantize_onnx_eval.budget_missed(args, ui, missed)
        accuracy = {"float": search.float_step, "int8": search.chosen}
    else:
        from quantship.errors import FidelityMissed, SpeedMissed
        from quantship.quantize_onnx.repair import quantize_onnx  # late: --help answers before onnx loads

        ui.say(f"fidelity to FP32 judged on {held_said}" if not args.no_fidelity else "fidelity not judged")
        try:
            result, repair = quantize_onnx(
                args.float_model, out, batches, target=target, budget=args.budget, fidelity_data=held,
                repair=not args.no_repair, max_steps=args.max_steps, algorithms=asked, per_tensor=args.per_tensor,
                wait=not args.no_wait, shared_scale=args.shared_scale, log=ui.say,
                speed=not args.no_speed, require_faster=args.require_faster,
                profile_placement=not args.plain_placement, max_memory=args.max_memory)
        except SpeedMissed as slower:
            return speed_cli.missed("quantize-onnx", ui, slower, {"version": 1, "input": args.float_model,
                                                                  "engine": "quantship", "target": target.target})
        except FidelityMissed as missed:
            return fidelity_cli.missed("quantize-onnx", ui, missed, {"version": 1, "input": args.float_model,
                                                                     "engine": "quantship", "target": target.target})
        if labelled is not None:
            accuracy = quantize_onnx_eval.top1_of(args, labelled, result.path)
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
        *([("recurrent layers", result.plan["recurrent"]["summary"])] if result.plan["recurrent"]["summary"] else []),
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
        *(quantize_onnx_eval.search_rows(search) if search is not None else []),
        *([("speed search", f"{len(speed.steps)} file(s) timed; {speed.describe()}"),
           ("kept float for speed", ", ".join(speed.added) or "nothing")] if speed is not None else []),
        *[(f"run {r.consumer}", str(r).split(": ", 1)[-1]) for r in verdict.runs],
        (f"check {target.target} --run", common.verdict_line(verdict)),
    ])
    if result.fp32.status == "inconclusive":
        return 1  # a constant float output tells nothing (a missed budget raised above, writing nothing)
    return exit_code(verdict)  # 1 for refused, failed or inconclusive, as every command that writes a file


def _other_outputs(fidelity: dict) -> str:
    """The max abs error of each output, named, when the file has several (the row above is the first's)."""
    each = fidelity.get("per_output")
    if not each:
        return ""
    return " (first output); per output: " + ", ".join(f"{name} {f['fused']['max_abs_error']:.4g}"
                                                        for name, f in each.items())


def _kernels(counts: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items()) or "none"
