"""Speed search on an ONNX file: keep in float the weighted ops that make the file slower on this CPU,
measured on the whole file in ONNX Runtime.

Why measured: ONNX Runtime's integer kernels are not faster everywhere. A Conv with few input
channels over a large image (a stem), or a small one whose Q/DQ pairs and layout changes cost more
than its arithmetic saves, runs faster as its float NCHWc kernel (bench/conv_speed.py), and whether
keeping it float pays depends on its neighbours: keeping MTCNN RNet's first Conv float alone made
the file slower (its MaxPool leaves the NHWC integer path), keeping PP-OCR's classifier's first three
float made it faster. The kernels also differ from CPU to CPU (VNNI, AMX, AVX2 alone). So the search
times files, not rules.

``speed_search_onnx`` quantizes with nothing more kept in float (step 0), then tries, each against
the fastest file so far, timed side by side (``inspect.run.timing``: one thread, CPU time, median of
interleaved rounds, at every batch it serves):

1. ``prefix`` steps: the first k weighted ops (graph order) kept float, k = 1, 2, ... until
   ``PATIENCE`` steps in a row were not faster (a stem is a run of small Convs);
2. ``single`` steps: each remaining weighted op added to the float set on its own, shortest reduction
   first (input channels per group x kernel area for a Conv, the inner dimension for a MatMul / Gemm:
   the fewer products each output sums, the less an integer kernel saves against its Q/DQ and layout
   costs, so with ``max_steps`` the likeliest wins are tried first).

A step is kept when its file is faster by at least ``speed_gate.MARGIN`` (geometric mean over the batches) and
not slower at any batch by more than ``speed_gate.TOLERANCE``; ``max_steps`` bounds the steps after step 0. The
chosen set is quantized again at ``out_path`` with every check of ``quantize_onnx_file``, and the file
records what was kept, where it was measured and the speed-ups (``SEARCH_KEY``). Given a fidelity budget, a
step whose file misses it is not kept however fast, and the written file is held to it (``FidelityMissed``,
nothing written); ``repair.speed_search`` (``--speed-search``) starts from the file the fidelity repair chose.
A task metric is still worth checking (``--eval``): on PP-OCR's classifier the file with its first three
Convs float had a lower mean error against FP32 than step 0's but 582/600 lines right against 587 (REAL.md),
flips of borderline lines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quantship import targets
from quantship.errors import FidelityMissed, QuantshipError, SpecRefused, one_line
from quantship.export import artifact, speed_gate
from quantship.export.speed_gate import SEARCH_KEY, faster, time_files
from quantship.fidelity import Budget, missed
from quantship.inspect.read.feeds import as_feeds, model_inputs
from quantship.inspect.read.loading import load_onnx
from quantship.inspect.run.timing import cpu_line
from quantship.progress import step as progress_step
from quantship.quantize_onnx.quantizer import (
    FloatReference,
    OnnxQuantizeResult,
    feeds_for,
    first_feeds,
    placement_for,
    prepare,
    quantize_onnx_file,
)
from quantship.recipe import takes_algorithms
from quantship.search_engine import Engine
from quantship.targets import Target

PATIENCE = 2  # prefix steps in a row that were not kept before the prefix phase ends
BATCHES = (1, 8)
SECONDS = 0.4  # CPU time per file and batch in each comparison (the final reading: twice that)
# the options that change which kernels the file runs; the others (equalize, smooth_quant: already in the
# normalised file; bias_correction, seq_mse, adaround: values only) are left to the written file
STEP_SAMPLES = 16  # calibration samples of each step's file (the written file: all of them)
STRUCTURAL = ("observer", "per_tensor", "int16", "shared_scale")


@dataclass(frozen=True)
class SpeedStep:
    """One file tried: the nodes kept in float, its ms per batch and the ms of the file it was timed
    against (the fastest so far) in the same rounds; kept or not."""

    kind: str  # "start", "prefix" or "single"
    excluded: tuple[str, ...]
    ms: dict[int, float]
    against: dict[int, float]
    kept: bool
    refused: str | None = None  # the quantizer gave no file for this set
    lost: str = ""  # the file missed the fidelity budget (not kept, however fast)

    @property
    def gain(self) -> float:
        """The speed-up over the file it was timed against: geometric mean over the batches."""
        if not self.ms:
            return 0.0
        return math.exp(sum(math.log(self.against[b] / self.ms[b]) for b in self.ms) / len(self.ms))

    def as_dict(self) -> dict:
        return {"kind": self.kind, "excluded": list(self.excluded), "ms": {str(b): v for b, v in self.ms.items()},
                "against_ms": {str(b): v for b, v in self.against.items()}, "gain": self.gain, "kept": self.kept,
                "refused": self.refused, "lost": self.lost}


@dataclass
class SpeedSearch:
    """The whole search: where it ran, the candidates, every step, and the final side-by-side reading of
    the float file, step 0's file and the chosen one."""

    cpu: str
    batches: tuple[int, ...]
    base: tuple[str, ...] = ()  # kept float by the caller in every step (``exclude``)
    candidates: list[str] = field(default_factory=list)
    steps: list[SpeedStep] = field(default_factory=list)
    final_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # "fp32" / "start" / "chosen" -> b -> ms

    @property
    def chosen(self) -> tuple[str, ...]:
        """Every node the written file keeps float: the caller's ``exclude`` and what the search added."""
        kept = [s for s in self.steps if s.kept]
        return kept[-1].excluded if kept else self.base

    @property
    def added(self) -> tuple[str, ...]:
        """The nodes the search kept float for speed (not the caller's ``exclude``)."""
        return tuple(n for n in self.chosen if n not in self.base)

    def speedup(self, which: str) -> dict[int, float]:
        """FP32 ms / the file's ms, per batch, from the final reading."""
        return {b: self.final_ms["fp32"][b] / self.final_ms[which][b] for b in self.batches}

    def describe(self) -> str:
        def ratios(which: str) -> str:
            return " / ".join(f"{r:.2f}x" for r in self.speedup(which).values())

        batches = " / ".join(f"b{b}" for b in self.batches)
        return (f"{len(self.added)} weighted op(s) kept float for speed; vs FP32 at {batches} (1 thread, CPU time): "
                f"{ratios('chosen')} (nothing kept float: {ratios('start')}); measured on {self.cpu}")

    def as_dict(self) -> dict:
        return {"cpu": self.cpu, "batches": list(self.batches), "candidates": list(self.candidates),
                "steps": [s.as_dict() for s in self.steps], "chosen": list(self.chosen), "base": list(self.base),
                "added": list(self.added),
                "final_ms": {k: {str(b): v for b, v in d.items()} for k, d in self.final_ms.items()},
                "speedup_vs_fp32": {k: {str(b): r for b, r in self.speedup(k).items()} for k in ("start", "chosen")}
                if self.final_ms else {}}


