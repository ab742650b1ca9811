"""Accuracy search on an ONNX file: the ONNX front-end of the labelled search (``search_engine.metric_search``;
the PyTorch path's is ``quantize.accuracy``): give the most sensitive nodes 16-bit activations, or keep them
in float, until the metric of the written file fits a budget.

Each step's file is measured in ONNX Runtime at its default optimizations (what a user runs); the
per-node SQNR report (``sensitivity.node_sqnr``, on step 0's file) orders the nodes worst first; 16-bit
is tried first where the target runs it (``int16.runs_int16``, as the ONNX path's repair), and float wins a tie.
Every step is quantized into a temporary folder beside ``out_path``; only the accepted file is moved
there. When no step fits, ``OnnxBudgetMissed`` names the best set and every step; nothing is written.

The metric: top-1 on labelled data (``labelled=(x, y)``: a percentage, so ``max_drop`` is in
percentage points, each step with its Wilson 95% interval), or any ``metric(run) -> float`` (higher is
better, ``max_drop`` in its units), where ``run(inputs)`` runs the file (``inputs``: an array for a
single-input file, else a dict by input name) and returns its outputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from quantship.errors import DataRefused, ExportRefused, SpecRefused, one_line
from quantship.export import artifact
from quantship.inspect.run.consumers import ort_session
from quantship.progress import step as progress_step
from quantship.quantize_onnx.int16 import runs_int16
from quantship.quantize_onnx.quantizer import FloatReference, OnnxQuantizeResult, quantize_onnx_file
from quantship.quantize_onnx.sensitivity import node_sqnr
from quantship.recipe import takes_algorithms
from quantship.search_engine import TOP1, BudgetMissed, MetricSearch, MetricStep, metric_search, metric_step
from quantship.targets import Target

Run = Callable[[Any], list[np.ndarray]]
OnnxSearchStep, OnnxSearch, OnnxBudgetMissed = MetricStep, MetricSearch, BudgetMissed  # the names this path had


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


def scorer(labelled: tuple[np.ndarray, np.ndarray] | None, metric: Callable[[Run], float] | None,
           batch_size: int) -> tuple[str, Callable[..., OnnxSearchStep]]:
    """The metric's name and ``score(path, excluded=(), wide=())``: the file's top-1 on ``labelled``, or ``metric``."""
    if (labelled is None) == (metric is None):
        raise DataRefused("give the search one metric: labelled=(x, y) for top-1, or metric=callable(run) -> float")
    if labelled is not None:
        x, y = (np.asarray(a) for a in labelled)
        if len(x) != len(y) or len(y) == 0 or y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DataRefused(f"labelled data: x has {len(x)} sample(s) and y shape {list(y.shape)} ({y.dtype}); "
                              "give y as one integer class index per sample")

    def score(path: Path, excluded: tuple[str, ...] = (), wide: tuple[str, ...] = ()) -> OnnxSearchStep:
        run, _, fixed = file_runner(path)
        if metric is not None:
            return metric_step(excluded, wide, float(metric(run)))
        return metric_step(excluded, wide, counts=top1(run, x, y, batch_size, fixed))

    return (TOP1 if metric is None else getattr(metric, "__name__", "metric")), score


@takes_algorithms()
def search_onnx(float_path: str | Path, out_path: str | Path, calibration: Any, *, target: str | Target,
                max_drop: float, labelled: tuple[np.ndarray, np.ndarray] | None = None,
                metric: Callable[[Run], float] | None = None, exclude: Iterable[str] = (),
                observer: str | None = None, per_tensor: bool = False, max_steps: int | None = None,
                batch_size: int = 32, wait: bool = True, equalize: bool = False, bias_correction: bool = False,
                smooth_quant: float | None = None, seq_mse: bool = False, adaround: bool | int = False,
                int16: Iterable[str] = (), try_int16: bool = True,
                log: Callable[[str], None] = lambda _: None) -> tuple[OnnxQuantizeResult, OnnxSearch]:
    """Quantize ``float_path`` for ``target`` with the fewest nodes changed whose file loses at most ``max_drop``
    of the metric (module docstring); write ``out_path``. ``exclude`` / ``int16``: nodes in float / 16-bit in
    every step; ``try_int16``: 16-bit before float (where the target runs it); the algorithm options as
    ``quantize_onnx_file``'s, in every step; ``max_steps``: at most that many candidate nodes after step 0
    (None: all). Returns the file's ``OnnxQuantizeResult`` and the search, or raises ``OnnxBudgetMissed``.
    """
    if isinstance(max_drop, bool) or not isinstance(max_drop, (int, float)) or not max_drop >= 0:
        raise DataRefused(f"max_drop={max_drop!r}: give the budget as a number >= 0 (top-1: percentage points)")
    if max_steps is not None and max_steps < 0:
        raise DataRefused(f"max_steps={max_steps!r}: give a number of steps >= 0, or None for every candidate")
    name, score = scorer(labelled, metric, batch_size)
    src = Path(float_path).expanduser()
    final = artifact.refuse_unsafe_destination(out_path, (src,))
    options = dict(target=target, observer=observer, per_tensor=per_tensor, equalize=equalize,
                   bias_correction=bias_correction, smooth_quant=smooth_quant, seq_mse=seq_mse, adaround=adaround)
    with progress_step(f"accuracy search: {name} of the float file"):
        result = MetricSearch(name, score(src), float(max_drop))
    base, files = (tuple(exclude), tuple(int16)), itertools.count()
    shared = FloatReference()  # the float file read once on the calibration samples, for every step's file
    with artifact.workdir_beside(final) as scratch:
        def attempt(what: str, _: dict, excluded: tuple, wide: tuple) -> tuple[OnnxSearchStep, OnnxQuantizeResult] | None:
            try:
                done = quantize_onnx_file(src, scratch / f"step{next(files)}.onnx", calibration,
                                          exclude=excluded, int16=wide, float_reference=shared, **options)
            except (ExportRefused, SpecRefused) as exc:  # step 0's refusal is the user's; later: no such file
                if what == "as asked" or (what.startswith("float") and not isinstance(exc, ExportRefused)):
                    raise
                if what.startswith("float"):  # e.g. nothing left to quantize: no further exclusion can help
                    result.refused = f"{list(excluded)}: {one_line(exc)}"
                log(f"accuracy search: {what} gives no file ({one_line(exc)})")
                return None
            return score(done.path, excluded, wide), done

        def order(done: OnnxQuantizeResult) -> list[str]:
            report = node_sqnr(src, calibration, exclude=base[0], quantized_path=done.path, **options)
            return [r.node for r in report.candidates()]

        done = metric_search(attempt, result, order, sixteen=try_int16 and runs_int16(target), max_nodes=max_steps,
                             base=base, log=log,
                             advice="Raise --max-drop, allow more steps, or give more calibration data")
        with artifact.atomic_destination(final, wait=wait, inputs=(src,)) as staged:
            artifact.move_with_data(Path(done.path), staged)
    done.path = final
    done.verdict.path = str(final)
    return done, result


def steps_table(search: OnnxSearch) -> list[tuple[str, str]]:
    """Report rows: one per step."""
    return [(f"search step {i}", f"{s.forms()}; {search.metric_name} "
             f"{s.describe()}, drop {search.drop(s):+.3g}{' (within budget)' if search.within(s) else ''}")
            for i, s in enumerate(search.steps)]

