"""Fidelity to FP32: does the INT8 file still do the float model's job, measured on its outputs.

A runtime that reproduces a file proves nothing about the model the file came from (a file with
scrambled weights reads the same literally and fused). This module holds the one judgement every
path uses: each output of the INT8 file against the same output of the float model, on the same
inputs (held out from range calibration where there are any), as

- SQNR in dB: ``10 log10(sum ref^2 / sum (ref - int8)^2)`` over every value of the output;
- an agreement that fits what the output is (``agreement_rule``): argmax over classes for class
  scores, the positive set at 0.5 for probabilities that are not a distribution (the elements either
  side puts above 0.5, so that the negatives of a sparse map do not make agreement trivially ~1), for
  distributions along a sequence (N x T x C) whose most common answer is one background class (a CTC
  blank, silence) the argmax at the positions where either side answers something else (the same
  reason: a line's blank columns agree whatever its characters became), signs
  for signed values; none for outputs where none of these means anything (e.g. a non-negative regression).

An output that joins parts of different kinds (``output_parts``: channels in [0, 1] beside channels an
order of magnitude larger, on axis 1 or the last axis, e.g. a detector's boxes and class scores) is
judged part by part, each with its own SQNR and rule, so large coordinates do not hide the scores' error.

A ``Budget`` (minimum SQNR, minimum agreement) turns the figures into a verdict: ``met``, ``missed``,
or ``inconclusive`` when the float output is the same for every input (nothing to tell apart). An
agreement misses when the upper end of its Wilson 50% interval is under the minimum (``AGREEMENT_Z``; judged
only over ``MIN_DECISIONS`` decisions or more): on a handful of held-out samples one flipped near-tie
proves nothing; over a hundred, an agreement a few points under the minimum is a loss the task shows.
The default budget's evidence is in ``docs/fidelity.md``.

Below every path (``errors`` and ``intervals`` only), so the torch path, the ONNX path, ``inspect`` and the
CLI share it; numpy is imported by the functions that measure, so a parser can read the defaults before it
loads (``--help`` answers at once).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from quantship.errors import DataRefused, FidelityMissed
from quantship.intervals import wilson_interval

if TYPE_CHECKING:
    import numpy as np

# The default budget comes from measurements on REAL.md's models and the collapses seen (docs/fidelity.md, "The
# budget", and bench/fidelity.py): an SQNR between the good files' and the collapses', an agreement per rule.
DEFAULT_MIN_SQNR_DB = 10.0
DEFAULT_MIN_AGREEMENT = 0.9  # rules over elements (positives, sign): a pixel or a value is not the task's unit
# rules whose each decision is one of the task's answers (a sample's class, a sequence position's symbol): a file
# that changes more than 4 in 100 of them is not near FP32 on the task; why 0.96 and not 0.98: docs/fidelity.md
DEFAULT_MIN_DECISION_AGREEMENT = 0.96
HELD_OUT_MAX = 64  # samples held out from calibration to judge fidelity on (export.data.split_held_out)
METADATA_KEY = "quantship.fidelity"
SIGN_FLOOR = 0.1  # sign agreement counts values whose magnitude is at least this fraction of the output's rms
MIN_DECISIONS = 20  # an agreement over fewer decisions is reported, not judged: a flip or two proves nothing
RESOLUTION = 0.01  # held-out decisions fewer than resolve the minimum to one point are judged with calibration's too
# an agreement misses when the minimum is above the upper end of its Wilson 50% interval (the file is more likely
# below the minimum than not, 3 to 1); why not 95%: docs/fidelity.md, "The budget"
AGREEMENT_Z = 0.6744897501960817
PART_RATIO = 10.0  # channels in [0, 1] beside channels this many times larger are judged apart (output_parts)
MAX_PARTS = 4  # more runs of alternating kinds than this is not a concatenation of parts: judged whole
POSITIVES = "positives > 0.5"  # the rule of probabilities that are not a distribution
FOREGROUND = "foreground argmax"  # distributions along a sequence whose most common answer is background
BACKGROUND_SHARE = 0.5  # a class that is FP32's answer at more than this share of a sequence output's positions
DECISION_RULES = ("argmax", FOREGROUND)  # held to DEFAULT_MIN_DECISION_AGREEMENT unless the user sets a minimum

MET, MISSED, INCONCLUSIVE, NOT_JUDGED = "met", "missed", "inconclusive", "not judged"


UPSTREAM_CAP_DB = 60.0  # an input no quantized node produced (inf SQNR) counts as this in a node's own loss


def own_loss_db(upstream_db: float, sqnr: float) -> float:
    """What one node loses itself: the SQNR of what it reads (capped at ``UPSTREAM_CAP_DB``) less its output's.
    The per-node reports of both paths rank the fidelity repair's candidates by it."""
    return min(upstream_db, UPSTREAM_CAP_DB) - sqnr