def timing_feeds(float_path: Path, calibration: Any, batches: Iterable[int]) -> dict[int, dict[str, np.ndarray]]:
    """One feed per batch size the file serves: the first calibration sample repeated (a fixed-batch
    file: its own batch only)."""
    inputs = model_inputs(load_onnx(float_path))
    first = as_feeds(calibration, inputs)[0]
    fixed = {i.dims[0] for i in inputs if i.dims and isinstance(i.dims[0], int) and i.dims[0] > 0}
    sizes = sorted(fixed) if fixed else sorted(set(batches))
    return {b: {name: np.ascontiguousarray(np.repeat(a[:1], b, axis=0)) for name, a in first.items()} for b in sizes}


def calibration_sample(float_path: Path, calibration: Any) -> tuple[dict[str, np.ndarray], int]:
    """The first calibration batch's feeds (input name -> array) and its batch size: what the speed against
    FP32 on every quantize feeds (``export.speed_gate``), at batch 1 and this batch."""
    first = as_feeds(calibration, model_inputs(load_onnx(float_path)))[0]
    return first, len(next(iter(first.values())))


def time_written_file(path: str | Path, float_path: str | Path, calibration: Any, *,
                      require_faster: bool = False) -> Any:
    """A quantized file already written at ``path`` (by a search) timed against ``float_path`` at batch 1 and
    the calibration batch (``speed_gate.time_written``: removed, ``SpeedMissed``, when ``require_faster`` and
    slower). Returns the ``inspect.run.speed.SpeedReading``."""
    sample, batch = calibration_sample(Path(float_path), calibration)
    return speed_gate.time_written(path, float_path, sample, (1, batch), require_faster=require_faster)


