"""``quantize_onnx``: quantize a float ONNX file, judge the file's fidelity to FP32, repair it when it
misses the budget, and write it only when it keeps the budget.

Step 0 is the file as asked (``quantize_onnx_file``). Its fidelity (``quantship.fidelity``: each output's
SQNR and agreement against the float file, on samples held out from calibration where given) is judged
by the budget. When it misses, the repair runs on the calibration data alone (no labels), each step a
whole file measured the same way, cheapest first:

1. the algorithms that apply, one at a time (``ALGORITHM_STEPS``: bias correction, cross-layer
   equalization, the percentile then the MSE observer); a step that raises the margin is kept for the
   steps after it;
2. where the target allows a mixed graph: the nodes that lose the most signal themselves, measured by
   the per-node SQNR report (``sensitivity.node_sqnr``: a node's own loss is its inputs' SQNR less its
   output's, so a node that only carries an upstream loss does not rank), in growing prefixes (1, 2, 4,
   ... nodes): first in 16-bit activations where the target runs them, then in float; once a prefix
   meets the budget, bisection finds the fewest nodes kept float that still meet it.

The first file that meets the budget with the fewest nodes changed is moved to ``out_path`` with the
repair's record in its metadata (``REPAIR_KEY``). When no step meets it, or the target forbids every
repair left (a fully integer target: no float, no 16-bit), ``FidelityMissed`` names every step and
nothing is written.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantship.errors import FidelityMissed, QuantshipError, one_line
from quantship.export import artifact
from quantship.export.metadata import add_file_metadata
from quantship.fidelity import MET, MISSED, Budget
from quantship.precision import Preset, resolve_target
from quantship.progress import step as progress_step
from quantship.quantize_onnx.int16 import runs_int16
from quantship.quantize_onnx.quantizer import OnnxQuantizeResult, placement_for, quantize_onnx_file
from quantship.quantize_onnx.sensitivity import node_sqnr

REPAIR_KEY = "quantship.repair"
ALGORITHM_STEPS: tuple[tuple[str, dict], ...] = (
    ("bias correction", {"bias_correction": True}),
    ("equalization", {"equalize": True}),
    ("percentile observer", {"observer": "percentile"}),
    ("mse observer", {"observer": "mse"}),
)
DEFAULT_BUDGET = Budget()  # quantship.fidelity's defaults
SENSITIVITY_OPTIONS = ("observer", "per_tensor", "equalize", "bias_correction", "seq_mse", "adaround", "smooth_quant")


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
        return {"what": self.what, "algorithms": list(self.algorithms), "excluded": list(self.excluded),
                "int16": list(self.int16), "sqnr_db": self.sqnr_db if abs(self.sqnr_db) != float("inf") else
                str(self.sqnr_db), "agreement": self.agreement, "margin": self.margin, "status": self.status,
                "seconds": round(self.seconds, 2)}


@dataclass
class Repair:
    """Every step, which one was chosen, and why the repair stopped where it did."""

    budget: Budget
    steps: list[RepairStep] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # nodes by own loss, largest first
    chosen: int | None = None
    stopped: str | None = None

    @property
    def met(self) -> bool:
        return self.chosen is not None and self.steps[self.chosen].status == MET

    @property
    def repaired(self) -> bool:
        return self.met and self.chosen > 0

    def summary(self) -> str:
        return "; ".join(f"step {k} {s.describe()}" for k, s in enumerate(self.steps))

    def as_dict(self) -> dict:
        return {"budget": {"min_sqnr_db": self.budget.min_sqnr_db, "min_agreement": self.budget.min_agreement},
                "met": self.met, "chosen": self.chosen, "stopped": self.stopped, "order": list(self.order),
                "steps": [s.as_dict() for s in self.steps]}


def _algorithms(options: dict) -> tuple[str, ...]:
    return tuple(name for name, change in ALGORITHM_STEPS if all(options.get(k) == v for k, v in change.items()))


def _prefix_sizes(n: int) -> list[int]:
    sizes, k = [], 1
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n] if n else []


def quantize_onnx(float_path: str | Path, out_path: str | Path, calibration: Any, *, target: str | Preset,
                  budget: Budget | None = DEFAULT_BUDGET, fidelity_data: Any = None, repair: bool = True,
                  max_steps: int | None = None, exclude: Iterable[str] = (), int16: Iterable[str] = (),
                  wait: bool = True, log: Callable[[str], None] = lambda _: None,
                  **options: Any) -> tuple[OnnxQuantizeResult, Repair | None]:
    """Quantize ``float_path`` for ``target``, judge its fidelity to the float file by ``budget``, repair it
    when missed (see the module docstring) and write ``out_path``; returns the file's result and the repair.

    ``fidelity_data``: samples held out from calibration (the calibration grammar); without it the file is
    judged on calibration samples, said so. ``budget=None``: measured, not judged (one pass, no repair).
    ``repair=False``: judge only. ``max_steps``: at most that many repair steps after step 0. ``options``:
    ``quantize_onnx_file``'s. Raises ``FidelityMissed`` (nothing written) when no file keeps the budget.
    """
    src = Path(float_path).expanduser()
    final = artifact.refuse_unsafe_destination(out_path, (src,))
    if max_steps is not None and (isinstance(max_steps, bool) or max_steps < 0):
        raise QuantshipError(f"max_steps={max_steps!r}: give a number of steps >= 0, or None for every step")
    base, base_wide = tuple(exclude), tuple(int16)
    if budget is None:
        return quantize_onnx_file(src, final, calibration, target=target, exclude=base, int16=base_wide, wait=wait,
                                  fidelity_data=fidelity_data, **options), None
    p = resolve_target(target)
    record = Repair(budget)
    files: list[OnnxQuantizeResult] = []
    with artifact.workdir_beside(final) as scratch:
        def attempt(what: str, opts: dict, excluded: tuple[str, ...], wide: tuple[str, ...]) -> RepairStep | None:
            k = len(record.steps)
            started = time.perf_counter()
            try:
                with progress_step(f"fidelity: step {k} ({what})"):
                    done = quantize_onnx_file(src, scratch / f"step{k}.onnx", calibration, target=p, exclude=excluded,
                                              int16=wide, fidelity_data=fidelity_data, budget=budget, wait=wait,
                                              **opts)
            except QuantshipError as exc:
                if k == 0:
                    raise  # the file as asked cannot be made: the caller's refusal, not a repair's
                log(f"fidelity repair: {what} gives no file ({one_line(exc)})")
                return None
            f = done.fp32
            worst = f.worst
            step = RepairStep(what, _algorithms(opts), excluded, wide, f.sqnr_db, worst.agreement, f.margin, f.status,
                              time.perf_counter() - started)
            record.steps.append(step)
            files.append(done)
            log(f"fidelity: step {k}, {step.describe()}")
            return step

        def budget_left() -> bool:
            if max_steps is not None and len(record.steps) - 1 >= max_steps:
                record.stopped = f"--max-steps {max_steps} reached"
                return False
            return True

        first = attempt("as asked", dict(options), base, base_wide)
        best_opts, best = dict(options), first
        if first.status == MISSED and repair:
            for name, change in ALGORITHM_STEPS:
                if best.status == MET or not budget_left():
                    break
                if all(best_opts.get(k) == v for k, v in change.items()):
                    continue  # asked for already
                opts = {**best_opts, **change}
                step = attempt(name, opts, base, base_wide)
                if step is not None and step.margin > best.margin:
                    best_opts, best = opts, step
            if best.status == MISSED and budget_left():
                _by_nodes(record, attempt, budget_left, src, calibration, p, base, base_wide, best_opts, files,
                          record.steps.index(best))
        met = [k for k, s in enumerate(record.steps) if s.status == MET]
        if first.status != MISSED:
            record.chosen = 0
        elif met:
            record.chosen = min(met, key=lambda k: (len(record.steps[k].excluded), len(record.steps[k].int16),
                                                    len(record.steps[k].algorithms), k))
        else:
            record.chosen = None
            if record.stopped is None and not repair:
                record.stopped = "repair off (--no-repair)"
            raise FidelityMissed(
                f"no file kept the fidelity budget ({budget.describe()}): {record.summary()}"
                f"{'; stopped: ' + record.stopped if record.stopped else ''}; nothing written. Give more or more "
                "representative calibration data, keep the named nodes float with --exclude, or lower the budget "
                "(--min-sqnr / --min-agreement) if the task allows it", record.as_dict())
        done = files[record.chosen]
        if len(record.steps) > 1:
            add_file_metadata(done.path, {REPAIR_KEY: json.dumps(record.as_dict(), sort_keys=True, default=str)})
        with artifact.atomic_destination(final, wait=wait, inputs=(src,)) as staged:
            os.replace(done.path, staged)
    done.path = final
    done.verdict.path = str(final)
    return done, record


def _by_nodes(record: Repair, attempt, budget_left, src: Path, calibration: Any, p: Preset, base: tuple[str, ...],
              base_wide: tuple[str, ...], opts: dict, files: list[OnnxQuantizeResult], best_index: int) -> None:
    """Phase 2: the nodes that lose the most, in growing prefixes, 16-bit first where the target runs it,
    then float; bisection for the fewest float nodes once a prefix meets the budget."""
    placement, _, _ = placement_for(p, per_tensor=bool(opts.get("per_tensor")))
    if placement.mode == "full":
        record.stopped = (f"{p.target} runs a fully integer graph (no float node, no 16-bit activations): no node "
                          "can be kept float for it")
        return
    measured = {k: v for k, v in opts.items() if k in SENSITIVITY_OPTIONS}
    with progress_step("fidelity repair: per-node SQNR (own loss)"):
        report = node_sqnr(src, calibration, target=p, exclude=base, quantized_path=files[best_index].path,
                           **measured)
    record.order = [r.node for r in report.by_own_loss() if r.node not in base and r.node not in base_wide]
    if not record.order:
        record.stopped = "no node loses signal of its own in the per-node report"
        return
    sixteen = runs_int16(p)
    missed, hit = 0, None
    for k in _prefix_sizes(len(record.order)):
        nodes = tuple(record.order[:k])
        if sixteen and budget_left():
            step = attempt(f"16-bit activations for {k} node(s)", opts, base, (*base_wide, *nodes))
            if step is not None and step.status == MET:
                return
        if not budget_left():
            return
        step = attempt(f"float for {k} node(s)", opts, (*base, *nodes), base_wide)
        if step is not None and step.status == MET:
            hit = k
            break
        missed = k
    if hit is None:
        return
    while hit - missed > 1 and budget_left():  # the fewest float nodes: bisection between a miss and a hit
        k = (missed + hit) // 2
        step = attempt(f"float for {k} node(s)", opts, (*base, *record.order[:k]), base_wide)
        if step is not None and step.status == MET:
            hit = k
        else:
            missed = k