def missed(fidelity: Fidelity | None) -> bool:
    """A file's fidelity was judged by a budget and missed it (None: not measured)."""
    return fidelity is not None and fidelity.status == MISSED


def missed_in_runtime(literal: Fidelity, native: Fidelity, target: str) -> FidelityMissed:
    """The refusal of a file that keeps the budget read literally in ONNX Runtime (the repair's reading) but not in
    its target's own runtime (``native``), both readings named."""
    return FidelityMissed(f"the file keeps the fidelity budget in ONNX Runtime read literally ({literal.describe()}) "
                          f"but not in {native.runtime}, the {target} target's own runtime: {native.describe()}",
                          {"runtime": native.as_dict()})


def sqnr_db(signal_energy: float, noise_energy: float) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when the two agree exactly)."""
    if noise_energy == 0:
        return math.inf
    if signal_energy == 0:
        return -math.inf
    return 10.0 * math.log10(signal_energy / noise_energy)


def output_sqnr_db(reference: np.ndarray, out: np.ndarray) -> float:
    """``out``'s SQNR against ``reference``: ``sqnr_db`` of their energies, summed in float64."""
    import numpy as np

    ref = np.asarray(reference).astype(np.float64)
    return sqnr_db(float((ref ** 2).sum()), float(((np.asarray(out).astype(np.float64) - ref) ** 2).sum()))


@dataclass(frozen=True)
class Budget:
    """The least fidelity a file must keep: output SQNR in dB and agreement in [0, 1], each output. A
    ``min_agreement`` of None holds each rule to its default (``agreement_minimum``); a number holds every rule
    to it."""

    min_sqnr_db: float = DEFAULT_MIN_SQNR_DB
    min_agreement: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.min_sqnr_db, bool) or not isinstance(self.min_sqnr_db, (int, float)) \
                or not 0.0 <= self.min_sqnr_db < 200.0:
            raise DataRefused(f"minimum SQNR {self.min_sqnr_db!r} dB: give a number of dB in [0, 200) (default "
                              f"{DEFAULT_MIN_SQNR_DB:g})")
        if self.min_agreement is not None and (
                isinstance(self.min_agreement, bool) or not isinstance(self.min_agreement, (int, float))
                or not 0.0 <= self.min_agreement <= 1.0):
            raise DataRefused(f"minimum agreement {self.min_agreement!r}: give a fraction in [0, 1] (default "
                              f"{default_agreements()})")

    def agreement_minimum(self, rule: str) -> float:
        """The least agreement an output judged by ``rule`` must keep."""
        if self.min_agreement is not None:
            return self.min_agreement
        return DEFAULT_MIN_DECISION_AGREEMENT if rule in DECISION_RULES else DEFAULT_MIN_AGREEMENT

    def describe(self, rules: Sequence[str] | None = None) -> str:
        """The budget in words; given the ``rules`` of the outputs judged, only their minimums (by default the
        rules' minimums differ)."""
        if self.min_agreement is not None:
            agreement = f"{self.min_agreement:g}"
        elif rules is None:
            agreement = default_agreements()
        elif not rules:
            return f"SQNR >= {self.min_sqnr_db:g} dB, every output (no agreement rule applies)"
        else:
            agreement = ", ".join(f"{self.agreement_minimum(r):g} ({r})" for r in sorted(set(rules)))
        return f"SQNR >= {self.min_sqnr_db:g} dB and agreement >= {agreement}, every output"

    def as_dict(self) -> dict:
        """The budget as stored in reports and metadata: the minimum of every rule, as applied."""
        rules = (*DECISION_RULES, POSITIVES, "sign")
        return {"min_sqnr_db": self.min_sqnr_db, "min_agreement": self.min_agreement,
                "min_agreement_by_rule": {rule: self.agreement_minimum(rule) for rule in rules}}


def default_agreements() -> str:
    """The default minimum agreements in words, by kind of decision (the CLI's help, a refused budget's message)."""
    return (f"{DEFAULT_MIN_DECISION_AGREEMENT:g} for decisions ({', '.join(DECISION_RULES)}), "
            f"{DEFAULT_MIN_AGREEMENT:g} for elements ({POSITIVES}, sign)")