def normalised_file(src: Path, calibration: Any, target: str | Target, path: Path, options: dict
                    ) -> tuple[Path, list]:
    """The float file as the quantizer plans it (every normalisation pass, each proven, with the
    options that rewrite the float model: equalize, smooth_quant, int16's opset), saved once: each step
    quantizes it, and finds nothing more to normalise (the steps differ in placement only). Also the
    leading calibration batches (``STEP_SAMPLES``) the steps calibrate on."""
    placement, p, _ = placement_for(target, per_tensor=bool(options.get("per_tensor")))
    proto = load_onnx(src)
    inputs = model_inputs(proto)
    feeds = feeds_for(p, as_feeds(calibration, inputs))
    ready = prepare(proto, inputs, feeds, p, placement,
                    equalize=bool(options.get("equalize")), int16=bool(options.get("int16")),
                    smooth_quant=options.get("smooth_quant"), shared_scale=options.get("shared_scale", ()))
    onnx.save(ready.normal, str(path))
    return path, first_feeds(feeds, STEP_SAMPLES)


def by_reduction_length(path: Path, names: list[str]) -> list[str]:
    """``names`` (weighted ops of the normalised file at ``path``) ordered by how many products each
    output element sums, fewest first; graph order on ties."""
    model = onnx.load(str(path))
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    length: dict[str, int] = {}
    for i, node in enumerate(model.graph.node):
        label = node.name or f"{node.op_type}#{i}"
        shape = shapes.get(node.input[1]) if len(node.input) > 1 else None
        if label not in names or not shape:
            continue
        if node.op_type in ("Conv", "ConvTranspose"):
            length[label] = int(np.prod(shape[1:])) if node.op_type == "Conv" else int(shape[0] * np.prod(shape[2:]))
        elif node.op_type == "Gemm":
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            length[label] = int(shape[1] if trans_b else shape[0])
        else:
            length[label] = int(shape[-2]) if len(shape) >= 2 else int(shape[0])
    order = {n: k for k, n in enumerate(names)}
    return sorted(names, key=lambda n: (length.get(n, 1 << 30), order[n]))


def refuse_unless_ort_cpu(target: str | Target) -> None:
    """The search times the file in ONNX Runtime on this CPU: it serves the ONNX Runtime CPU target only."""
    p = targets.get(target)
    if not p.runtime_is_onnxruntime:
        raise SpecRefused(f"the speed search times files in ONNX Runtime on this CPU, the runtime of --target "
                          f"onnxruntime-cpu; {p.name}'s runtime is not that: time its engine on its own hardware, and keep "
                          "slow layers float with --exclude")


