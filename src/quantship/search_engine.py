"""One greedy search engine for the searches that change a quantized file one step at a time: the fidelity
repair (``repair_loop``), the accuracy search of both front-ends (its labelled variant, any metric:
``metric_search``) and the speed search (``quantize_onnx.speed``).

A front-end answers ``attempt(what, options, excluded, wide)``: one whole file (or model) with those
options, those nodes kept float and those in 16-bit activations, as ``(measured, artifact)``, or None
when it cannot be made (the step is recorded as giving no file). A client gives the engine a ``score``
(measured -> float, higher is better), a ``goal`` (measured -> bool: the budget is kept) and an
``accept`` rule (candidate step, best step -> bool: the candidate becomes the base of the next steps).
The strategies below order the candidate steps over the best step so far; ``max_steps`` bounds the
files tried after step 0. Every step is recorded: what, the nodes changed, the score, the seconds.

Imports no front-end: numpy-, torch- and onnx-free.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from quantship.errors import DataRefused, QuantshipError
from quantship.intervals import wilson_interval
from quantship.progress import step as progress_step

Attempt = Callable[[str, dict, tuple, tuple], "tuple[Any, Any] | None"]
TOP1 = "top-1 (%)"


@dataclass
class Step:
    """One file the engine tried: what changed, the options, the nodes in float and in 16-bit, the front-end's
    measurement, its score, whether it keeps the goal and whether it became the base of the next steps."""

    what: str
    options: dict
    excluded: tuple
    wide: tuple
    measured: Any
    artifact: Any
    score: float
    met: bool
    seconds: float
    kept: bool = False


class Engine:
    """Runs the steps a strategy asks for, and keeps the record (see the module docstring)."""

    def __init__(self, attempt: Attempt, *, score: Callable[[Any], float], goal: Callable[[Any], bool],
                 accept: Callable[[Step, Step], bool] = lambda c, best: c.score > best.score,
                 max_steps: int | None = None, label: str = "search", describe: Callable[[Any], str] = str, log: Callable[[str], None] = lambda _: None):
        self.attempt, self.score, self.goal, self.accept = attempt, score, goal, accept
        self.max_steps, self.label, self.describe, self.log = max_steps, label, describe, log
        self.steps: list[Step] = []
        self.tried = 0  # files asked for, those that gave none included
        self.best: Step | None = None
        self.stopped: str | None = None
        self.set_aside: list[str] = []  # nodes a strategy stopped trying (``fewest_nodes``: their float gave no file)

    def left(self) -> bool:
        """Whether ``max_steps`` allows another file after step 0 (else the reason is recorded)."""
        if self.max_steps is not None and self.tried - 1 >= self.max_steps:
            self.stopped = f"--max-steps {self.max_steps} reached"
            return False
        return True

    def step(self, what: str, options: dict, excluded: tuple = (), wide: tuple = ()) -> Step | None:
        """Make and measure one file; the first one made is the base of the next steps."""
        k, started = len(self.steps), time.perf_counter()
        self.tried += 1
        with progress_step(f"{self.label}: step {k} ({what})"):
            made = self.attempt(what, dict(options), tuple(excluded), tuple(wide))
        if made is None:
            self.log(f"{self.label}: {what} gives no file")
            return None
        measured, artifact = made
        step = Step(what, dict(options), tuple(excluded), tuple(wide), measured, artifact, float(self.score(measured)),
                    bool(self.goal(measured)), time.perf_counter() - started)
        self.steps.append(step)
        if self.best is None:
            step.kept, self.best = True, step
        self.log(f"{self.label}: step {k}, {what}: {self.describe(measured)}")
        return step

    def consider(self, step: Step | None) -> bool:
        """The step becomes the base of the next steps when the accept rule says so."""
        if step is None or step is self.best or not self.accept(step, self.best):
            return False
        step.kept, self.best = True, step
        return True

    def fewest(self, key: Callable[[Step], tuple] = lambda s: (len(s.excluded), len(s.wide))) -> Step | None:
        """The step that keeps the goal with the fewest changes (the earliest on ties), or None."""
        met = [(key(s), k) for k, s in enumerate(self.steps) if s.met]
        return self.steps[min(met)[1]] if met else None


def try_options(engine: Engine, changes: Sequence[tuple[str, dict]]) -> None:
    """Each named option change over the best step, one at a time, until one keeps the goal."""
    for name, change in changes:
        best = engine.best
        if best.met or not engine.left():
            return
        if all(best.options.get(k) == v for k, v in change.items()):
            continue  # asked for already
        engine.consider(engine.step(name, {**best.options, **change}, best.excluded, best.wide))


def node_by_node(engine: Engine, nodes: Sequence[str], *, sixteen: bool = False,
                 skip: Callable[[str, Step], bool] = lambda node, best: False) -> None:
    """Each node in turn over the best step: in 16-bit activations first (``sixteen``), then in float; the
    higher-scoring form (float on a tie) is offered to the accept rule. Stops at the first step that keeps
    the goal, or when keeping a node in float gives no file (nothing kept further in float can help)."""
    for node in nodes:
        best = engine.best
        if skip(node, best):
            continue
        tried = []
        if sixteen:
            if not engine.left():
                return
            tried.append(engine.step(f"16-bit activations for {node}", best.options, best.excluded, (*best.wide, node)))
            if tried[-1] is not None and tried[-1].met:
                return
        if not engine.left():
            return
        floated = engine.step(f"float for {node}", best.options, (*best.excluded, node), best.wide)
        if floated is None:
            engine.stopped = f"keeping {[*best.excluded, node]} in float gives no file"
            return
        if floated.met:
            return
        engine.consider(max([floated, *(t for t in tried if t is not None)], key=lambda t: t.score))


def prefix_sizes(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``, then ``n``."""
    return [*(1 << i for i in range(max(n - 1, 0).bit_length())), n] if n else []


