"""Accuracy search on an ONNX file: give the most sensitive nodes 16-bit activations, or keep them in
float, until the metric of the written file fits a budget (the PyTorch path's ``quantize.accuracy``, on
quantize-onnx's engine).

``search_onnx`` quantizes with nothing more kept in float (step 0) and measures the metric of the
written file in ONNX Runtime at its default optimizations (what a user runs). If the drop against
the float file is over ``max_drop``, the per-node SQNR report (``sensitivity.node_sqnr``, on step 0's
file) orders the nodes worst first. For each node in turn, where the target runs 16-bit activations
(``int16.runs_int16``), a step first gives it 16-bit activations (``int16``), then, if that misses
the budget, a step keeps it in float (``exclude``); the node keeps whichever form scored higher for the
next nodes' steps (float on a tie: ONNX Runtime's CPU kernels have no 16-bit form, so a 16-bit node runs
a float kernel plus its 16-bit Q/DQ pairs; bench/int16.py measured it no faster than float at batch 1). It stops at the first step within the budget. Every step is
quantized into a temporary folder beside ``out_path``; only the accepted file is moved there. When
no step fits, ``OnnxBudgetMissed`` names the best set and every step, and nothing is written.

The metric: top-1 on labelled data (``labelled=(x, y)``: a percentage, so ``max_drop`` is in
percentage points, each step with its Wilson 95% interval), or any ``metric(run) -> float`` for tasks
that are not top-1, where ``run(inputs)`` runs the file (``inputs``: an array for a single-input
file, else a dict by input name) and returns its outputs; higher is better, and ``max_drop`` is in
the metric's own units.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from quantship.errors import DataRefused, ExportRefused, QuantshipError, SpecRefused, one_line
from quantship.export import artifact
from quantship.inspect.run.consumers import ort_session
from quantship.intervals import wilson_interval
from quantship.progress import step as progress_step
from quantship.quantize_onnx.int16 import runs_int16
from quantship.quantize_onnx.quantizer import OnnxQuantizeResult, quantize_onnx_file
from quantship.quantize_onnx.sensitivity import node_sqnr
from quantship.targets import Target

Run = Callable[[Any], list[np.ndarray]]
TOP1 = "top-1 (%)"


@dataclass(frozen=True)
class OnnxSearchStep:
    """One file tried: the nodes kept in float and those with 16-bit activations, its metric; for top-1
    the count and Wilson interval."""

    excluded: tuple[str, ...]
    metric: float
    correct: int | None = None
    n: int | None = None
    int16: tuple[str, ...] = ()

    @property
    def interval(self) -> tuple[float, float] | None:
        """Wilson 95% interval of top-1, in percent (None for another metric)."""
        if self.correct is None or not self.n:
            return None
        low, high = wilson_interval(self.correct, self.n)
        return 100.0 * low, 100.0 * high

    def describe(self) -> str:
        if self.correct is None:
            return f"{self.metric:.4g}"
        low, high = self.interval
        return f"{self.correct}/{self.n} = {self.metric:.2f}% [{low:.1f}, {high:.1f}]"

    def forms(self) -> str:
        """Which form each searched node took: ``kept in float: ...; 16-bit: ...``."""
        shown = f"kept in float: {', '.join(self.excluded) or 'nothing'}"
        return shown + (f"; 16-bit: {', '.join(self.int16)}" if self.int16 else "")

    def as_dict(self) -> dict:
        return {"excluded": list(self.excluded), "int16": list(self.int16), "metric": self.metric,
                "correct": self.correct, "n": self.n, "interval": list(self.interval) if self.interval else None}


@dataclass
class OnnxSearch:
    """The whole search: the float file's metric, the budget, the candidate order, every step."""

    metric_name: str
    float_step: OnnxSearchStep
    max_drop: float
    order: list[str] = field(default_factory=list)  # candidate nodes, lowest SQNR first
    steps: list[OnnxSearchStep] = field(default_factory=list)
    refused: str | None = None  # the exclusion set that could not be quantized, where the search stopped

    def drop(self, s: OnnxSearchStep) -> float:
        return self.float_step.metric - s.metric

    def within(self, s: OnnxSearchStep) -> bool:
        return self.drop(s) <= self.max_drop + 1e-9

    @property
    def met(self) -> bool:
        return any(self.within(s) for s in self.steps)

    @property
    def chosen(self) -> OnnxSearchStep:
        """The first step within the budget, else the best step (fewest exclusions on ties)."""
        for s in self.steps:
            if self.within(s):
                return s
        return max(self.steps, key=lambda s: (s.metric, -len(s.excluded), -len(s.int16)))

    def as_dict(self) -> dict:
        return {"metric": self.metric_name, "float": self.float_step.as_dict(), "max_drop": self.max_drop,
                "met": self.met, "order": list(self.order),
                "steps": [s.as_dict() | {"drop": self.drop(s), "within": self.within(s)} for s in self.steps],
                "chosen": list(self.chosen.excluded) if self.steps else [],
                "chosen_int16": list(self.chosen.int16) if self.steps else [], "refused": self.refused}

    def to_markdown(self) -> str:
        lines = [f"float file {self.metric_name}: {self.float_step.describe()}; budget: a drop of at most "
                 f"{self.max_drop:g}", "", f"| step | kept in float | 16-bit | {self.metric_name} | drop | within budget |",
                 "|---:|---|---|---|---:|---|"]
        for i, s in enumerate(self.steps):
            lines.append(f"| {i} | {', '.join(s.excluded) or '(nothing)'} | {', '.join(s.int16) or '-'} | "
                         f"{s.describe()} | {self.drop(s):+.3g} | {'yes' if self.within(s) else 'no'} |")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: every step's exclusions and drop."""
        return "; ".join(f"step {i} [{', '.join(s.excluded) or 'nothing'}]"
                         f"{' 16-bit [' + ', '.join(s.int16) + ']' if s.int16 else ''} drop {self.drop(s):+.3g}"
                         for i, s in enumerate(self.steps))


