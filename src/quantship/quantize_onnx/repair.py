"""``quantize_onnx``: quantize a float ONNX file, judge the file's fidelity to FP32, repair it when it
misses the budget, and write it only when it keeps the budget: the ONNX front-end of ``repair_loop``.

Each step is a whole file from ``quantize_onnx_file``, its fidelity measured there (``quantship.fidelity``:
each output's SQNR and agreement against the float file, on samples held out from calibration where
given). The algorithm steps are ``ALGORITHM_STEPS`` (``repair_loop``'s table); the nodes are ranked by the per-node SQNR report's
own loss (``sensitivity.NodeSqnrReport.by_own_loss``: a node's inputs' SQNR less its output's, so a node
that only carries an upstream loss does not rank); 16-bit first where the target runs it (``Target.runs_int16``:
unlike the PyTorch path's, measured: Swin V2-T's float repair needed 58 nodes, floating MatMuls lowering its SQNR
from 9.5 to 2.7 dB on the way, where 16 bits on 16 nodes kept the budget; docs/fidelity.md). The chosen file
is moved to ``out_path`` with the repair's record in its metadata (``repair_loop.METADATA_KEY``); when none keeps the
budget, ``FidelityMissed`` names every step and nothing is written.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from quantship import targets
from quantship.errors import FidelityMissed, QuantshipError, one_line
from quantship.export import artifact, speed_gate
from quantship.export.metadata import add_file_metadata
from quantship.export.profile_place import place_by_profile
from quantship.fidelity import METADATA_KEY as FIDELITY_KEY
from quantship.fidelity import MISSED, Budget, missed_in_runtime
from quantship.progress import step as progress_step
from quantship.quantize_onnx.quantizer import (
    FloatReference,
    OnnxQuantizeResult,
    fidelity_in_runtime,
    placement_for,
    quantize_onnx_file,
)
from quantship.quantize_onnx.sensitivity import node_sqnr
from quantship.quantize_onnx.speed import SpeedSearch, calibration_sample, speed_search_onnx, timing_feeds
from quantship.recipe import takes_algorithms
from quantship.repair_loop import Repair, algorithm_steps, dropping_uncovered, native_repair
from quantship.repair_loop import repair as run_repair
from quantship.targets import Target

ALGORITHM_STEPS = algorithm_steps()  # repair_loop's table; this path's options are recipe.Algorithms' own names
DEFAULT_BUDGET = Budget()  # quantship.fidelity's defaults
SENSITIVITY_OPTIONS = ("observer", "per_tensor", "equalize", "bias_correction", "seq_mse", "adaround", "smooth_quant")


@takes_algorithms()
def quantize_onnx(float_path: str | Path, out_path: str | Path, calibration: Any, *, target: str | Target,
                  budget: Budget | None = DEFAULT_BUDGET, fidelity_data: Any = None, repair: bool = True,
                  max_steps: int | None = None, exclude: Iterable[str] = (), int16: Iterable[str] = (),
                  wait: bool = True, log: Callable[[str], None] = lambda _: None, speed: bool = True,
                  require_faster: bool = False, profile_placement: bool = True,
                  **options: Any) -> tuple[OnnxQuantizeResult, Repair | None]:
    """Quantize ``float_path`` for ``target``, judge its fidelity to the float file by ``budget``, repair it
    when missed (see the module docstring) and write ``out_path``; returns the file's result and the repair.

    ``fidelity_data``: samples held out from calibration (the calibration grammar); without it the file is
    judged on calibration samples, said so. ``budget=None``: measured, not judged (one pass, no repair).
    ``repair=False``: judge only. ``max_steps``: at most that many repair steps after step 0. ``options``:
    ``quantize_onnx_file``'s. Raises ``FidelityMissed`` (nothing written) when no file keeps the budget.
    ``speed``: the chosen file timed against the float file on this CPU before it is moved into place
    (``export.speed_gate``; ONNX Runtime targets), in ``result.speed`` and the file's metadata;
    ``require_faster``: ``SpeedMissed`` (nothing written) when it is slower. ``profile_placement`` (with
    ``speed``, ONNX Runtime targets that run a mixed graph): the file the repair chose is profiled against the
    float file and the weighted ops whose integer form costs more here kept float when one verification
    says the file is faster (``profile_place``; ``result.profile``); False: the plain placement.
    """
    src = Path(float_path).expanduser()
    final = artifact.refuse_unsafe_destination(out_path, (src,))
    if max_steps is not None and (isinstance(max_steps, bool) or max_steps < 0):
        raise QuantshipError(f"max_steps={max_steps!r}: give a number of steps >= 0, or None for every step")
    base, base_wide = tuple(exclude), tuple(int16)
    p = targets.get(target)
    speed_gate.refuse_unmeasurable(p, speed=speed, require_faster=require_faster)
    timed = speed and p.runtime_is_onnxruntime
    if budget is None and not timed:
        return quantize_onnx_file(src, final, calibration, target=target, exclude=base, int16=base_wide, wait=wait,
                                  fidelity_data=fidelity_data, **options), None
    shared = FloatReference()  # the float file run once on the call's samples, for every file made below
    placement, _, _ = placement_for(p, per_tensor=bool(options.get("per_tensor")))
    profiled = profile_placement and timed and placement.mode != "full"
    numbers = itertools.count()
    made: dict[Path, tuple[dict, tuple, tuple]] = {}  # each step's file -> how it was asked for
    in_runtime = [False]  # each step judged in the target's own runtime (the second repair, ``native_repair``)
    with artifact.workdir_beside(final) as scratch:
        def attempt(what: str, opts: dict, excluded: tuple, wide: tuple):
            k = next(numbers)
            try:
                done = quantize_onnx_file(src, scratch / f"step{k}.onnx", calibration, target=p, exclude=excluded,
                                          int16=wide, fidelity_data=fidelity_data, budget=budget, wait=wait,
                                          float_reference=shared, **opts)
            except QuantshipError as exc:
                if not k:
                    raise  # the file as asked cannot be made: the caller's refusal, not a repair's
                log(f"fidelity repair: {what} gives no file ({one_line(exc)})")
                return None
            made[done.path] = (opts, excluded, wide)
            if in_runtime[0]:
                read_in_runtime(done, src, calibration, fidelity_data, budget, shared)
            return done.fp32, done

        def by_profile(done: OnnxQuantizeResult) -> OnnxQuantizeResult:
            """The chosen file, or the one that keeps float what its profile says runs slower as integers."""
            if not profiled:
                return done
            opts, excluded, wide = made[done.path]
            feeds = timing_feeds(src, calibration, (1, calibration_sample(src, calibration)[1]))
            files = itertools.count()  # one file per trial: the placement times each against the best so far
            with progress_step("placement by profile: the float and the plain INT8 file, per node (1 thread)"):
                chosen, done.profile = place_by_profile(src, done, feeds, lambda names: dropping_uncovered(
                    lambda kept: quantize_onnx_file(
                        src, scratch / f"profile{next(files)}.onnx", calibration, target=p,
                        exclude=(*excluded, *names), int16=kept, fidelity_data=fidelity_data, budget=budget, wait=wait,
                        float_reference=shared, **opts),
                    tuple(w for w in wide if w not in names)), log=log)  # a 16-bit node kept float is float
            chosen.profile = done.profile
            add_file_metadata(chosen.path, done.profile.metadata())
            return chosen

        def order(done: OnnxQuantizeResult, opts: dict) -> list[str]:
            with progress_step("fidelity repair: per-node SQNR (own loss)"):
                report = node_sqnr(src, calibration, target=p, exclude=base, quantized_path=done.path,
                                   **{k: v for k, v in opts.items() if k in SENSITIVITY_OPTIONS})
            return [r.node for r in report.by_own_loss()]

        if budget is None:  # measured, not judged: one file, timed below
            done = quantize_onnx_file(src, scratch / "step0.onnx", calibration, target=p, exclude=base, int16=base_wide,
                                      wait=wait, fidelity_data=fidelity_data, float_reference=shared, **options)
            made[done.path] = (options, base, base_wide)
            confirm_in_runtime(done, src, calibration, fidelity_data, None, shared)
            return _speed_and_move(by_profile(done), src, final, calibration, timed, require_faster, wait), None
        refusal = (None if placement.mode != "full" else
                   f"{p.target} runs a fully integer graph (no float node, no 16-bit activations): no node can be "
                   "kept float for it")

        def repaired() -> tuple[Repair, OnnxQuantizeResult]:
            record, done = run_repair(attempt, budget=budget, options=dict(options), base=base, base_wide=base_wide,
                                      algorithm_steps=ALGORITHM_STEPS, order=order, mixed_refusal=refusal,
                                      sixteen=p.runs_int16, enabled=repair, max_steps=max_steps, log=log)
            done = by_profile(done)
            add_file_metadata(done.path, record.metadata())
            return record, done

        record, done = repaired()
        try:
            confirm_in_runtime(done, src, calibration, fidelity_data, budget, shared)
        except FidelityMissed as missed:
            if not native_repair(repair, missed, in_runtime, log):
                raise
            record, done = repaired()  # every step judged in the runtime: its reading is the file's
        return _speed_and_move(done, src, final, calibration, timed, require_faster, wait), record


@takes_algorithms()
def speed_search(float_path: str | Path, out_path: str | Path, calibration: Any, *, target: str | Target,
                 budget: Budget | None = DEFAULT_BUDGET, fidelity_data: Any = None, repair: bool = True,
                 exclude: Iterable[str] = (), int16: Iterable[str] = (), max_steps: int | None = None,
                 wait: bool = True, log: Callable[[str], None] = lambda _: None,
                 **options: Any) -> tuple[OnnxQuantizeResult, SpeedSearch, Repair | None]:
    """``--speed-search`` held to the fidelity budget: the repair runs first (``quantize_onnx``, no timing), and
    the speed search starts from the file it chose (its algorithms, its nodes in float and in 16 bits), each
    step and the written file judged by ``budget`` (``speed_search_onnx``). A search from the plain file wrote
    nudenet's INT8 file at 0.68 agreement against the 0.9 budget (2.4x FP32; bench/placement_results.md).
    ``budget=None``: the search alone, measured, not judged. ``FidelityMissed``: nothing written."""
    src = Path(float_path).expanduser()
    final = artifact.refuse_unsafe_destination(out_path, (src,))
    base, wide, record = tuple(exclude), tuple(int16), None
    if budget is not None:
        with artifact.workdir_beside(final) as scratch:
            _, record = quantize_onnx(src, scratch / "repaired.onnx", calibration, target=target, budget=budget,
                                      fidelity_data=fidelity_data, repair=repair, exclude=base, int16=wide, speed=False,
                                      wait=wait, log=log, **options)
        chosen = record.steps[record.chosen] if record is not None and record.chosen is not None else None
        if chosen is not None:
            changes = dict(ALGORITHM_STEPS)
            for name in chosen.algorithms:
                options = {**options, **changes[name]}
            base, wide = chosen.excluded, chosen.int16
            if record.chosen:
                log(f"speed search: from the fidelity repair's file ({chosen.what})")
    result, search = speed_search_onnx(src, final, calibration, target=target, exclude=base, max_steps=max_steps,
                                       wait=wait, log=log, budget=budget, fidelity_data=fidelity_data,
                                       metadata=record.metadata() if record is not None else None,
                                       **({"int16": wide} if wide else {}), **options)
    return result, search, record


def read_in_runtime(done: OnnxQuantizeResult, src: Path, calibration: Any, fidelity_data: Any,
                    budget: Budget | None, float_reference: FloatReference | None = None, *,
                    refuse_missed: bool = False) -> None:
    """The file measured in its target's own runtime where that is not ONNX Runtime and runs here (the repair's
    steps are read in ONNX Runtime, literally, unless it repairs in the runtime): that reading becomes the file's
    fidelity, in ``done.fp32`` and its metadata. ``refuse_missed``: a file that keeps the budget in ONNX Runtime
    but not in its runtime is refused first (``FidelityMissed``, the file left as it was, nothing written)."""
    native = fidelity_in_runtime(done.path, src, done.target, calibration, fidelity_data, budget, float_reference)
    if native is None:
        return
    if refuse_missed and budget is not None and native.status == MISSED:
        raise missed_in_runtime(done.fp32, native, done.target)
    done.fp32 = native
    add_file_metadata(done.path, {FIDELITY_KEY: native.metadata()})


def confirm_in_runtime(done: OnnxQuantizeResult, src: Path, calibration: Any, fidelity_data: Any,
                       budget: Budget | None, float_reference: FloatReference | None = None) -> None:
    """The chosen file confirmed in its target's own runtime: ``read_in_runtime``, refusing a file missed there."""
    read_in_runtime(done, src, calibration, fidelity_data, budget, float_reference, refuse_missed=True)


def _speed_and_move(done: OnnxQuantizeResult, src: Path, final: Path, calibration: Any, timed: bool,
                    require_faster: bool, wait: bool) -> OnnxQuantizeResult:
    """The chosen file, still in the scratch folder: timed against ``src`` (``timed``; ``SpeedMissed`` with
    ``require_faster`` when slower, nothing moved), then moved into place at ``final``."""
    if timed:
        sample, batch = calibration_sample(src, calibration)
        done.speed = speed_gate.gate(done.path, src, sample, (1, batch), require_faster=require_faster)
    return done.move_to(final, src, wait)