def fewest_nodes(engine: Engine, ranked: Sequence[str], *, sixteen: bool = False) -> None:
    """The ranked nodes in growing prefixes (1, 2, 4, ...) over the best step, first in 16-bit activations
    (``sixteen``), then in float; once a float prefix keeps the goal, bisection finds the fewest float
    nodes that still do. A float prefix that gives no file (its outputs not finite, say, or nothing left to
    run in integers) would break every longer prefix too: the nodes it added are set aside and the prefix of
    the same size is tried with the next ranked nodes (recorded as ``set_aside``)."""
    best = engine.best
    pool = list(ranked)
    missed, hit, k = 0, None, 1
    while len(pool) > missed:
        k = min(k, len(pool))
        nodes = tuple(pool[:k])
        if sixteen and engine.left():
            step = engine.step(f"16-bit activations for {k} node(s)", best.options, best.excluded, (*best.wide, *nodes))
            if step is not None and step.met:
                return
        if not engine.left():
            return
        step = engine.step(f"float for {k} node(s)", best.options, (*best.excluded, *nodes), best.wide)
        if step is not None and step.met:
            hit = k
            break
        if step is None:
            engine.set_aside.extend(pool[missed:k])
            del pool[missed:k]
            continue
        if k == len(pool):
            break
        missed, k = k, 2 * k
    while hit is not None and hit - missed > 1 and engine.left():
        k = (missed + hit) // 2
        step = engine.step(f"float for {k} node(s)", best.options, (*best.excluded, *pool[:k]), best.wide)
        if step is not None and step.met:
            hit = k
        else:
            missed = k


# the labelled variant: the accuracy search of both front-ends, any metric, higher is better


@dataclass(frozen=True)
class MetricStep:
    """One file (or model) scored: the nodes kept in float and those in 16-bit, its metric; for top-1 the
    count and Wilson interval."""

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
class MetricSearch:
    """The whole labelled search: the float model's metric, the budget, the candidate order, every step."""

    metric_name: str
    float_step: MetricStep
    max_drop: float
    order: list[str] = field(default_factory=list)  # candidate nodes, most sensitive first
    steps: list[MetricStep] = field(default_factory=list)
    refused: str | None = None  # why the search stopped early, when it did

    def drop(self, s: MetricStep) -> float:
        return self.float_step.metric - s.metric

    def within(self, s: MetricStep) -> bool:
        return self.drop(s) <= self.max_drop + 1e-9

    @property
    def met(self) -> bool:
        return any(self.within(s) for s in self.steps)

    @property
    def chosen(self) -> MetricStep:
        """The first step within the budget, else the best step (fewest nodes changed on ties)."""
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
        lines = [f"float {self.metric_name}: {self.float_step.describe()}; budget: a drop of at most "
                 f"{self.max_drop:g}", "", f"| step | kept in float | 16-bit | {self.metric_name} | drop | within budget |",
                 "|---:|---|---|---|---:|---|"]
        lines += [f"| {i} | {', '.join(s.excluded) or '(nothing)'} | {', '.join(s.int16) or '-'} | {s.describe()} | "
                  f"{self.drop(s):+.3g} | {'yes' if self.within(s) else 'no'} |" for i, s in enumerate(self.steps)]
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: every step's nodes and drop."""
        return "; ".join(f"step {i} [{', '.join(s.excluded) or 'nothing'}]"
                         f"{' 16-bit [' + ', '.join(s.int16) + ']' if s.int16 else ''} drop {self.drop(s):+.3g}"
                         for i, s in enumerate(self.steps))


