"""``check_file``: will a target accept this file, and if not, why and how to fix it.

Static findings come from the rules in ``rules`` a target's ``FileRules`` name; with ``run=True`` the consumer itself
is run where it can run here (``runs``) and its result joins the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantship import targets
from quantship.inspect.judge import runs as consumer_runs
from quantship.inspect.judge.rules import RULES
from quantship.inspect.read.facts import FileFacts, facts_of
from quantship.inspect.read.graph import FileReport, report_of
from quantship.inspect.read.quantization import QuantFacts
from quantship.progress import step
from quantship.report_json import strict_json
from quantship.targets import Target

REPORT_VERSION = 1  # "verdict" and each run's "status" were added as new keys (readers of v1 keep working)
ACCEPTED, REFUSED, FAILED, INCONCLUSIVE = "accepted", "refused", "failed", "inconclusive"
NOT_RUN = consumer_runs.NOT_RUN  # a run was asked for and none could run here: never "accepted"
_SHOWN = 6  # offenders quoted in a message; the full list is in ``offending``


@dataclass(frozen=True)
class Finding:
    """One broken rule: which, how bad, what it hits, and the fix."""

    rule: str
    severity: str  # "error": the target refuses the file; "warning": it runs, but hear this
    message: str
    offending: list[str]
    fix: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CheckReport:
    """The verdict for one file and one target; ``as_dict()`` is the versioned JSON form."""

    path: str
    target: str
    format: str
    findings: list[Finding]
    runs: list[Any] = field(default_factory=list)  # consumer_runs.RunResult, when run=True
    report: FileReport | None = None
    version: int = REPORT_VERSION

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def verdict(self) -> str:
        """``refused``: the target's rules refuse the file (static); ``failed``: the consumer ran it
        beyond its tolerance, or could not load/compile/run it; ``inconclusive``: the run could not
        tell (e.g. a constant reference output); ``not run``: a run was asked for and none ran here (the
        rules accept the file; each run's detail says why); ``accepted`` otherwise. First match wins."""
        if self.errors:
            return REFUSED
        ran = [r for r in self.runs if r.ran]
        if self.runs and not ran:
            return NOT_RUN
        if any(r.status == FAILED or (not r.ok and r.status != INCONCLUSIVE) for r in ran):
            return FAILED
        if any(r.status == INCONCLUSIVE for r in ran):
            return INCONCLUSIVE
        return ACCEPTED

    @property
    def ok(self) -> bool:
        """True when nothing speaks against the file: no error finding and every run that ran passed
        (``accepted``, or ``not run`` when the consumer cannot run here: the verdict says which)."""
        return self.verdict in (ACCEPTED, NOT_RUN)

    def summary(self) -> str:
        """The verdict in one line, as ``check`` and ``quantize`` print it."""
        verdict = self.verdict
        if verdict == REFUSED:  # compact: the rule and how many nodes it hits; findings say the rest
            return "refused: " + ", ".join(f"{f.rule} ({len(f.offending)})" for f in self.errors)
        ran = [r for r in self.runs if r.ran]
        if verdict == FAILED:
            run = next(r for r in ran if not r.ok and r.status != INCONCLUSIVE)
            if run.readings:  # a weight-only file: the judged reading ("exact" where the runtime has two)
                judged = consumer_runs.EXACT.name if consumer_runs.EXACT.name in run.readings else next(iter(run.readings))
                return (f"failed: {run.consumer} {judged} reading {run.readings[judged]:.1e} > "
                        f"{run.relative_tolerance:.0e} relative")
            if run.max_lsb is not None and run.tolerance_lsb is not None and run.max_lsb > run.tolerance_lsb:
                where = f" ({run.worst_output})" if run.worst_output else ""
                return f"failed: {run.consumer} {run.max_lsb:.1f} LSB{where} > tolerance {round(run.tolerance_lsb, 1):g}"
            return f"failed: {run.consumer}: {run.detail}"
        if verdict == NOT_RUN:
            why = "; ".join(f"{r.consumer}: {r.detail}" for r in self.runs)
            return f"not run ({why}); the rules accept the file"
        if verdict == INCONCLUSIVE:
            run = next(r for r in ran if r.status == INCONCLUSIVE)
            return f"inconclusive ({run.consumer}): {run.detail.removeprefix('inconclusive: ')}"
        measured = [f"{r.consumer} {r.max_lsb:.1f} LSB" + (f" <= {round(r.tolerance_lsb, 1):g}" if r.tolerance_lsb else "")
                    for r in ran if r.max_lsb is not None]
        for r in (r for r in ran if r.readings):  # a weight-only file: the judged reading first ("exact" in ORT)
            judged, *others = sorted(r.readings, key=lambda name: name != consumer_runs.EXACT.name)
            measured.append(f"{r.consumer} {judged} {r.readings[judged]:.1e} <= {r.relative_tolerance:.0e} relative"
                            + "".join(f", {name} session {r.readings[name]:.1e}" for name in others))
        return "accepted" + (f" (ran: {', '.join(measured)})" if measured else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "report": "quantship-check", "version": self.version, "path": self.path,
            "target": self.target, "verdict": self.verdict, "ok": self.ok, "format": self.format,
            "weight_only": self._weight_only_summary(),
            "findings": [f.as_dict() for f in self.findings],
            "runs": [r.as_dict() for r in self.runs],
        }

    def to_json(self) -> str:
        return strict_json(self.as_dict())

    def _weight_only_summary(self) -> dict[str, Any] | None:
        """A weight-only file's format, bits, groups and counts (``inspect --json`` lists every weight)."""
        low_bit = self.report.weight_only if self.report is not None else None
        return {k: v for k, v in low_bit.items() if k not in ("weights", "float_weights")} if low_bit else None

    def describe_format(self) -> str:
        """The format in words: ``QDQ``, or a weight-only file's ``weight-only int4, MatMulNBits, group 32``."""
        low_bit = self.report.weight_only if self.report is not None else None
        return low_bit["description"] if low_bit else self.format


def _finding(rule_id: str, severity: str, facts: QuantFacts, tgt: Target) -> Finding | None:
    rule = RULES[rule_id]
    offending = rule.offenders(facts, tgt)
    if not offending:
        return None
    what = ", ".join(offending[:_SHOWN]) + (f", ... ({len(offending) - _SHOWN} more)" if len(offending) > _SHOWN else "")
    # a warning means this target runs the file: the requirement is other runtimes'
    who = tgt.consumer if severity == "error" or rule_id == "weight_range_7bit" else \
        "portable runtimes (TensorRT, OpenVINO, TiGrIS)"
    message, fix = rule.words_for(facts)
    message = message.format(consumer=who, n=len(offending), what=what,
                                  low=tgt.file_rules.opset[0], high=tgt.file_rules.opset[1])
    if severity == "warning":
        message = f"{tgt.consumer} runs this file, but: {message}"
    return Finding(rule_id, severity, message, list(offending), fix)


def findings_for(facts: QuantFacts, tgt: Target) -> list[Finding]:
    """Apply ``tgt``'s file rules to ``facts`` (errors first, in table order)."""
    found = [_finding(r, "error", facts, tgt) for r in tgt.file_rules.errors]
    found += [_finding(r, "warning", facts, tgt) for r in tgt.file_rules.warnings]
    return [f for f in found if f is not None]


def check_file(path: str | Path | FileFacts, target: str | Target, run: bool = False, n_inputs: int = 20,
               inputs: Any = None) -> CheckReport:
    """Check ``path`` (or one read of it, ``FileFacts``) against ``target``'s rules; with ``run`` also
    run the consumer on it.

    ``inputs``: real data for the run, read by the one loader (``feeds.for_run``: a path, an array, a
    dict by input name, or a list of batches; cut at the file's batch size, at most ``n_inputs``
    batches); default ``n_inputs`` batches generated for each input's dtype and range. ``target``: a
    name or alias, or its ``Target``.
    """
    tgt = targets.get(target)  # refuse an unknown target before reading anything; resolve aliases
    facts = facts_of(path)
    report = CheckReport(facts.path, tgt.name, facts.quant.format, findings_for(facts.quant, tgt),
                         report=report_of(facts))
    if run:
        where, weight_only = facts.path, facts.quant.weight_only
        del facts  # its model holds every weight: not kept beside the sessions of the run
        with step(f"check --run: {tgt.name}"):
            report.runs.append(consumer_runs.run_consumer(where, tgt, n_inputs=n_inputs, inputs=inputs,
                                                          weight_only=weight_only))
    return report