@dataclass(frozen=True)
class OutputFidelity:
    """One output: its SQNR, its agreement under ``rule`` (None where no rule applies)."""

    name: str
    sqnr_db: float
    agreement: float | None
    rule: str
    n_values: int
    constant_reference: bool
    n_decisions: int = 0  # what the agreement counts (samples for argmax, values otherwise)

    @property
    def agreement_upper(self) -> float | None:
        """The upper end of the agreement's Wilson interval at ``AGREEMENT_Z`` (50%: its 75th percentile)."""
        if self.agreement is None or not self.n_decisions:
            return self.agreement
        return wilson_interval(round(self.agreement * self.n_decisions), self.n_decisions, AGREEMENT_Z)[1]

    def margin(self, budget: Budget) -> float:
        """How far inside the budget (>= 0) or outside it (< 0): dB, or agreement points x 100 (its interval's
        upper end against the minimum), the worse."""
        margins = [self.sqnr_db - budget.min_sqnr_db]
        if self.agreement is not None and self.n_decisions >= MIN_DECISIONS:
            margins.append(100.0 * (self.agreement_upper - budget.agreement_minimum(self.rule)))
        return min(margins)

    def describe(self) -> str:
        agree = (f", {self.rule} agreement {self.agreement:.3f} of {self.n_decisions}" if self.agreement is not None
                 else f" ({self.rule})")
        return f"{_db(self.sqnr_db)}{agree}"


@dataclass
class Fidelity:
    """Every output's fidelity to the float model, the data and runtime it was measured on, the verdict."""

    outputs: list[OutputFidelity]
    data: str  # which inputs: "24 samples held out from calibration", ...
    runtime: str  # "ONNX Runtime (default optimizations)", ...
    budget: Budget | None
    n_samples: int
    extra: dict = field(default_factory=dict)  # e.g. the repair's steps

    @property
    def worst(self) -> OutputFidelity:
        if self.budget is None:
            return min(self.outputs, key=lambda o: o.sqnr_db)
        return min(self.outputs, key=lambda o: o.margin(self.budget))

    @property
    def sqnr_db(self) -> float:
        return min(o.sqnr_db for o in self.outputs)

    @property
    def unjudged(self) -> list[OutputFidelity]:
        """The outputs whose agreement counts fewer than ``MIN_DECISIONS`` decisions: reported, not judged (SQNR
        alone decides for them), and said so in the verdict."""
        return [o for o in self.outputs if o.agreement is not None and o.n_decisions < MIN_DECISIONS]

    @property
    def inconclusive(self) -> bool:
        return all(o.constant_reference for o in self.outputs)

    @property
    def margin(self) -> float:
        return min(o.margin(self.budget) for o in self.outputs) if self.budget is not None else math.inf

    @property
    def status(self) -> str:
        if self.budget is None:
            return NOT_JUDGED
        if self.inconclusive:
            return INCONCLUSIVE
        return MET if self.margin >= 0 else MISSED

    @property
    def met(self) -> bool:
        return self.status == MET

    def describe(self) -> str:
        """One line: the worst output's figures, where they were measured, the verdict."""
        w = self.worst
        where = f"{w.name}: " if len(self.outputs) > 1 else ""
        rules = [o.rule for o in self.outputs if o.agreement is not None]
        verdict = {MET: (self._met_on_sqnr_alone() if self.unjudged else
                         f"within the budget ({self.budget.describe(rules)})") if self.budget else "",
                   MISSED: f"MISSED the budget ({self.budget.describe(rules)})" if self.budget else "",
                   INCONCLUSIVE: "inconclusive: the float output is the same for every input (give real inputs)",
                   NOT_JUDGED: "not judged (no budget)"}[self.status]
        return f"{where}{w.describe()}; {self.runtime}, {self.data}; {verdict}"

    def bounds_that_keep_it(self) -> dict[str, float]:
        """The budget bounds this reading would keep, for the ones it misses: ``{"min_sqnr": dB}`` (rounded down to
        0.1 dB) and ``{"min_agreement": P}`` (the lowest upper end of a judged agreement's interval, rounded down to
        0.01): what a refusal tells a user who judges the task can afford it. Empty when nothing misses."""
        if self.status != MISSED:
            return {}
        bounds: dict[str, float] = {}
        if self.sqnr_db < self.budget.min_sqnr_db:
            bounds["min_sqnr"] = math.floor(self.sqnr_db * 10.0) / 10.0 if math.isfinite(self.sqnr_db) else 0.0
        missing = [o.agreement_upper for o in self.outputs if o.agreement is not None
                   and o.n_decisions >= MIN_DECISIONS and o.agreement_upper < self.budget.agreement_minimum(o.rule)]
        if missing:
            bounds["min_agreement"] = math.floor(min(missing) * 100.0) / 100.0
        return bounds

    def _met_on_sqnr_alone(self) -> str:
        few = min(self.unjudged, key=lambda o: o.n_decisions)
        where = f"{few.name} counts" if len(self.outputs) > 1 else "it counts"
        return (f"within the budget on SQNR (>= {self.budget.min_sqnr_db:g} dB, every output); agreement NOT "
                f"judged: {where} {few.n_decisions} decision(s) ({few.rule}), fewer than {MIN_DECISIONS} (give more "
                f"samples to judge on: --fidelity-data)")

    def as_dict(self) -> dict:
        return {"status": self.status, "sqnr_db": _finite(self.sqnr_db), "data": self.data, "runtime": self.runtime,
                "n_samples": self.n_samples, "agreement_judged": not self.unjudged,
                "budget": self.budget.as_dict() if self.budget is not None else None,
                "outputs": [{**asdict(o), "sqnr_db": _finite(o.sqnr_db)} for o in self.outputs], **self.extra}

    def metadata(self) -> str:
        """The record stored in the file's ``metadata_props`` (``METADATA_KEY``)."""
        return json.dumps(self.as_dict(), sort_keys=True, allow_nan=False, default=str)


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def _db(value: float) -> str:
    return "SQNR inf dB (identical)" if value == math.inf else f"SQNR {value:.1f} dB"