@takes_algorithms()
def speed_search_onnx(float_path: str | Path, out_path: str | Path, calibration: Any, *, target: str | Target,
                      exclude: Iterable[str] = (), max_steps: int | None = None, batches: Iterable[int] = BATCHES,
                      seconds: float = SECONDS, wait: bool = True, log: Callable[[str], None] = lambda _: None,
                      budget: Budget | None = None, fidelity_data: Any = None, metadata: dict[str, str] | None = None,
                      **options: Any) -> tuple[OnnxQuantizeResult, SpeedSearch]:
    """Quantize ``float_path`` for ``target`` (ONNX Runtime CPU) keeping float the weighted ops whose
    integer form made the file slower on this CPU (see the module docstring); write ``out_path``.

    ``exclude``: nodes kept float in every step. ``max_steps``: at most that many steps after step 0
    (None: every candidate). ``batches``: the batch sizes timed (a fixed-batch file: its own).
    ``options``: ``quantize_onnx_file``'s (observer, per_tensor, equalize, bias_correction, ...), in
    every step. ``budget``: each step's file judged against the float file on ``fidelity_data`` (else the
    calibration samples), a step that misses it not kept, and the written file held to it: ``FidelityMissed``,
    nothing written, when it misses (``repair.speed_search`` starts the search where the fidelity repair ends).
    ``metadata``: more ``metadata_props`` entries for the written file. Returns the written file's
    ``OnnxQuantizeResult`` and the search.
    """
    refuse_unless_ort_cpu(target)
    if max_steps is not None and max_steps < 0:
        raise SpecRefused(f"max_steps={max_steps!r}: give a number of steps >= 0, or None for every candidate")
    src = Path(float_path).expanduser()
    final = artifact.refuse_unsafe_destination(out_path, (src,))
    base = tuple(exclude)
    calibration = list(calibration) if not isinstance(calibration, (np.ndarray, dict)) else calibration
    feeds = timing_feeds(src, calibration, batches)
    search = SpeedSearch(cpu_line(), tuple(feeds), base)
    with artifact.workdir_beside(final) as scratch:
        normal, step_feeds = normalised_file(src, calibration, target, scratch / "normalised.onnx", options)
        structural = {k: v for k, v in options.items() if k in STRUCTURAL}
        sixteen_bit = set(options.get("int16") or ())  # quantized in 16 bits in every step: not candidates

        shared = FloatReference()  # the normalised file read once on the steps' samples

        def quantized(excluded: tuple[str, ...]) -> OnnxQuantizeResult:
            return quantize_onnx_file(normal, scratch / f"step{len(search.steps)}.onnx", step_feeds, target=target,
                                      exclude=excluded, wait=wait, run_check=False, float_reference=shared,
                                      budget=budget, fidelity_data=fidelity_data, **structural)

        sessions: dict[Path, Any] = {}

        def attempt(what: str, _: dict, excluded: tuple, wide: tuple) -> tuple[SpeedStep, Path] | None:
            kind, fastest = what.split()[0], [engine.best.artifact] if engine.best else []
            try:
                done = quantized(excluded)
            except QuantshipError as exc:  # e.g. nothing left to run as an integer kernel, a 16-bit node's neighbour float
                if not fastest:
                    raise
                search.steps.append(SpeedStep(kind, excluded, {}, {}, False, one_line(exc)))
                return None
            search.candidates = search.candidates or [n for n in done.plan["weighted_nodes"] if n not in sixteen_bit]
            current, *against = time_files([done.path, *fastest], feeds, seconds, sessions)
            lost = bool(fastest) and missed(done.fp32)
            kept = not fastest or (faster(current, against[0]) and not lost)
            if fastest:  # only the fastest file's session is kept
                sessions.pop(done.path if not kept else fastest[0], None)
            search.steps.append(SpeedStep(kind, excluded, current, against[0] if fastest else current, kept,
                                          lost=f"misses the fidelity budget ({done.fp32.describe()})" if lost else ""))
            return search.steps[-1], done.path

        def describe(s: SpeedStep) -> str:
            if s.kind == "start":
                return (f"on {search.cpu}, {len(search.candidates)} weighted op(s) as integer kernels: "
                        + ", ".join(f"b{b} {v:.3g} ms" for b, v in s.ms.items()))
            lost = f", not kept: it {s.lost}" if s.lost else ""
            return f"{len(s.excluded) - len(base)} op(s) float: {s.gain:.3f}x the fastest so far{' (kept)' * s.kept}{lost}"

        engine = Engine(attempt, score=lambda s: s.gain, goal=lambda s: False, accept=lambda c, b: c.measured.kept,
                        max_steps=max_steps, label="speed search", describe=describe, log=log)
        start = engine.step("start", {}, base)
        misses = 0
        for k in range(1, len(search.candidates)):
            if misses >= PATIENCE or not engine.left():
                break
            misses = 0 if engine.consider(engine.step(f"prefix {k}", {}, (*base, *search.candidates[:k]))) else misses + 1
        for node in by_reduction_length(normal, search.candidates):
            best = engine.best.excluded
            if node in best or len(best) - len(base) >= len(search.candidates) - 1:
                continue
            if not engine.left():
                break
            engine.consider(engine.step(f"single {node}", {}, (*best, node)))
        best, best_path, start_path = engine.best.excluded, engine.best.artifact, start.artifact
        with progress_step("speed search: the final reading"):
            if best_path == start_path:
                fp32, first = time_files([src, start_path], feeds, 2 * seconds)
                chosen = first
            else:
                fp32, first, chosen = time_files([src, start_path, best_path], feeds, 2 * seconds)
        search.final_ms = {"fp32": fp32, "start": first, "chosen": chosen}
        log(f"speed search: {search.describe()}")
        result = quantize_onnx_file(src, scratch / "chosen.onnx", calibration, target=target, exclude=best, wait=wait,
                                    budget=budget, fidelity_data=fidelity_data,
                                    metadata={**(metadata or {}), SEARCH_KEY: search.describe()}, **options)
        if missed(result.fp32):
            raise FidelityMissed(f"the speed search's file misses the fidelity budget against the float file "
                                 f"({result.fp32.describe()}); nothing written. Without --speed-search the "
                                 "default repairs it first (repair.speed_search starts the search from that file)",
                                 {"speed_search": search.as_dict(), "fidelity": result.fp32.as_dict()})
        return result.move_to(final, src, wait), search

