"""The fidelity repair, once for both front-ends: try cheap changes first, keep what helps, stop at the
first file that keeps the budget with the fewest nodes changed, or say why none does.

A front-end (the ONNX path's ``quantize_onnx.repair``, the PyTorch path's ``export.judged``) answers two
callables: ``attempt(what, options, excluded, wide)`` makes one whole file with those options, those
nodes kept float and those in 16-bit activations, and returns its ``fidelity.Fidelity`` and the file (or
None when that file cannot be made: the step is skipped, never fatal after step 0); ``order(artifact,
options)`` ranks the nodes to change, most loss first, measured on that file. The steps:

1. the file as asked;
2. each algorithm step the front-end offers (``algorithm_steps``: a name and the options it changes), one
   at a time; a step that raises the margin is kept for the steps after it;
3. where the target allows a mixed graph (``mixed_refusal`` is None): the ranked nodes in growing
   prefixes (1, 2, 4, ...), first in 16-bit activations where the target runs them (``sixteen``), then
   in float; once a float prefix keeps the budget, bisection finds the fewest float nodes that still do.

Imports no front-end: numpy-free, torch-free, onnx-free.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from quantship.errors import FidelityMissed
from quantship.fidelity import MET, MISSED, Budget, Fidelity
from quantship.progress import step as progress_step

METADATA_KEY = "quantship.repair"  # the record a repaired file carries in its metadata_props
Attempt = Callable[[str, dict, tuple, tuple], "tuple[Fidelity, Any] | None"]
Order = Callable[[Any, dict], list]


@dataclass(frozen=True)
class RepairStep:
    """One file the repair measured: what changed, the nodes in 16-bit and in float, its fidelity."""

    what: str
    algorithms: tuple[str, ...]
    excluded: tuple[str, ...]
    int16: tuple[str, ...]
    sqnr_db: float
    agreement: float | None
    margin: float
    status: str
    seconds: float

    def describe(self) -> str:
        agree = f", agreement {self.agreement:.3f}" if self.agreement is not None else ""
        return f"{self.what}: SQNR {self.sqnr_db:.1f} dB{agree} ({self.status})"

    def as_dict(self) -> dict:
        finite = abs(self.sqnr_db) != float("inf")
        return {"what": self.what, "algorithms": list(self.algorithms), "excluded": list(self.excluded),
                "int16": list(self.int16), "sqnr_db": self.sqnr_db if finite else str(self.sqnr_db),
                "agreement": self.agreement, "margin": self.margin if finite else None, "status": self.status,
                "seconds": round(self.seconds, 2)}


@dataclass
class Repair:
    """Every step, which one was chosen, and why the repair stopped where it did."""

    budget: Budget
    steps: list[RepairStep] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # nodes by loss, largest first
    chosen: int | None = None
    stopped: str | None = None

    @property
    def met(self) -> bool:
        return self.chosen is not None and self.steps[self.chosen].status == MET

    def summary(self) -> str:
        return "; ".join(f"step {k} {s.describe()}" for k, s in enumerate(self.steps))

    def metadata(self) -> dict[str, str]:
        """The ``metadata_props`` entry of a file this repair chose (none when step 0 kept the budget)."""
        if len(self.steps) < 2:
            return {}
        return {METADATA_KEY: json.dumps(self.as_dict(), sort_keys=True, default=str)}

    def as_dict(self) -> dict:
        return {"budget": {"min_sqnr_db": self.budget.min_sqnr_db, "min_agreement": self.budget.min_agreement},
                "met": self.met, "chosen": self.chosen, "stopped": self.stopped, "order": list(self.order),
                "steps": [s.as_dict() for s in self.steps]}


def _prefix_sizes(n: int) -> list[int]:
    sizes, k = [], 1
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n] if n else []


class _Loop:
    def __init__(self, attempt: Attempt, budget: Budget, algorithm_steps: Sequence[tuple[str, dict]],
                 max_steps: int | None, log: Callable[[str], None]):
        self.attempt_file, self.algorithm_steps, self.max_steps, self.log = attempt, algorithm_steps, max_steps, log
        self.record = Repair(budget)
        self.files: list[Any] = []

    def names(self, options: dict) -> tuple[str, ...]:
        return tuple(n for n, change in self.algorithm_steps if all(options.get(k) == v for k, v in change.items()))

    def left(self) -> bool:
        if self.max_steps is not None and len(self.record.steps) - 1 >= self.max_steps:
            self.record.stopped = f"--max-steps {self.max_steps} reached"
            return False
        return True

    def attempt(self, what: str, options: dict, excluded: tuple, wide: tuple) -> RepairStep | None:
        k = len(self.record.steps)
        started = time.perf_counter()
        with progress_step(f"fidelity: step {k} ({what})"):
            made = self.attempt_file(what, options, excluded, wide)
        if made is None:
            return None
        fidelity, artifact = made
        step = RepairStep(what, self.names(options), excluded, wide, fidelity.sqnr_db, fidelity.worst.agreement,
                          fidelity.margin, fidelity.status, time.perf_counter() - started)
        self.record.steps.append(step)
        self.files.append(artifact)
        self.log(f"fidelity: step {k}, {step.describe()}")
        return step


def repair(attempt: Attempt, *, budget: Budget, options: dict, base: tuple = (), base_wide: tuple = (),
           algorithm_steps: Sequence[tuple[str, dict]] = (), order: Order | None = None,
           mixed_refusal: str | None = None, sixteen: bool = False, enabled: bool = True,
           max_steps: int | None = None, log: Callable[[str], None] = lambda _: None) -> tuple[Repair, Any]:
    """Run the steps (module docstring) until a file keeps ``budget``; returns the record and the chosen
    file. ``enabled=False``: step 0 judged only. Raises ``FidelityMissed`` when no file keeps the budget
    (the front-end then writes nothing)."""
    loop = _Loop(attempt, budget, algorithm_steps, max_steps, log)
    record = loop.record
    first = loop.attempt("as asked", dict(options), base, base_wide)
    best_opts, best = dict(options), first
    if first.status == MISSED and enabled:
        for name, change in algorithm_steps:
            if best.status == MET or not loop.left():
                break
            if all(best_opts.get(k) == v for k, v in change.items()):
                continue  # asked for already
            opts = {**best_opts, **change}
            step = loop.attempt(name, opts, base, base_wide)
            if step is not None and step.margin > best.margin:
                best_opts, best = opts, step
        if best.status == MISSED and loop.left():
            if mixed_refusal is not None:
                record.stopped = mixed_refusal
            elif order is not None:
                _by_nodes(loop, order(loop.files[record.steps.index(best)], best_opts), best_opts, base, base_wide,
                          sixteen)
    if first.status != MISSED:
        record.chosen = 0
    else:
        met = [k for k, s in enumerate(record.steps) if s.status == MET]
        if not met:
            if record.stopped is None:
                record.stopped = "every step tried" if enabled else "repair off (--no-repair)"
            raise FidelityMissed(
                f"no file kept the fidelity budget ({budget.describe()}): {record.summary()}; stopped: "
                f"{record.stopped}; nothing written. Give more or more representative calibration data, keep the "
                "nodes that lose the signal float (--exclude), or lower the budget (--min-sqnr / --min-agreement) "
                "if the task allows it", record.as_dict())
        record.chosen = min(met, key=lambda k: (len(record.steps[k].excluded), len(record.steps[k].int16),
                                                len(record.steps[k].algorithms), k))
    return record, loop.files[record.chosen]


def _by_nodes(loop: _Loop, ranked: list, opts: dict, base: tuple, base_wide: tuple, sixteen: bool) -> None:
    record = loop.record
    record.order = [n for n in ranked if n not in base and n not in base_wide]
    if not record.order:
        record.stopped = "no node loses signal of its own in the per-node report"
        return
    missed, hit = 0, None
    for k in _prefix_sizes(len(record.order)):
        nodes = tuple(record.order[:k])
        if sixteen and loop.left():
            step = loop.attempt(f"16-bit activations for {k} node(s)", opts, base, (*base_wide, *nodes))
            if step is not None and step.status == MET:
                return
        if not loop.left():
            return
        step = loop.attempt(f"float for {k} node(s)", opts, (*base, *nodes), base_wide)
        if step is not None and step.status == MET:
            hit = k
            break
        missed = k
    while hit is not None and hit - missed > 1 and loop.left():  # the fewest float nodes that keep the budget
        k = (missed + hit) // 2
        step = loop.attempt(f"float for {k} node(s)", opts, (*base, *record.order[:k]), base_wide)
        if step is not None and step.status == MET:
            hit = k
        else:
            missed = k