def agreement_rule(reference: np.ndarray) -> str:
    """Which agreement fits this output, from the float output alone.

    ``argmax``: class scores (N x C, C >= 2) or rows that are distributions (values in [0, 1] summing to
    1 over the last axis); ``positives > 0.5``: probabilities that are not a distribution (sigmoid maps,
    frame posteriors, a detector's class scores); ``sign``: signed values (both signs present, e.g. binary
    logits, embeddings);
    ``none``: anything else (a non-negative regression, a constant), judged by SQNR alone.
    """
    import numpy as np  # measuring only (module docstring)

    ref = np.asarray(reference, dtype=np.float64)
    if ref.size == 0 or not np.isfinite(ref).all():
        return "none"
    in_unit = ref.min() >= 0.0 and ref.max() <= 1.0
    if ref.ndim >= 2 and ref.shape[-1] >= 2:
        if in_unit and np.allclose(ref.sum(axis=-1), 1.0, atol=1e-3):
            return FOREGROUND if _background(ref.argmax(-1)) is not None else "argmax"
        if ref.ndim == 2 and not in_unit:
            return "argmax"
    if in_unit and ref.max() > ref.min():
        return POSITIVES
    negative, positive = (ref < 0).mean(), (ref > 0).mean()
    if negative >= 0.01 and positive >= 0.01:
        return "sign"
    return "none"


def _agreement(rule: str, ref: np.ndarray, out: np.ndarray) -> tuple[float | None, int]:
    """The fraction of decisions the INT8 output shares with the float one, and how many were counted."""
    import numpy as np  # measuring only (module docstring)

    if rule == "argmax":
        same = ref.argmax(-1) == out.argmax(-1)
    elif rule == FOREGROUND:  # over the positions either side answers other than the background class
        ref_best, out_best = ref.argmax(-1), out.argmax(-1)
        background = _background(ref_best)
        either = (ref_best != background) | (out_best != background)
        same = ref_best[either] == out_best[either]
    elif rule == POSITIVES:  # over the union of both positive sets: |both| / |either| (the negatives left out)
        ref_pos, out_pos = ref > 0.5, out > 0.5
        same = ref_pos[ref_pos | out_pos] & out_pos[ref_pos | out_pos]
    elif rule == "sign":
        counted = _sign_counted(ref)
        same = np.sign(ref[counted]) == np.sign(out[counted])
    else:
        return None, 0
    if same.size == 0:
        return None, 0
    return float(same.mean()), int(same.size)