class OnnxBudgetMissed(QuantshipError):
    """No step of the search met the budget; ``.search`` holds every step. Nothing was written."""

    def __init__(self, message: str, search: OnnxSearch):
        super().__init__(message)
        self.search = search


def file_runner(path: str | Path) -> tuple[Run, list[str], int | None]:
    """``run(inputs) -> outputs`` of the file in ONNX Runtime at its default optimizations, its input
    names and its fixed batch (None when dynamic)."""
    session = ort_session(path, optimized=True)
    names = [i.name for i in session.get_inputs()]
    first = session.get_inputs()[0].shape
    fixed = first[0] if first and isinstance(first[0], int) and first[0] > 0 else None

    def run(inputs: Any) -> list[np.ndarray]:
        feed = dict(inputs) if isinstance(inputs, dict) else {names[0]: np.ascontiguousarray(inputs)}
        return session.run(None, feed)

    return run, names, fixed


def top1(run: Run, x: np.ndarray, y: np.ndarray, batch_size: int, fixed_batch: int | None = None) -> tuple[int, int]:
    """Correct top-1 predictions of the first output over (x, y), in batches (a short last batch padded
    with zeros for a fixed-batch file, the padding not counted)."""
    size = fixed_batch or batch_size
    correct = 0
    for start in range(0, len(y), size):
        part = x[start:start + size]
        real = len(part)
        if fixed_batch and real < size:
            part = np.concatenate([part, np.zeros((size - real, *part.shape[1:]), dtype=part.dtype)])
        logits = np.asarray(run(part)[0])
        correct += int((logits.reshape(len(part), -1)[:real].argmax(-1) == y[start:start + real]).sum())
    return correct, len(y)


def _scorer(labelled: tuple[np.ndarray, np.ndarray] | None, metric: Callable[[Run], float] | None,
            batch_size: int) -> tuple[str, Callable[[Path], OnnxSearchStep]]:
    if (labelled is None) == (metric is None):
        raise DataRefused("give the search one metric: labelled=(x, y) for top-1, or metric=callable(run) -> float")
    if labelled is not None:
        x, y = (np.asarray(a) for a in labelled)
        if len(x) != len(y) or len(y) == 0 or y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DataRefused(f"labelled data: x has {len(x)} sample(s) and y shape {list(y.shape)} ({y.dtype}); "
                              "give y as one integer class index per sample")

        def score(path: Path, excluded: tuple[str, ...] = (), wide: tuple[str, ...] = ()) -> OnnxSearchStep:
            run, _, fixed = file_runner(path)
            correct, n = top1(run, x, y, batch_size, fixed)
            return OnnxSearchStep(excluded, 100.0 * correct / n, correct, n, wide)

        return TOP1, score

    def score_metric(path: Path, excluded: tuple[str, ...] = (), wide: tuple[str, ...] = ()) -> OnnxSearchStep:
        value = float(metric(file_runner(path)[0]))
        if not np.isfinite(value):
            raise DataRefused(f"the metric gave {value} on {path.name}: it must return a finite number")
        return OnnxSearchStep(excluded, value, int16=wide)

    return getattr(metric, "__name__", "metric"), score_metric


