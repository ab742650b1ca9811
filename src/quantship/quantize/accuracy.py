"""Accuracy-aware quantization on the PyTorch path: keep the most sensitive layers in float until the drop
of a metric (top-1 on the user's labelled data, or any callable) fits a budget.

The PyTorch front-end of the labelled search (``search_engine.metric_search``, the ONNX path's is
``quantize_onnx.search``): the per-layer SQNR report (``layer_error``) orders the layers, worst first;
each step keeps one more of them in float (``skip_activations``), quantizes again and scores the model;
the search stops at the first set whose drop against FP32 is within the budget, or refuses and names
the best set it found. Also the two layer orders (``sensitivity_order``, ``own_loss_order``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from quantship.errors import DataRefused, QuantshipError
from quantship.precision import under_modules
from quantship.progress import step as progress_step
from quantship.quantize.layer_error import layer_error
from quantship.search_engine import TOP1, BudgetMissed, MetricSearch, MetricStep, metric_search, metric_step

AccuracyBudgetMissed = BudgetMissed  # the name this path had
SearchStep = MetricStep


class AccuracySearch(MetricSearch):
    """The labelled search of the PyTorch path; for top-1, the counts in the names this path had."""

    n = property(lambda self: self.float_step.n)
    fp32_correct = property(lambda self: self.float_step.correct)
    max_drop_points = property(lambda self: self.max_drop)
    drop_points = MetricSearch.drop  # the metric lost against FP32 (top-1: percentage points)

    def as_dict(self) -> dict[str, Any]:
        return super().as_dict() | {"fp32_correct": self.fp32_correct, "n": self.n, "max_drop_points": self.max_drop}


def labelled_batches(data: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y)`` batches from a list of pairs, a loader of pairs, or one ``(x, y)`` pair of tensors."""
    if isinstance(data, tuple) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        batches = [data]
    else:
        try:
            batches = [tuple(b[:2]) for b in data]
        except TypeError:
            raise DataRefused(f"labelled data must be (x, y) batches, got {type(data).__name__}") from None
    if not batches:
        raise DataRefused("the labelled data is empty: accuracy needs at least one (x, y) batch")
    for x, y in batches:
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or len(x) != len(y):
            raise DataRefused("every labelled batch must be (x, y) tensors of the same length (inputs, class indices)")
        if not torch.isfinite(x).all():
            raise DataRefused("the labelled inputs hold NaN or Inf values")
    return batches


def count_correct(model: Callable, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Top-1 correct predictions of ``model`` over ``batches``."""
    correct = 0
    with torch.no_grad():
        for x, y in batches:
            out = model(x)
            while isinstance(out, (tuple, list)):
                out = out[0]
            correct += int((out.argmax(-1) == y).sum())
    return correct


def sensitivity_order(model: torch.nn.Module, quantized: torch.nn.Module, batches: Sequence[torch.Tensor]) -> list[str]:
    """Modules or ops to keep in float (``LayerError.unit``), most sensitive first (lowest SQNR of the layer
    output)."""
    rows = sorted(layer_error(model, quantized, list(batches)).rows, key=lambda r: r.sqnr_db)
    return list(dict.fromkeys(r.unit for r in rows))


def own_loss_order(model: torch.nn.Module, quantized: torch.nn.Module, batches: Sequence[torch.Tensor]) -> list[str]:
    """Modules or ops to keep in float or in 16 bits for the fidelity repair (``LayerError.unit``), the layer that
    loses the most signal itself first (``LayerError.own_loss_db``: a layer that only carries an upstream loss does
    not rank), then the modules that hold the ranked ops, in the same order: they also cover the ops the report
    cannot measure (one the annotator wrote itself, an attention decomposed), so a repair that the ops alone do not
    make can still be found, coarser."""
    rows = [r for r in sorted(layer_error(model, quantized, list(batches)).rows, key=lambda r: (-r.own_loss_db, r.order))
            if r.own_loss_db > 0]
    units = list(dict.fromkeys(r.unit for r in rows))
    return units + [m for m in dict.fromkeys(r.module for r in rows if r.module) if m not in units]


def search(
    quantize: Callable[[tuple[str, ...]], torch.nn.Module],
    model: torch.nn.Module,
    labelled: Any,
    max_drop_points: float,
    *,
    metric: Callable[[torch.nn.Module], float] | None = None,
    inputs: Sequence[torch.Tensor] = (),
    max_steps: int | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[torch.nn.Module, AccuracySearch]:
    """The labelled search on a PyTorch model; ``quantize(excluded)`` returns it quantized with those modules
    in float. The metric: top-1 on ``labelled`` ((x, y) batches, the budget in points), or ``metric(model)
    -> float``, higher is better (mAP, F1, negative WER...; the budget in its units; ``inputs``: the batches
    the layers are ranked on without ``labelled``). ``max_steps`` bounds the quantizations after step 0.
    Returns the chosen model and the search; raises ``AccuracyBudgetMissed`` when no step fits."""
    if not isinstance(max_drop_points, (int, float)) or isinstance(max_drop_points, bool) or max_drop_points < 0:
        raise DataRefused(f"max_accuracy_drop={max_drop_points!r}: give a budget in percentage points, >= 0")
    if labelled is None and metric is None:
        raise DataRefused("the accuracy search needs labelled (x, y) batches for top-1, or metric=callable(model)")
    batches = labelled_batches(labelled) if labelled is not None else []
    if not batches and not inputs:
        raise DataRefused("the accuracy search ranks the layers on input batches: give labelled data or inputs")
    model = model.eval()

    def score(candidate: Callable, excluded: tuple[str, ...] = ()) -> MetricStep:
        if metric is not None:
            return metric_step(excluded, (), float(metric(candidate)))
        return metric_step(excluded, (), counts=(count_correct(candidate, batches), sum(len(y) for _, y in batches)))

    with progress_step("accuracy search: the metric of FP32"):
        result = AccuracySearch(TOP1 if metric is None else getattr(metric, "__name__", "metric"), score(model),
                                float(max_drop_points))
    def attempt(what: str, _: dict, excluded: tuple[str, ...], wide: tuple) -> tuple[MetricStep, Any] | None:
        try:
            quantized = quantize(excluded)
        except QuantshipError:
            if not excluded:
                raise  # the model as asked cannot be quantized: the caller's refusal
            return None  # e.g. every weighted layer kept float: no INT8 model (the search stops there)
        return score(quantized, excluded), quantized

    chosen = metric_search(
        attempt, result,
        lambda quantized: sensitivity_order(model, quantized, [x for x, _ in batches] or list(inputs)),
        skip=lambda name, best: under_modules(name, best.excluded), max_steps=max_steps, log=log,
        advice="Raise the budget, give more calibration data, or train with QuantizeCallback (QAT)")
    return chosen, result
