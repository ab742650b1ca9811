"""The PyTorch path held to the float model: quantize for a target, export, judge the file's fidelity to
FP32 (``quantship.fidelity``) on inputs held out from calibration, repair it with the same loop as the ONNX
path (``repair_loop``), and write it only when it keeps the budget.

Each step is a whole file: ``Quantizer.for_target`` with the step's options and modules kept float
(``skip_activations``), ``export_qdq`` into a scratch folder beside the destination, then the file run in
the target's reading (``fidelity_reading``) against the float model run in torch on the same inputs. The
algorithm steps are ``ALGORITHM_STEPS`` (``repair_loop``'s table); the modules are ranked by the per-layer
SQNR report's own loss on the best step's model, compared with the float model as that step captured it
(``Quantizer.prepared_float``: equalized or smoothed) (``quantize.accuracy.own_loss_order``: a layer that only
carries an upstream loss does not rank); for a target that computes on 16-bit activations in integer kernels
(``Target.repairs_with_int16``) each ranked unit is tried in 16 bits (``int16``) before float. Only the chosen
file is moved to the destination.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quantship import heap
from quantship.errors import Int16Uncovered, QuantshipError, one_line
from quantship.export import artifact, placement, speed_gate
from quantship.export.capture import as_arrays
from quantship.export.metadata import add_file_metadata
from quantship.export.onnx_float import export_float_reference
from quantship.export.parked import park
from quantship.export.profile_place import ProfilePlacement, place_by_profile
from quantship.export.qdq import export_qdq
from quantship.fidelity import (
    HELD_OUT_MAX,
    METADATA_KEY,
    MISSED,
    Budget,
    Fidelity,
    measure,
    missed_in_runtime,
    widened,
)
from quantship.inspect.read import external
from quantship.inspect.run.consumers import fidelity_reading, joined, native_runtime, ort_session
from quantship.inspect.run.outputs import output_arrays
from quantship.inspect.run.speed import SpeedReading, unmeasured
from quantship.inspect.run.timing import cpu_line
from quantship.inspect.run.verify import MeasuredPath
from quantship.precision import outside_modules
from quantship.progress import step as progress_step
from quantship.quantize.accuracy import own_loss_order
from quantship.quantize.calibration import Inputs
from quantship.quantize.quantizer import RENAMED
from quantship.repair_loop import Repair, algorithm_steps, dropping_uncovered, native_repair
from quantship.repair_loop import repair as run_repair
from quantship.targets import Target

ALGORITHM_STEPS = algorithm_steps(RENAMED)  # repair_loop's table, in Quantizer's keywords (act_observer)


def file_outputs(session: Any, batches: Sequence[Any], fixed_batch: int | None) -> list[np.ndarray]:
    """Every output of an ORT ``session`` over ``batches`` (torch tensors or tuples of them, the model's
    inputs in order), concatenated along the batch; a fixed-batch file is fed ``fixed_batch`` rows at a time."""
    names = [i.name for i in session.get_inputs()]
    parts: list[list[np.ndarray]] = []
    for batch in batches:
        arrays = as_arrays(batch)
        step = fixed_batch or len(arrays[0])
        for start in range(0, len(arrays[0]), step):
            got = session.run(None, {n: a[start:start + step] for n, a in zip(names, arrays)})
            parts = parts or [[] for _ in got]
            for part, out in zip(parts, got):
                part.append(out)
    return [np.concatenate(p) for p in parts]


def file_batch(path: str | Path) -> int | None:
    """The file's static batch (its first input's first dimension, read without the weights), or None when that
    dimension is symbolic."""
    graph = external.graph_without_weights(path).graph
    stored = {t.name for t in graph.initializer}
    dims = next(i for i in graph.input if i.name not in stored).type.tensor_type.shape.dim
    return dims[0].dim_value if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0 else None


def _samples_key(batches: Sequence[tuple]) -> tuple | None:
    """What the float model's outputs on ``batches`` depend on: each input's shape, dtype and sum (another draw
    of the same shape is another key); None for inputs that are not arrays or tensors (not shared)."""
    try:
        return tuple(tuple((tuple(a.shape), str(a.dtype), float(np.sum(a, dtype=np.float64))) for a in as_arrays(b))
                     for b in batches)
    except Exception:  # an input form as_arrays does not read: the float model is run for this file
        return None


def judge_file(path: str | Path, float_model: Any, held: Sequence[Any], target: Target, budget: Budget | None,
               data: str, fallback: Sequence[Any] = (), native: bool = False,
               float_outputs: dict | None = None, held_out: bool = True,
               float_done: Callable[[], None] = lambda: None) -> Fidelity:
    """The file at ``path`` against ``float_model`` (torch, on the same inputs): ``quantship.fidelity.measure``
    in the target's reading (``fidelity_reading``; ``native``: in the target's own runtime where it is not ONNX
    Runtime and runs here, ``consumers.native_runtime``). A fixed-batch file reads whole multiples of its batch;
    when ``held`` cannot fill one, ``fallback`` (the calibration batches) is read instead, and said so.
    ``float_outputs``: a dict a calling loop keeps, the float model's outputs by the samples they were run on,
    so that the loop's files (the repair's steps, the runtime's confirmation) run the float model once.
    ``held_out``: ``held`` is not calibration data; where its decisions are too few to judge agreement, up to
    ``HELD_OUT_MAX`` samples of ``fallback`` join them (``fidelity.widened``). False when ``held`` is
    calibration data already: nothing is added twice. ``float_done``: called each time the float model has run,
    before the file does (the file's session opens after the float model's outputs are in hand)."""
    fused, runtime = fidelity_reading(target)
    in_runtime = native_runtime(target) if native else None
    opened: list = []

    def session() -> Any:
        if not opened:
            opened.append(ort_session(path, optimized=fused))
        return opened[0]

    fixed = file_batch(path)
    batches = [b if isinstance(b, (tuple, list)) else (b,) for b in held]
    def whole(given: Sequence[Any]) -> list[tuple]:
        cut = [tuple(x[:len(x) - len(x) % fixed] for x in (b if isinstance(b, (tuple, list)) else (b,)))
               for b in given]
        return [b for b in cut if len(b[0])]

    if fixed:
        batches = whole(batches)
        if not batches:
            batches, held_out = whole(fallback), False
            data = f"calibration sample(s) (in-sample: fewer held-out samples than the file's batch of {fixed})"
    if not batches:
        raise QuantshipError(f"the file serves a batch of {fixed}: give at least {fixed} sample(s)")

    def outputs_on(batches: list[tuple]) -> tuple[list[str], list, list]:
        key = _samples_key(batches) if float_outputs is not None else None
        if key is not None and key in float_outputs:
            names, reference = float_outputs[key]
        else:
            names, reference = output_arrays(float_model, batches)
            float_done()
            if key is not None:
                float_outputs[key] = (names, reference)
        if in_runtime is None:
            return names, reference, file_outputs(session(), batches, fixed)
        runner, _ = in_runtime
        inputs = [i.name for i in session().get_inputs()]
        feeds = [{n: np.ascontiguousarray(as_arrays(b)[k]) for k, n in enumerate(inputs)} for b in batches]
        if fixed:
            feeds = [{n: a[s:s + fixed] for n, a in f.items()} for f in feeds
                     for s in range(0, len(next(iter(f.values()))), fixed)]
        try:
            per_feed = runner(path, feeds, onnx.load(str(path)))
        except Exception as exc:  # the runtime's own exception types: it does not run this file here
            raise QuantshipError(f"{runtime} could not run the file to measure its fidelity: {one_line(exc)}") from exc
        return names, reference, joined(per_feed)

    if in_runtime is not None:
        runtime = in_runtime[1]
    names, reference, outputs = outputs_on(batches)
    names = names or [o.name for o in session().get_outputs()]
    n = sum(len(b[0]) for b in batches)
    judged = measure(names, reference, outputs, budget=budget, data=f"{n} {data}", runtime=runtime)
    calibration = [b if isinstance(b, (tuple, list)) else (b,) for b in fallback] if held_out else []
    calibration = whole(calibration) if fixed else calibration
    taken, kept = 0, []
    for batch in calibration:  # as many samples as are held out at most
        if taken >= HELD_OUT_MAX:
            break
        kept.append(batch)
        taken += len(batch[0])

    def on_calibration() -> tuple[list, list, int]:  # run only when the held-out decisions are too few
        _, calib_reference, calib_outputs = outputs_on(kept)
        return calib_reference, calib_outputs, taken

    return widened(judged, names, reference, outputs, on_calibration if kept else None)


@dataclass
class Judged:
    """What ``quantize_export_judged`` made: the model, the quantizer, the file, its fidelity, the repair."""

    qmodel: Any
    quantizer: Any
    path: Any  # the MeasuredPath export_qdq returned, moved to the destination
    fidelity: Fidelity
    repair: Repair | None
    speed: SpeedReading | None = None  # against the float model's ONNX export on this CPU (None: not timed)
    profile: Any = None  # profile_place.ProfilePlacement: what the profile kept float for speed (None: not run)

    @property
    def kept_for_speed(self) -> list[str]:
        """The modules the placement by profile keeps float (empty when it kept none or did not run)."""
        return self.profile.kept_modules if self.profile is not None else []

    def as_dict(self) -> dict:
        """The judgement, the repair, the speed reading and the placement, as the JSON report carries them."""
        return {"fidelity_fp32": self.fidelity.as_dict(),
                "repair": self.repair.as_dict() if self.repair is not None else None,
                "speed": self.speed.as_dict() if self.speed is not None else None,
                "placement_by_profile": self.profile.as_dict() if self.profile is not None else None}


def _float_reference(model: Any, sample: Any, staged: Path, scratch: Path, opset_version: int
                     ) -> tuple[Path | None, str | None, list[str], bool]:
    """The float model exported to ONNX into ``scratch`` with the INT8 file's input names and batch form:
    (its path or None, why not, the input names, whether the batch is fixed). Not pre-optimized: ONNX
    Runtime's session applies the same optimizations when it loads the file, and the nodes keep the module
    scopes the placement by profile matches on (``export.placement``)."""
    int8 = external.graph_without_weights(staged)
    stored = {t.name for t in int8.graph.initializer}
    names = [i.name for i in int8.graph.input if i.name not in stored]
    first = int8.graph.input[0].type.tensor_type.shape.dim
    fixed = bool(first) and first[0].HasField("dim_value")
    try:
        with progress_step("speed: exporting the float model to ONNX as the reference"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reference's export warnings are not the user's file's
            path = export_float_reference(model, sample, scratch / "float_reference.onnx", opset_version=opset_version,
                                          dynamic_batch=not fixed, input_names=names)  # keeps module scopes
    except Exception as exc:  # the reading is reported, it never costs the file (unless require_faster)
        return None, f"the float model's ONNX export failed: {one_line(exc)}", names, fixed
    return Path(path), None, names, fixed


def time_against_float(model: Any, sample: Any, staged: Path, scratch: Path, batches: Sequence[Any], *,
                       opset_version: int = 18, require_faster: bool = False,
                       reference: tuple[Path | None, str | None, list[str], bool] | None = None) -> SpeedReading:
    """The ``staged`` INT8 file timed against the float model exported to ONNX (``export_float_reference``, into
    ``scratch``, with the INT8 file's input names and batch form; ``reference``: that export already made)
    at batch 1 and the first calibration batch's size (``speed_gate.gate``: metadata, ``require_faster``)."""
    path, why, names, _ = reference or _float_reference(model, sample, staged, scratch, opset_version)
    if path is None:
        return speed_gate.settle(staged, unmeasured(why), require_faster=require_faster, hint=speed_gate.torch_hint)
    rows = as_arrays(list(batches)[0])
    return speed_gate.gate(staged, path, dict(zip(names, rows)), (1, len(rows[0])),
                           require_faster=require_faster, hint=speed_gate.torch_hint)


def _by_profile(made: placement.Made, reference: tuple[Path | None, str | None, list[str], bool],
                batches: Sequence[Any], scratch: Path, requantize: Callable[[tuple[str, ...]], Any],
                log: Callable[[str], None]) -> placement.Made:
    """``made``, or the file that keeps float the modules whose integer weighted ops profile slower on this
    CPU (``export.placement``, ``profile_place.place_by_profile``), whichever is faster; its record in
    ``.profile`` and in the file's metadata."""
    path, why, names, fixed = reference
    rows = as_arrays(list(batches)[0])
    feeds = placement.feeds(dict(zip(names, rows)), (len(rows[0]),) if fixed else (1, len(rows[0])))
    modules: dict[str, str] = {}
    if path is not None:
        try:
            modules = placement.profiled_reference(path, made.path, scratch / "float_profiled.onnx")
        except Exception as exc:  # a reading that cannot be made leaves the file as it is, said so
            why = one_line(exc)
    if not modules:
        record = ProfilePlacement(cpu_line(), tuple(feeds), not_run=f"the profile could not run ({why})")
        made.profile = record
        return made
    made.plan = {"weighted_nodes": list(modules)}

    def keep_float(escaped: tuple[str, ...]) -> placement.Made:
        by_escaped = {glob.escape(n): m for n, m in modules.items()}
        return requantize(tuple(sorted({by_escaped[n] for n in escaped})))

    with progress_step("placement by profile: the float and the plain INT8 file, per node (1 thread)"):
        chosen, record = place_by_profile(scratch / "float_profiled.onnx", made, feeds, keep_float, log=log,
                                          modules=modules)  # named as the user's --exclude names them
    chosen.profile = record
    add_file_metadata(chosen.path, record.metadata())
    return chosen


def quantize_export_judged(model: Any, batches: Sequence[Any], sample: Any, out: str | Path, *, target: Target,
                           overrides: dict, held: Sequence[Any] | None, held_label: str, budget: Budget | None,
                           make_quantizer: Callable[..., Any], quantize_kwargs: dict | None = None,
                           export_kwargs: dict | None = None, repair: bool = True, max_steps: int | None = None,
                           log: Callable[[str], None] = lambda _: None, speed: bool = True,
                           require_faster: bool = False, profile_placement: bool = True,
                           own_model: bool = False) -> Judged:
    """Quantize ``model`` for ``target`` (``make_quantizer(target, **options)``, then ``.quantize(model, batches,
    **quantize_kwargs)``), export it (``export_qdq(..., **export_kwargs)``) and hold the file to the float model
    on ``held`` (``held_label`` says what they are; None: the first calibration batch, said in-sample) by
    ``budget`` (None: measured, not judged), repairing it when missed (module docstring). Raises
    ``FidelityMissed`` (nothing written) when no file keeps the budget. ``speed``: the chosen file timed
    against the float model on this CPU before it is moved into place (``time_against_float``; ONNX Runtime
    targets); ``require_faster``: ``SpeedMissed`` (nothing written) when it is slower. ``profile_placement``
    (with ``speed``, targets that run a mixed graph in ONNX Runtime): the chosen file profiled per node against
    the float model's export, the modules whose integer ops cost more kept float when the whole file, timed
    once, is faster and keeps the budget (``export.placement``; ``Judged.profile``). ``own_model``: the caller
    built ``model`` and lends it: a large one's weights are moved to a file in the work folder and kept out of
    memory between its uses, while the exports and ONNX Runtime's sessions run, and so are each quantized model's
    once it is exported (``export.parked``; same values)."""
    final = artifact.refuse_unsafe_destination(out)
    speed_gate.refuse_unmeasurable(target, speed=speed, require_faster=require_faster)
    held_batches = list(held) if held else list(batches)[:1]
    data = held_label if held else "calibration sample(s) (in-sample: none held out)"
    numbers = itertools.count()
    shared: dict = {}  # the float model's outputs on the held samples, run once for every file made below
    base, base_wide = tuple(overrides.get("skip_activations") or ()), tuple(overrides.get("int16") or ())
    options = {k: v for k, v in overrides.items() if k not in ("skip_activations", "int16")}
    made: dict[Path, tuple[dict, tuple, tuple]] = {}  # each step's file -> its options, modules float and in 16 bits
    timed = speed and target.runtime_is_onnxruntime
    opset = (export_kwargs or {}).get("opset_version", 18)
    in_runtime = [False]  # each step judged in the target's own runtime (the second repair, ``native_repair``)
    weight_bytes = heap.module_bytes(model)
    # a large model's sessions, exports and copies freed back to the kernel as they go (``heap``)
    large = weight_bytes >= heap.LARGE_MODEL_BYTES
    with artifact.workdir_beside(final) as scratch, heap.large_blocks_mapped(weight_bytes):
        parked = park(model, scratch) if large and own_model else None
        page_out = parked.page_out if parked is not None else lambda: None  # after each use of the float model

        def attempt(what: str, opts: dict, excluded: tuple, wide: tuple, strict: bool = True):
            k = next(numbers)
            asked = {key: v for key, v in {**opts, "skip_activations": list(excluded) or None,
                                           "int16": list(wide) or None}.items() if v is not None}
            try:
                quantizer = make_quantizer(target, **asked)
                qmodel = quantizer.quantize(model, batches, **(quantize_kwargs or {}))
                page_out()  # the export, its sessions and the judgement's run the quantized model, not this one
                with warnings.catch_warnings() if k else contextlib.nullcontext():
                    if k:
                        warnings.simplefilter("ignore")  # a repair step's warnings are not the user's file's
                    path = export_qdq(qmodel, sample, scratch / f"step{k}.onnx", target=target,
                                      **(export_kwargs or {}))
                if parked is not None:  # exported: the quantized model is read again only if it is the one kept
                    park(qmodel, scratch, f"step{k}_weights.bin")
            except QuantshipError as exc:
                if not k or (not strict and isinstance(exc, Int16Uncovered)):
                    raise  # the file as asked cannot be made: the caller's refusal, not a repair's
                log(f"fidelity repair: {what} gives no file ({one_line(exc)})")
                return None
            fidelity = judge_file(path, model, held_batches, target, budget, data, fallback=list(batches),
                                  native=in_runtime[0], float_outputs=shared, held_out=bool(held), float_done=page_out)
            add_file_metadata(path, {METADATA_KEY: fidelity.metadata()})
            made[Path(path)] = (opts, tuple(excluded), tuple(wide))
            return fidelity, (qmodel, quantizer, path, fidelity)

        def order(made_step: tuple, opts: dict) -> list[str]:
            if isinstance(list(batches)[0], Inputs):
                return []  # the per-layer SQNR report runs a model with one input: no module to rank
            with progress_step("fidelity repair: per-layer SQNR (own loss)"):
                # against the float model as that step captured it (equalized, smoothed: other inner scales)
                reference = made_step[1].prepared_float(model, list(batches))
                ranked = own_loss_order(reference, made_step[0], list(batches)[:4])
                page_out()
                return ranked

        refusal = None if target.runs_mixed_graphs else (
            f"{target.target} runs a fully integer graph (no float node): no module can be kept float for it")

        def repaired() -> tuple[Repair, tuple]:
            return run_repair(attempt, budget=budget, options=options, base=base, base_wide=base_wide,
                              algorithm_steps=ALGORITHM_STEPS, order=order, mixed_refusal=refusal,
                              sixteen=target.repairs_with_int16, enabled=repair, max_steps=max_steps, log=log)

        if budget is None:
            record, chosen = None, attempt("as asked", options, base, base_wide)[1]
        else:
            record, chosen = repaired()
        if large:
            heap.give_back(collect=True)  # the repair's discarded quantized models (cycles) before the float export
        reference = _float_reference(model, sample, chosen[2], scratch, opset) if timed else None
        page_out()
        profile = None
        if timed and profile_placement and target.runs_mixed_graphs:
            opts, excluded, wide = made[Path(chosen[2])]

            def requantize(modules: tuple[str, ...]) -> placement.Made:
                floated = tuple(sorted({*excluded, *modules}))  # a 16-bit module the profile keeps float is float
                done = dropping_uncovered(lambda kept: attempt("placement by profile", opts, floated, kept, strict=False),
                                          outside_modules(wide, floated))
                if done is None:
                    raise QuantshipError(f"keeping {', '.join(modules)} float gives no file")
                return placement.Made(Path(done[1][2]), fp32=done[0], payload=done[1])

            plain = placement.Made(Path(chosen[2]), fp32=chosen[3], payload=chosen)
            picked = _by_profile(plain, reference, batches, scratch, requantize, log)
            chosen, profile = picked.payload, picked.profile
        if record is not None:
            add_file_metadata(chosen[2], record.metadata())
        qmodel, quantizer, path, fidelity = chosen
        if native_runtime(target) is not None:  # the repair read ONNX Runtime literally: confirm in the runtime
            confirmed = judge_file(path, model, held_batches, target, budget, data, fallback=list(batches),
                                   native=True, float_outputs=shared, held_out=bool(held), float_done=page_out)
            if budget is not None and confirmed.status == MISSED:
                missed = missed_in_runtime(fidelity, confirmed, target.target)
                if not native_repair(repair, missed, in_runtime, log):
                    raise missed
                record, chosen = repaired()  # every step judged in the runtime: its reading is the file's
                add_file_metadata(chosen[2], record.metadata())
                qmodel, quantizer, path, confirmed = chosen
            fidelity = confirmed
            add_file_metadata(path, {METADATA_KEY: fidelity.metadata()})
        reading = None
        if timed:
            if large:
                heap.give_back(collect=True)  # the placement's losing model before two sessions are timed side by side
            reading = time_against_float(model, sample, path, scratch, batches, require_faster=require_faster,
                                         opset_version=opset, reference=reference)
        with artifact.atomic_destination(final) as staged:
            artifact.move_with_data(Path(path), staged)
    return Judged(qmodel, quantizer, MeasuredPath.of(final, path.readings), fidelity, record, reading, profile)