def search_onnx(float_path: str | Path, out_path: str | Path, calibration: Any, *, target: str | Target,
                max_drop: float, labelled: tuple[np.ndarray, np.ndarray] | None = None,
                metric: Callable[[Run], float] | None = None, exclude: Iterable[str] = (),
                observer: str | None = None, per_tensor: bool = False, max_steps: int | None = None,
                batch_size: int = 32, wait: bool = True, equalize: bool = False, bias_correction: bool = False,
                smooth_quant: float | None = None, seq_mse: bool = False, adaround: bool | int = False,
                int16: Iterable[str] = (), try_int16: bool = True,
                log: Callable[[str], None] = lambda _: None) -> tuple[OnnxQuantizeResult, OnnxSearch]:
    """Quantize ``float_path`` for ``target`` keeping the fewest nodes in float whose file loses at most
    ``max_drop`` of the metric (see the module docstring); write it at ``out_path``.

    ``exclude`` / ``int16``: nodes kept in float / with 16-bit activations in every step (the search adds
    to them). ``try_int16``: try 16-bit before float for each node (where the target runs it).
    ``equalize`` / ``bias_correction`` / ``smooth_quant`` / ``seq_mse`` / ``adaround``: as
    ``quantize_onnx_file``'s, in every step. ``max_steps``: at most that many candidate nodes after step 0,
    each one or two steps (None: every candidate node). Returns the accepted file's
    ``OnnxQuantizeResult`` and the search; raises ``OnnxBudgetMissed`` (nothing written) when no step fits.
    """
    if isinstance(max_drop, bool) or not isinstance(max_drop, (int, float)) or not max_drop >= 0:
        raise DataRefused(f"max_drop={max_drop!r}: give the budget as a number >= 0 (top-1: percentage points)")
    if max_steps is not None and max_steps < 0:
        raise DataRefused(f"max_steps={max_steps!r}: give a number of steps >= 0, or None for every candidate")
    name, score = _scorer(labelled, metric, batch_size)
    src = Path(float_path).expanduser()
    final = artifact.refuse_unsafe_destination(out_path, (src,))
    base, base_wide = tuple(exclude), tuple(int16)
    sixteen_first = try_int16 and runs_int16(target)
    options = dict(target=target, observer=observer, per_tensor=per_tensor, equalize=equalize,
                   bias_correction=bias_correction, smooth_quant=smooth_quant, seq_mse=seq_mse, adaround=adaround)
    with progress_step(f"accuracy search: {name} of the float file"):
        reference = score(src)
    result = OnnxSearch(name, reference, float(max_drop))
    with artifact.workdir_beside(final) as scratch:
        def attempt(excluded: tuple[str, ...], wide: tuple[str, ...]) -> tuple[OnnxQuantizeResult, OnnxSearchStep]:
            k = len(result.steps)
            with progress_step(f"accuracy search: step {k} ({len(excluded) - len(base)} node(s) kept in float, "
                               f"{len(wide) - len(base_wide)} in 16-bit)"):
                done = quantize_onnx_file(src, scratch / f"step{k}.onnx", calibration, exclude=excluded,
                                          int16=wide, **options)
                measured = score(done.path, excluded, wide)
            result.steps.append(measured)
            log(f"accuracy search: step {k}, {measured.forms()}: {name} "
                f"{measured.describe()} (float {reference.describe()}, drop {result.drop(measured):+.3g})")
            return done, measured

        done, measured = attempt(base, base_wide)
        if not result.within(measured) and max_steps != 0:
            with progress_step("accuracy search: per-node SQNR order"):
                report = node_sqnr(src, calibration, exclude=base, quantized_path=done.path, **options)
            result.order = [r.node for r in report.candidates() if r.node not in base and r.node not in base_wide]
            limit = len(result.order) if max_steps is None else min(max_steps, len(result.order))
            excluded, wide = base, base_wide
            for node in result.order[:limit]:
                tried = None
                if sixteen_first:
                    try:
                        tried = attempt(excluded, (*wide, node))
                    except (ExportRefused, SpecRefused) as exc:  # the node has no 16-bit form here: float next
                        log(f"accuracy search: {node} in 16-bit gives no file ({one_line(exc)})")
                    if tried is not None and result.within(tried[1]):
                        done, measured = tried
                        break
                try:
                    done, measured = attempt((*excluded, node), wide)
                except ExportRefused as exc:  # e.g. nothing left to quantize: no further exclusion can help
                    result.refused = f"{list((*excluded, node))}: {one_line(exc)}"
                    log(f"accuracy search: keeping {list((*excluded, node))} in float gives no file ({one_line(exc)})")
                    if tried is not None:
                        done, measured = tried
                    break
                if result.within(measured):
                    break
                if tried is not None and tried[1].metric > measured.metric:
                    done, measured = tried
                    wide = (*wide, node)
                else:
                    excluded = (*excluded, node)
        if not result.within(measured):
            best = result.chosen
            stopped = f"; stopped: {result.refused}" if result.refused else ""
            raise OnnxBudgetMissed(
                f"no exclusion set met the budget of {max_drop:g} ({name}): float file {reference.describe()}; the "
                f"best found keeps {list(best.excluded) or 'nothing'} in float"
                f"{' and ' + str(list(best.int16)) + ' in 16-bit' if best.int16 else ''} and scores {best.describe()} (drop "
                f"{result.drop(best):+.3g}) after {len(result.steps)} quantization(s) [{result.summary()}]{stopped}; nothing "
                "written. Raise --max-drop, allow more steps, or give more calibration data", result)
        with artifact.atomic_destination(final, wait=wait, inputs=(src,)) as staged:
            os.replace(done.path, staged)
    done.path = final
    done.verdict.path = str(final)
    return done, result


def steps_table(search: OnnxSearch) -> list[tuple[str, str]]:
    """Report rows: one per step."""
    return [(f"search step {i}", f"{s.forms()}; {search.metric_name} "
             f"{s.describe()}, drop {search.drop(s):+.3g}{' (within budget)' if search.within(s) else ''}")
            for i, s in enumerate(search.steps)]

