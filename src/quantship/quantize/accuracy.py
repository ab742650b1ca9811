"""Accuracy-aware quantization: keep the most sensitive layers in float until the accuracy drop
on the user's labelled data fits a budget.

The search is greedy and measured at every step. The per-layer SQNR report (``layer_error``)
orders the layers, worst first. The search then keeps one more of them in float
(``skip_activations``), quantizes again, and counts top-1 on the labelled data. It stops at the
first set whose drop against FP32 is within the budget. If no set fits, it refuses and names the
best set it found. Each step is recorded, so the user sees what every exclusion bought.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from quantship.errors import DataRefused, QuantshipError
from quantship.precision import under_modules
from quantship.progress import step as progress_step
from quantship.quantize.layer_error import layer_error


class AccuracyBudgetMissed(QuantshipError):
    """No exclusion set tried brought the accuracy drop within the budget; ``.search`` has the steps."""

    def __init__(self, message: str, search: AccuracySearch):
        super().__init__(message)
        self.search = search


@dataclass(frozen=True)
class SearchStep:
    """One quantization tried: the modules kept in float, and its top-1 on the labelled data."""

    excluded: tuple[str, ...]
    correct: int
    n: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.n

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "accuracy": self.accuracy}


@dataclass
class AccuracySearch:
    """The whole search: FP32 reference, the budget (percentage points), every step in order."""

    fp32_correct: int
    n: int
    max_drop_points: float
    order: list[str]  # candidate modules, most sensitive first (lowest SQNR)
    steps: list[SearchStep] = field(default_factory=list)

    @property
    def fp32_accuracy(self) -> float:
        return self.fp32_correct / self.n

    def drop_points(self, step: SearchStep) -> float:
        """Accuracy lost against FP32 by ``step``, in percentage points (negative: a gain)."""
        return 100.0 * (self.fp32_correct - step.correct) / self.n

    def within(self, step: SearchStep) -> bool:
        return self.drop_points(step) <= self.max_drop_points + 1e-9

    @property
    def met(self) -> bool:
        return any(self.within(s) for s in self.steps)

    @property
    def chosen(self) -> SearchStep:
        """The first step within the budget, else the most accurate step (fewest exclusions on ties)."""
        for step in self.steps:
            if self.within(step):
                return step
        return max(self.steps, key=lambda s: (s.correct, -len(s.excluded)))

    def as_dict(self) -> dict[str, Any]:
        return {
            "fp32_correct": self.fp32_correct, "n": self.n, "fp32_accuracy": self.fp32_accuracy,
            "max_drop_points": self.max_drop_points, "met": self.met, "order": list(self.order),
            "steps": [s.as_dict() | {"drop_points": self.drop_points(s)} for s in self.steps],
            "chosen": list(self.chosen.excluded) if self.steps else [],
        }

    def to_markdown(self) -> str:
        lines = [f"FP32 top-1: {self.fp32_correct}/{self.n} = {self.fp32_accuracy:.4f}; budget: a drop of at most "
                 f"{self.max_drop_points:g} point(s)", "",
                 "| step | kept in float | top-1 | drop (points) | within budget |", "|---:|---|---|---:|---|"]
        for i, s in enumerate(self.steps):
            kept = ", ".join(s.excluded) or "(nothing)"
            lines.append(f"| {i} | {kept} | {s.correct}/{s.n} | {self.drop_points(s):+.2f} | "
                         f"{'yes' if self.within(s) else 'no'} |")
        return "\n".join(lines)


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
    """Module names to keep in float, most sensitive first (lowest SQNR of the layer output)."""

    report = layer_error(model, quantized, list(batches))
    names: list[str] = []
    for row in sorted(report.rows, key=lambda r: r.sqnr_db):
        if row.module and row.module not in names:
            names.append(row.module)
    return names


def own_loss_order(model: torch.nn.Module, quantized: torch.nn.Module, batches: Sequence[torch.Tensor]) -> list[str]:
    """Module names to keep in float for the fidelity repair, the layer that loses the most signal itself
    first (``LayerError.own_loss_db``: a layer that only carries an upstream loss does not rank)."""
    report = layer_error(model, quantized, list(batches))
    names: list[str] = []
    for row in sorted(report.rows, key=lambda r: (-r.own_loss_db, r.order)):
        if row.module and row.own_loss_db > 0 and row.module not in names:
            names.append(row.module)
    return names


def search(
    quantize: Callable[[tuple[str, ...]], torch.nn.Module],
    model: torch.nn.Module,
    labelled: Any,
    max_drop_points: float,
    *,
    max_steps: int | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[torch.nn.Module, AccuracySearch]:
    """Greedy search; ``quantize(excluded)`` returns the model quantized with those modules in float.

    Returns the chosen quantized model and the search. Raises ``AccuracyBudgetMissed`` when no step
    fits the budget.
    """
    if not isinstance(max_drop_points, (int, float)) or isinstance(max_drop_points, bool) or max_drop_points < 0:
        raise DataRefused(f"max_accuracy_drop={max_drop_points!r}: give a budget in percentage points, >= 0")
    batches = labelled_batches(labelled)
    n = sum(len(y) for _, y in batches)
    model = model.eval()
    with progress_step("accuracy search: top-1 of FP32"):
        fp32 = count_correct(model, batches)
    result = AccuracySearch(fp32, n, float(max_drop_points), order=[])
    excluded: tuple[str, ...] = ()
    with progress_step("accuracy search: step 0 (nothing kept in float)"):
        current = quantize(excluded)
        result.steps.append(SearchStep(excluded, count_correct(current, batches), n))
    log(f"accuracy: FP32 {fp32}/{n}; INT8 {result.steps[-1].correct}/{n} "
        f"(drop {result.drop_points(result.steps[-1]):+.2f} points, budget {max_drop_points:g})")
    if result.within(result.steps[-1]):
        return current, result
    if max_steps != 0:
        with progress_step("accuracy search: per-layer SQNR order"):
            result.order = sensitivity_order(model, current, [x for x, _ in batches])
    limit = len(result.order) if max_steps is None else min(max_steps, len(result.order))
    for name in result.order:
        if len(result.steps) > limit:
            break
        if under_modules(name, excluded):
            continue  # a module already kept in float keeps everything under it: the same model again
        excluded = (*excluded, name)
        with progress_step(f"accuracy search: step {len(result.steps)} (keeping {name} in float)"):
            candidate = quantize(excluded)
            step = SearchStep(excluded, count_correct(candidate, batches), n)
        result.steps.append(step)
        log(f"accuracy: keeping {list(excluded)} in float: {step.correct}/{n} "
            f"(drop {result.drop_points(step):+.2f} points)")
        if result.within(step):
            return candidate, result
    best = result.chosen
    raise AccuracyBudgetMissed(
        f"no exclusion set met the budget of {max_drop_points:g} point(s): FP32 {fp32}/{n}; the best found keeps "
        f"{list(best.excluded) or 'nothing'} in float and scores {best.correct}/{n} (drop "
        f"{result.drop_points(best):+.2f} points) after {len(result.steps)} quantization(s). Raise the budget, give "
        "more calibration data, or train with QuantizeCallback (QAT)", result) from None