def _constant(ref: np.ndarray) -> bool:
    """The float output is the same for every sample (one sample: the same value everywhere)."""
    import numpy as np  # measuring only (module docstring)

    if ref.size == 0:
        return True
    per_sample = ref.reshape(ref.shape[0], -1) if ref.ndim >= 2 and ref.shape[0] > 1 else ref.reshape(1, -1)
    spread = np.ptp(per_sample, axis=0).max() if per_sample.shape[0] > 1 else np.ptp(per_sample)
    return bool(spread <= 1e-9 * max(1e-30, float(np.abs(ref).max())))


def measure(names: Sequence[str], reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray], *,
            budget: Budget | None, data: str, runtime: str) -> Fidelity:
    """Each output of the INT8 file (``outputs``) against the float model's (``reference``), in order.

    ``reference[k]`` / ``outputs[k]``: output ``names[k]`` over every sample, concatenated on the batch
    axis. A shape mismatch is refused (``DataRefused``): the two are not the same model's outputs.
    """
    import numpy as np  # measuring only (module docstring)

    rows = []
    n_samples = 0
    for name, ref, out in zip(names, reference, outputs, strict=True):
        ref = np.asarray(ref, dtype=np.float64)
        out = np.asarray(out, dtype=np.float64)
        if ref.shape != out.shape:
            raise DataRefused(f"output {name!r}: the INT8 file gives {list(out.shape)} and the float model "
                              f"{list(ref.shape)} on the same inputs; they are not the same model's outputs")
        n_samples = max(n_samples, ref.shape[0] if ref.ndim else 1)
        rows += [_judge_part(f"{name}{part}", ref[index], out[index]) for part, index in output_parts(ref)]
    return Fidelity(rows, data, runtime, budget, n_samples)


def widened(held: Fidelity, names: Sequence[str], reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray],
            calibration: Callable[[], tuple[Sequence[np.ndarray], Sequence[np.ndarray], int]] | None) -> Fidelity:
    """``held`` (measured on held-out samples, ``reference`` and ``outputs``), or, when an agreement there counts
    too few decisions to be judged (an output's, or FP32's: FP32's count decides, so that every step of a repair
    is judged on the same samples), the judgement on the held-out samples and the calibration samples together,
    said so in its data line: in-sample, the ranges were set on part of it, but a collapse of the model's
    decisions shows there as well, where a handful of held-out samples would let SQNR alone decide.
    ``calibration``: returns the float and INT8 outputs on the calibration samples and their count, called only
    when they are needed (a caller may have to run them). ``held`` as it is when none are given or their shapes
    do not join the held-out ones'."""
    import numpy as np  # measuring only (module docstring)

    if calibration is None:
        return held
    short = [(count, needed) for rule, count in _reference_decisions(reference)
             if count < (needed := decisions_to_resolve(held.budget, rule))]
    if not held.unjudged and not short:
        return held
    calib_reference, calib_outputs, n_calib = calibration()
    joined_reference, joined_outputs = [], []
    for ref, out, c_ref, c_out in zip(reference, outputs, calib_reference, calib_outputs, strict=True):
        ref, out, c_ref, c_out = (np.asarray(a) for a in (ref, out, c_ref, c_out))
        if ref.ndim == 0 or ref.shape[1:] != c_ref.shape[1:] or out.shape[1:] != c_out.shape[1:]:
            return held
        joined_reference.append(np.concatenate([ref, c_ref]))
        joined_outputs.append(np.concatenate([out, c_out]))
    few, needed = min(short or [(o.n_decisions, MIN_DECISIONS) for o in held.unjudged])
    data = (f"{held.data} + {n_calib} calibration sample(s) (in-sample: FP32's outputs on the held-out ones count "
            f"{few} decision(s), fewer than {needed} to judge agreement on)")
    return measure(names, joined_reference, joined_outputs, budget=held.budget, data=data, runtime=held.runtime)


def decisions_to_resolve(budget: Budget | None, rule: str) -> int:
    """How many decisions judge an agreement under ``rule`` against the budget's minimum to within a point: where the
    Wilson 50% interval of an agreement at the minimum is ``RESOLUTION`` wide on each side (0.96: 175; 0.9: 410),
    else ``MIN_DECISIONS``. Fewer held-out decisions cannot tell a file a point under the minimum from one at it:
    twelve text lines (122 characters) held out let a file agreeing 0.951 pass 0.96 (docs/fidelity.md)."""
    if budget is None:
        return MIN_DECISIONS
    minimum = budget.agreement_minimum(rule)
    return max(MIN_DECISIONS, math.ceil(AGREEMENT_Z ** 2 * minimum * (1.0 - minimum) / RESOLUTION ** 2))