def metric_step(excluded: tuple, wide: tuple, value: float | None = None, counts: tuple[int, int] | None = None
                ) -> MetricStep:
    """A scored step: top-1 in percent from ``counts`` (correct, n), else a metric's ``value`` (finite)."""
    if counts is not None:
        return MetricStep(excluded, 100.0 * counts[0] / counts[1], *counts, int16=wide)
    if not math.isfinite(value):
        raise DataRefused(f"the metric gave {value}: it must return a finite number")
    return MetricStep(excluded, float(value), int16=wide)


class BudgetMissed(QuantshipError):
    """No step of a labelled search met the budget; ``.search`` holds every step. Nothing was written."""

    def __init__(self, message: str, search: MetricSearch):
        super().__init__(message)
        self.search = search


def metric_search(attempt: Attempt, record: MetricSearch, order: Callable[[Any], list[str]], *, base: tuple = ((), ()),
                  sixteen: bool = False, skip: Callable[[str, Step], bool] = lambda node, best: False,
                  max_steps: int | None = None, max_nodes: int | None = None, advice: str = "",
                  log: Callable[[str], None] = lambda _: None) -> Any:
    """The labelled variant: ``attempt`` measures a ``MetricStep``; score = its metric, goal = a drop within
    ``record``'s budget, each node kept in its better form (``node_by_node``) until one step keeps it.
    ``base``: the nodes kept float and in 16-bit in every step. ``order(step 0's artifact)`` ranks the nodes; ``max_nodes`` bounds the nodes tried, ``max_steps`` the files.
    Fills ``record``; returns the chosen artifact, or raises ``BudgetMissed`` (ending with ``advice``)."""
    engine = Engine(attempt, score=lambda m: m.metric, goal=record.within, accept=lambda c, b: True, max_steps=max_steps,
                    label="accuracy search", log=log, describe=lambda m: f"{m.forms()}: {record.metric_name} "
                    f"{m.describe()} (float {record.float_step.describe()}, drop {record.drop(m):+.3g})")
    first = engine.step("as asked", {}, *base)
    if not first.met and max_steps != 0 and max_nodes != 0:
        with progress_step("accuracy search: the nodes' order"):
            record.order = [n for n in order(first.artifact) if n not in first.excluded and n not in first.wide]
        node_by_node(engine, record.order[:max_nodes], sixteen=sixteen, skip=skip)
    record.steps = [s.measured for s in engine.steps]
    if record.refused is None and engine.stopped and not engine.stopped.startswith("--max-steps"):
        record.refused = engine.stopped
    if record.met:
        return engine.steps[record.steps.index(record.chosen)].artifact
    best = record.chosen
    stopped = f"; stopped: {record.refused}" if record.refused else ""
    budget = f"{record.max_drop:g} point(s) of" if record.metric_name == TOP1 else f"{record.max_drop:g}"
    raise BudgetMissed(
        f"no exclusion set met the budget of {budget} ({record.metric_name}): float {record.float_step.describe()}; the best found "
        f"keeps {list(best.excluded) or 'nothing'} in float{' and ' + str(list(best.int16)) + ' in 16-bit' if best.int16 else ''}"
        f" and scores {best.describe()} (drop {record.drop(best):+.3g}) after {len(record.steps)} quantization(s) "
        f"[{record.summary()}]{stopped}; nothing written. {advice}", record)
