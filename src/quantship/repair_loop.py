"""The fidelity repair, once for both front-ends: try cheap changes first, keep what helps, stop at the
first file that keeps the budget with the fewest nodes changed, or say why none does.

A front-end (the ONNX path's ``quantize_onnx.repair``, the PyTorch path's ``export.judged``) answers two
callables: ``attempt(what, options, excluded, wide)`` makes one whole file with those options, those
nodes kept float and those in 16-bit activations, and returns its ``fidelity.Fidelity`` and the file (or
None when that file cannot be made: the step is skipped, never fatal after step 0); ``order(artifact,
options)`` ranks the nodes to change, most loss first, measured on that file. On ``search_engine``, score = the
margin: the file as asked; each algorithm step the front-end offers (``try_options``: a name and the options
it changes; one that raises the margin is kept); where the target allows a mixed graph (``mixed_refusal`` is
None), the fewest ranked nodes in 16-bit (``sixteen``) or in float that keep the budget (``fewest_nodes``).

The algorithm steps are ``ALGORITHM_STEPS``, one table for both front-ends: each names a field of
``recipe.Algorithms`` and its value, and a front-end spells the field as its own option (``algorithm_steps``).

Imports no front-end: numpy-free, torch-free, onnx-free.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from quantship.errors import FidelityMissed, Int16Uncovered, QuantshipError, one_line
from quantship.fidelity import MET, MISSED, Budget, Fidelity
from quantship.search_engine import Engine, fewest_nodes, try_options

METADATA_KEY = "quantship.repair"  # the record a repaired file carries in its metadata_props
# (name, recipe.Algorithms field, value), in the order tried; each costs one quantize of the whole file. The
# range (min/max) observer comes first of the observers: the histogram observer (the presets') trades a
# tensor's rare largest values for finer steps on the rest, and where those values carry the output (a
# threshold far in a tail) only the full range keeps them; percentile and mse clip further. On nudenet it
# moves the scores' mean error from -0.049 to -0.019 but loses SQNR, and is not kept (docs/fidelity.md).
ALGORITHM_STEPS: tuple[tuple[str, str, Any], ...] = (
    ("bias correction", "bias_correction", True),
    ("equalization", "equalize", True),
    ("minmax observer", "observer", "minmax"),
    ("percentile observer", "observer", "percentile"),
    ("mse observer", "observer", "mse"),
)
Attempt = Callable[[str, dict, tuple, tuple], "tuple[Fidelity, Any] | None"]
Order = Callable[[Any, dict], list]


def algorithm_steps(spelled: Mapping[str, str] | None = None) -> tuple[tuple[str, dict], ...]:
    """``ALGORITHM_STEPS`` as a front-end's (name, options) pairs; ``spelled``: field -> the front-end's own
    option key where it differs (the PyTorch path's ``act_observer``)."""
    keys = spelled or {}
    return tuple((name, {keys.get(field_name, field_name): value}) for name, field_name, value in ALGORITHM_STEPS)


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
    set_aside: list[str] = field(default_factory=list)  # nodes whose float gave no file (``fewest_nodes``)

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
        return {"budget": self.budget.as_dict(),
                "met": self.met, "chosen": self.chosen, "stopped": self.stopped, "order": list(self.order),
                "set_aside": list(self.set_aside),
                "steps": [s.as_dict() for s in self.steps]}


def repair(attempt: Attempt, *, budget: Budget, options: dict, base: tuple = (), base_wide: tuple = (),
           algorithm_steps: Sequence[tuple[str, dict]] = (), order: Order | None = None,
           mixed_refusal: str | None = None, sixteen: bool = False, enabled: bool = True,
           max_steps: int | None = None, log: Callable[[str], None] = lambda _: None) -> tuple[Repair, Any]:
    """Run the steps (module docstring) until a file keeps ``budget``; returns the record and the chosen
    file. ``enabled=False``: step 0 judged only. Raises ``FidelityMissed`` when no file keeps the budget
    (the front-end then writes nothing)."""
    engine = Engine(attempt, score=lambda f: f.margin, goal=lambda f: f.status == MET, max_steps=max_steps,
                    label="fidelity", log=log, describe=lambda f: f"SQNR {f.sqnr_db:.1f} dB" + (
                        f", agreement {f.worst.agreement:.3f}" if f.worst.agreement is not None else "") + f" ({f.status})")
    record = Repair(budget)
    first = engine.step("as asked", options, base, base_wide)
    if first.measured.status == MISSED and enabled:
        try_options(engine, algorithm_steps)
        if not engine.best.met and engine.left():
            if mixed_refusal is not None:
                engine.stopped = mixed_refusal
            elif order is not None:
                record.order = [n for n in order(engine.best.artifact, engine.best.options)
                                if n not in base and n not in base_wide]
                if record.order:
                    fewest_nodes(engine, record.order, sixteen=sixteen)
                else:
                    engine.stopped = "no node loses signal of its own in the per-node report"
    record.steps = [RepairStep(s.what, tuple(n for n, change in algorithm_steps if change.items() <= s.options.items()),
                               s.excluded, s.wide, s.measured.sqnr_db, s.measured.worst.agreement, s.measured.margin,
                               s.measured.status, s.seconds) for s in engine.steps]
    record.stopped, record.set_aside = engine.stopped, list(engine.set_aside)
    chosen = first if first.measured.status != MISSED else engine.fewest(
        lambda s: (len(s.excluded), len(s.wide), len(record.steps[engine.steps.index(s)].algorithms)))
    if chosen is None:
        if record.stopped is None:
            record.stopped = "every step tried" if enabled else "repair off (--no-repair)"
        raise FidelityMissed(
            f"no file kept the fidelity budget ({budget.describe()}): {record.summary()}; stopped: "
            f"{record.stopped}; nothing written.{_closest(engine)} Give more or more representative calibration "
            "data, keep the nodes that lose the signal float (--exclude), or lower the budget (--min-sqnr / "
            "--min-agreement) if the task allows it", record.as_dict())
    record.chosen = engine.steps.index(chosen)
    return record, chosen.artifact


def _closest(engine: Engine) -> str:
    """The refused repair's closest file (the step of highest margin) and the bounds that would keep it."""
    tried = [s for s in engine.steps if s.measured is not None and s.measured.status == MISSED]
    if not tried:
        return ""
    best = max(tried, key=lambda s: s.measured.margin)
    flags = " ".join(f"--{name.replace('_', '-')} {value:g}" for name, value in best.measured.bounds_that_keep_it().items())
    keeps = f"; `{flags}` would keep it" if flags else ""
    return f" The closest: step {engine.steps.index(best)}, {best.what} ({best.measured.worst.describe()}){keeps}."


def dropping_uncovered(make: Callable[[tuple], Any], wide: tuple) -> Any:
    """``make(wide)``; a 16-bit name that no longer covers a quantized activation (the placement by profile keeps
    its neighbours float, so nothing it reads or writes is quantized) is dropped and ``make`` called again."""
    while True:
        try:
            return make(wide)
        except Int16Uncovered as exc:
            if exc.name not in wide:
                raise
            wide = tuple(w for w in wide if w != exc.name)


def native_repair(enabled: bool, missed: QuantshipError, in_runtime: list[bool], log: Callable[[str], None]) -> bool:
    """A file that keeps the budget read in ONNX Runtime literally (each repair step's reading) but not in its
    target's own runtime: repair again with every step judged in that runtime (``in_runtime[0]`` set), when the
    repair is on and has not judged there yet; False: refuse the file (``missed``)."""
    if not enabled or in_runtime[0]:
        return False
    log(f"fidelity repair: {one_line(missed)}; repairing again, each step judged in the target's own runtime")
    in_runtime[0] = True
    return True