def _reference_decisions(reference: Sequence[np.ndarray]) -> list[tuple[str, int]]:
    """The decisions FP32's outputs count under each output part's rule (argmax: rows; positives: FP32's positive
    elements; sign: the values counted), the least an INT8 file's agreement can count, with the rule."""
    import numpy as np  # measuring only (module docstring)

    counts = []
    for whole in reference:
        whole = np.asarray(whole, dtype=np.float64)
        for _, index in output_parts(whole):
            ref = whole[index]
            rule = agreement_rule(ref)
            if rule == "argmax":
                counts.append((rule, int(np.prod(ref.shape[:-1]))))
            elif rule == FOREGROUND:
                best = ref.argmax(-1)
                counts.append((rule, int((best != _background(best)).sum())))
            elif rule == POSITIVES:
                counts.append((rule, int((ref > 0.5).sum())))
            elif rule == "sign":
                counts.append((rule, int(_sign_counted(ref).sum())))
    return counts


def _background(best: np.ndarray) -> int | None:
    """The class FP32 answers (``best``: its argmax over the classes) at more than ``BACKGROUND_SHARE`` of the
    positions of a sequence output (N x T x C: ``best`` N x T), else None (one answer a sample: every answer is a
    decision)."""
    import numpy as np  # measuring only (module docstring)

    if best.ndim < 2 or best.size == 0:
        return None
    classes, counts = np.unique(best, return_counts=True)
    top = int(counts.argmax())
    return int(classes[top]) if counts[top] > BACKGROUND_SHARE * counts.sum() else None


def _sign_counted(ref: np.ndarray) -> np.ndarray:
    """The values the sign rule counts: at least ``SIGN_FLOOR`` of the output's rms in magnitude."""
    import numpy as np  # measuring only (module docstring)

    return np.abs(ref) >= SIGN_FLOOR * math.sqrt(float(np.mean(ref * ref)))


def _judge_part(name: str, ref: np.ndarray, out: np.ndarray) -> OutputFidelity:
    import numpy as np  # measuring only (module docstring)

    noise = float(np.sum((ref - out) ** 2)) if np.isfinite(out).all() else math.inf
    sqnr = sqnr_db(float(np.sum(ref * ref)), noise) if math.isfinite(noise) else -math.inf
    rule = agreement_rule(ref)
    agree, counted = _agreement(rule, ref, np.nan_to_num(out, nan=-np.inf))
    return OutputFidelity(name, sqnr, agree, rule if agree is not None else "none", int(ref.size), _constant(ref),
                          counted)


def output_parts(reference: np.ndarray) -> list[tuple[str, tuple]]:
    """The parts an output is judged in, each a name suffix and an index: the whole output (``""``), or, for an
    output that joins runs of channels of different kinds on axis 1 or the last axis (channels in [0, 1]
    beside channels at least ``PART_RATIO`` times larger, in 2 to ``MAX_PARTS`` runs, e.g. a detector's
    boxes and class scores), each run."""
    import numpy as np  # measuring only (module docstring)

    ref = np.asarray(reference)
    whole = [("", (slice(None),))]
    if ref.ndim < 2 or ref.size == 0 or not np.isfinite(ref).all():
        return whole
    for axis in dict.fromkeys((1, ref.ndim - 1)):
        if ref.shape[axis] < 2:
            continue
        others = tuple(a for a in range(ref.ndim) if a != axis)
        low, high = ref.min(axis=others), ref.max(axis=others)
        unit = (low >= 0.0) & (high <= 1.0)
        starts = [0, *(np.flatnonzero(unit[1:] != unit[:-1]) + 1).tolist(), len(unit)]
        if not 3 <= len(starts) <= MAX_PARTS + 1:
            continue
        peak = np.maximum(np.abs(low), np.abs(high))
        if peak[~unit].max() < PART_RATIO * max(float(peak[unit].max()), 1e-30):
            continue
        lead = "[:, " if axis == 1 else "[..., "
        return [(f"{lead}{a}:{b}]", (*(slice(None),) * axis, slice(a, b))) for a, b in zip(starts, starts[1:])]
    return whole


def budget_from(min_sqnr_db: float | None, min_agreement: float | None, *, judged: bool = True) -> Budget | None:
    """The budget of a request: the defaults where a bound is not given; None when fidelity is not judged."""
    if not judged:
        return None
    return Budget(DEFAULT_MIN_SQNR_DB if min_sqnr_db is None else min_sqnr_db, min_agreement)
