"""The verdict on running a target's consumer: passed, failed, inconclusive or not run.

``run_consumer`` runs a target's runner (``run.consumers.RUNNERS``) where it can run here,
measures it against ONNX Runtime reading the file literally, in output LSB, and judges the result
by the target's tolerance; ``check_file(run=True)`` joins its ``RunResult`` to the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantship import targets
from quantship.errors import cause
from quantship.inspect.read.feeds import for_run
from quantship.inspect.read.output_units import OutputUnit, output_units
from quantship.inspect.read.weight_only import WeightOnlyFacts
from quantship.inspect.run.consumers import (
    RUNNERS,
    constant_reference,
    lsb_between,
    run_onnxruntime,
)
from quantship.inspect.run.literal import graph_only
from quantship.inspect.run.weight_only import (
    ACCURACY_OPTION,
    DEFAULT,
    EXACT,
    RUNTIME_READINGS,
    WEIGHT_ONLY_RTOL,
    read_both,
    without_accuracy_level,
    worst_relative_error,
)
from quantship.targets import Target

# RunResult.status values
PASSED, FAILED, INCONCLUSIVE, NOT_RUN = "passed", "failed", "inconclusive", "not run"


@dataclass(frozen=True)
class RunResult:
    """What one consumer did with the file, and how far its outputs are from ONNX Runtime's.

    ``status``: ``passed`` (within ``tolerance_lsb`` of ONNX Runtime reading the file literally),
    ``failed`` (beyond it, or the consumer could not load/compile/run the file), ``inconclusive``
    (the comparison cannot tell: e.g. the reference output is the same for every input), or
    ``not run`` (the consumer is not available here).
    """

    consumer: str
    ran: bool  # False: could not run here (``detail`` says why)
    ok: bool  # status == "passed"
    detail: str
    n_inputs: int = 0
    max_lsb: float | None = None
    mean_lsb: float | None = None
    tolerance_lsb: float | None = None
    status: str = ""
    inputs: str = "generated"  # "generated": seeded data of each input's dtype and range; "given": the caller's
    inputs_detail: str = ""  # how generated data was made, per input (e.g. "input_ids: ids in [0, 100)")
    # a file with several outputs: each one's max LSB by graph output name (None: a float output, not
    # compared); ``max_lsb`` is the worst of them, so one output beyond tolerance fails the run
    per_output: dict[str, float | None] | None = None
    # ONNX Runtime's own fused kernels (default optimizations) vs its literal reading, same inputs, in LSB:
    # how far legitimate integer arithmetic drifts through this file's depth; added to the target's tolerance
    ort_fused_lsb: float | None = None
    # a weight-only file (float outputs): each reading's max |difference| / max |output| against ONNX Runtime
    # read literally, by reading (ONNX Runtime: "default" and "exact", ``run.weight_only``; else the consumer)
    readings: dict[str, float] | None = None
    relative_tolerance: float | None = None  # what the judged reading is held to ("exact" for ONNX Runtime)

    @property
    def worst_output(self) -> str | None:
        """The output whose LSB is ``max_lsb`` (None with one output)."""
        if not self.per_output or self.max_lsb is None:
            return None
        return next((name for name, lsb in self.per_output.items() if lsb == self.max_lsb), None)

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        if not self.ran:
            return f"{self.consumer}: not run ({self.detail})"
        head = f"{self.consumer}: {self.status}"
        if self.readings:
            head += (f", max |difference| / max |output| vs ONNX Runtime read literally on {self.n_inputs} {self.inputs} "
                     f"input batch(es), tolerance {self.relative_tolerance:.0e}: " + ", ".join(
                         f"{name} {error:.1e}" for name, error in self.readings.items()))
        if self.max_lsb is not None:
            if self.tolerance_lsb is None:
                judged = "(not judged)"
            else:
                judged = f"{'>' if self.max_lsb > self.tolerance_lsb else '<='} tolerance {round(self.tolerance_lsb, 1):g}"
                if self.ort_fused_lsb:
                    judged += (f" ({self.tolerance_lsb - self.ort_fused_lsb:g} + {self.ort_fused_lsb:.1f}, the distance "
                               "of ONNX Runtime's own fused kernels from its literal reading on these inputs)")
            worst = f" ({self.worst_output})" if self.worst_output else ""
            how = f" ({self.inputs_detail})" if self.inputs_detail else ""
            head += (f", max {self.max_lsb:.1f} LSB{worst} {judged}, mean {self.mean_lsb:.2f} LSB vs ONNX Runtime "
                     f"read literally, on {self.n_inputs} {self.inputs} input batch(es){how}")
            if self.per_output:
                head += "; per output: " + ", ".join(
                    f"{name} {'float' if lsb is None else f'{lsb:.1f} LSB'}" for name, lsb in self.per_output.items())
        return f"{head}; {self.detail}" if self.detail else head


def judge(consumer: str, max_lsb: float | None, mean_lsb: float | None, tolerance: float | None,
          n_inputs: int, constant: bool, inputs: str = "generated", detail: str = "",
          ort_fused_lsb: float | None = None) -> RunResult:
    """The verdict on a run that produced outputs: passed, failed (beyond ``tolerance``) or inconclusive.

    ``ort_fused_lsb`` (ONNX Runtime's fused kernels vs its literal reading) widens ``tolerance`` by
    itself: a consumer is not asked to be closer to the literal arithmetic than ONNX Runtime is.
    """
    if tolerance is not None and ort_fused_lsb:
        tolerance = tolerance + ort_fused_lsb
    if max_lsb is not None and tolerance is not None and max_lsb > tolerance:
        status = FAILED  # __str__ says by how much
    elif constant:
        status = INCONCLUSIVE
        detail = ("the reference output is the same for every input, so agreement proves "
                  "nothing; pass real inputs (check --run --inputs real.npy, or a trained model)")
    elif max_lsb is None and tolerance is not None:
        status = INCONCLUSIVE
        detail = detail or "the outputs are float and not compared in LSB"
    else:
        status = PASSED
    return RunResult(consumer, True, status == PASSED, detail, n_inputs, max_lsb, mean_lsb, tolerance, status,
                     inputs, ort_fused_lsb=ort_fused_lsb)


def run_consumer(path: str | Path, target: str | Target, n_inputs: int = 20, seed: int = 0,
                 inputs: Any = None, weight_only: WeightOnlyFacts | None = None) -> RunResult:
    """Run ``target``'s consumer on ``path`` if it can run here, and compare with ONNX Runtime.

    ``inputs``: the data of the run, read by the one loader (``feeds.for_run``: a path, an array, a dict
    by input name or a list of batches, cut at the file's batch size, at most ``n_inputs`` batches);
    None: data generated for each input's dtype and range. The reference is ONNX Runtime reading the
    file literally. ``weight_only``: the low-bit weights of a weight-only file (float outputs, no LSB), whose
    readings are measured by their relative error instead (``_weight_only_result``).
    """
    tgt = targets.get(target)  # a name or alias is resolved here; a Target passes
    model = graph_only(path)  # not the weights: the sessions below hold them
    if tgt.runner is None:
        return RunResult(tgt.consumer, False, False, f"{tgt.consumer} cannot run on this machine; checked "
                         "statically only", status=NOT_RUN)
    fed = for_run(model, inputs, n=max(1, n_inputs), seed=seed, path=path)
    feeds, kind, how = fed.batches, fed.origin, fed.detail
    n = len(feeds)
    try:
        reference = run_onnxruntime(path, feeds, optimize=False)
        if weight_only is not None and not tgt.runtime_is_onnxruntime and set(weight_only.accuracy_levels) - {0}:
            # accuracy_level is ONNX Runtime's choice of activation precision, not the file's arithmetic: another
            # runtime is held to the codes and scales, read at level 0 (float activations)
            reference = run_onnxruntime(without_accuracy_level(path), feeds, optimize=False)
    except Exception as exc:  # the reference itself fails: the file does not run at all
        return RunResult(tgt.consumer, True, False, f"ONNX Runtime could not run the file: {_first(exc)}", n,
                         status=FAILED, inputs=kind, inputs_detail=how)
    try:
        if weight_only is not None and tgt.runner in RUNTIME_READINGS:
            return _weight_only_result(tgt, weight_only, read_both(path, feeds, tgt.runner), reference, n, kind, how)
        outputs = RUNNERS[tgt.runner](path, feeds, model)
        if weight_only is not None:
            return _weight_only_result(tgt, weight_only, {tgt.consumer: outputs}, reference, n, kind, how)
    except ModuleNotFoundError as exc:
        return RunResult(tgt.consumer, False, False, f"{exc.name} is not installed", status=NOT_RUN, inputs=kind,
                         inputs_detail=how)
    except Exception as exc:  # the consumer would not load, compile or run the file: the run failed
        return RunResult(tgt.consumer, True, False, _first(exc), n, status=FAILED, inputs=kind, inputs_detail=how)
    units = output_units(path)  # every graph output, in order, each in its own LSB (a float one: carried)
    scales = [u.unit for u in units.values()]
    max_lsb, mean_lsb = lsb_between(reference, outputs, scales)
    each = None
    if len(units) > 1:
        each = {name: lsb_between([[r[k]] for r in reference], [[c[k]] for c in outputs], [scales[k]])[0]
                for k, name in enumerate(units)}
    fused = None
    if not tgt.runtime_is_onnxruntime and max_lsb is not None:
        try:
            fused = lsb_between(reference, run_onnxruntime(path, feeds, optimize=True), scales)[0]
        except Exception:  # ONNX Runtime's fused session refuses what its literal one ran: no widening
            fused = None
    notes = (["ONNX Runtime's default optimizations vs the literal QDQ graph (ORT_DISABLE_ALL)"]
             if tgt.runtime_is_onnxruntime else [])
    notes += units_note(units)
    result = judge(tgt.consumer, max_lsb, mean_lsb, tgt.file_rules.lsb_tolerance, n, constant_reference(reference), kind,
                   detail="; ".join(notes), ort_fused_lsb=fused)
    return RunResult(**{**result.as_dict(), "per_output": each or None, "inputs_detail": how})


def _weight_only_result(tgt: Target, facts: WeightOnlyFacts, readings: dict[str, list], reference: list, n: int,
                        kind: str, how: str) -> RunResult:
    """The verdict on a weight-only file's run: the runtime's exact reading (``RUNTIME_READINGS``: ONNX Runtime,
    OpenVINO; else the consumer's one run) within ``WEIGHT_ONLY_RTOL`` of the file read literally passes; the
    default reading is measured and reported beside it, with the option that reads the file exactly when the
    default reading is further off."""
    errors = {name: worst_relative_error(outputs, reference) for name, outputs in readings.items()}
    judged = errors.get(EXACT.name, next(iter(errors.values())))
    ways = {r.name: r for r in RUNTIME_READINGS.get(tgt.runner, ())}
    notes = [f"{r.describe()}" for r in ways.values()]
    if tgt.runtime_is_onnxruntime and "DequantizeLinear" in facts.forms:
        notes.append(f"{ACCURACY_OPTION} is the activations' precision in the MatMulNBits ONNX Runtime fuses from "
                     "DequantizeLinear + MatMul (4: int8, quantized at run time; 0: float)")
    int8_nodes = facts.accuracy_levels.get(4, 0)
    if int8_nodes and not tgt.runtime_is_onnxruntime:
        notes.append(f"{int8_nodes} MatMulNBits node(s) of the file carry accuracy_level 4 (ONNX Runtime's int8 "
                     f"activations): {tgt.consumer} is held to the file read at level 0, its stored arithmetic")
    elif int8_nodes:
        notes.append(f"{int8_nodes} MatMulNBits node(s) of the file carry accuracy_level 4: their activations are "
                     "int8 in every reading, the literal one included, whatever the session option")
    if errors.get(DEFAULT.name, 0.0) > WEIGHT_ONLY_RTOL and EXACT.name in ways:
        exact = ", ".join(f"{k}={v}" for k, v in ways[EXACT.name].options)
        notes.append(f"{tgt.consumer} by default reads this file {errors[DEFAULT.name]:.1e} from its arithmetic "
                     f"(int8 activations at run time): set {exact} to read it exactly")
    if not judged <= WEIGHT_ONLY_RTOL:  # NaN too
        status = FAILED
    elif constant_reference(reference):
        status = INCONCLUSIVE
        notes.append("the reference output is the same for every input, so agreement proves nothing; pass real "
                     "inputs (check --run --inputs real.npy, or a trained model)")
    else:
        status = PASSED
    return RunResult(tgt.consumer, True, status == PASSED, "; ".join(notes), n, status=status, inputs=kind,
                     inputs_detail=how, readings=errors, relative_tolerance=WEIGHT_ONLY_RTOL)


def units_note(units: dict[str, OutputUnit]) -> list[str]:
    """What the LSB of each float output means, or why it has none (``read.output_units``: the rule)."""
    notes = []
    for name, unit in units.items():
        if unit.unit is None:
            notes.append(f"output {name!r} is float and not compared in LSB: {unit.reason}")
        elif unit.rule:
            notes.append(f"output {name!r} in LSB of {unit.rule} (each op's Lipschitz bound: an error beyond "
                         "tolerance is proven, within it is necessary)")
    return notes


def _first(exc: BaseException) -> str:
    return cause(exc)
