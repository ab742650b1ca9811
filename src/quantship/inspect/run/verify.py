"""Does the file compute what the PyTorch model computes? Argmax agreement and logit error in LSB.

A file is read twice by ONNX Runtime on this CPU: literally (graph optimizations disabled: the
arithmetic its Q/DQ pairs describe) and at ONNX Runtime's default level (its fused integer kernels:
what a user's ``InferenceSession(path)`` runs). The two agree within a couple of LSB, except on x86
CPUs without VNNI, where u8 x s8 kernels saturate with full-range int8 weights: then
``FusedKernelDrift`` is warned, once per call. torch is imported only inside the functions that
run a torch model.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from quantship.inspect.read.inputs import graph_inputs
from quantship.inspect.read.lsb import LSBError, lsb_error, output_scales
from quantship.inspect.run.consumers import cpu_info, ort_session, run_session
from quantship.inspect.run.outputs import output_arrays

__all__ = [
    "DRIFT_LSB", "FusedKernelDrift", "MeasuredPath", "Readings", "Verification", "compare_logits",
    "measure_readings", "ort_session", "readings_of", "readings_of_outputs", "run_session", "split_batches",
    "torch_outputs", "verify_qdq", "warn_if_drift",
]

DRIFT_LSB = 2.0  # the two readings may differ by this much (requantization rounding) before a warning
_ROUNDING = 1e-3  # float32 outputs: a difference of exactly N steps reads as N +- 1e-7 LSB


class FusedKernelDrift(UserWarning):
    """ONNX Runtime's fused kernels run the file more than ``DRIFT_LSB`` away from the file read literally."""


@dataclass(frozen=True)
class Readings:
    """One file run by ONNX Runtime twice on the same inputs: literally and with its fused kernels.

    ``*_lsb``: max error of each reading against the reference (the PyTorch model), in output LSB;
    ``gap_lsb``: max difference between the two readings. ``None`` where there is no reference or
    no output scale (a float output). ``*_agreement``: argmax agreement with the reference.
    """

    literal_lsb: float | None
    fused_lsb: float | None
    gap_lsb: float | None
    scale: float | None
    n_values: int
    literal_agreement: float | None = None
    fused_agreement: float | None = None
    cpu: str = ""
    reference: str = "torch"  # what the readings are measured against: the PyTorch model, or the FP32 file
    # a file with several outputs: each one's readings by graph output name (the fields above are then the
    # worst LSB over them, the first output's scale and agreement, and every output's values counted)
    per_output: dict[str, Readings] | None = None

    @property
    def drifts(self) -> bool:
        """The fused kernels run the file more than ``DRIFT_LSB`` away from its literal reading."""
        return self.gap_lsb is not None and self.gap_lsb > DRIFT_LSB + _ROUNDING

    def as_dict(self) -> dict:
        return {**asdict(self), "drifts": self.drifts}

    def __str__(self) -> str:
        def lsb(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.1f} LSB"

        vs = f"vs {self.reference}: literal {lsb(self.literal_lsb)}, fused {lsb(self.fused_lsb)}; " \
            if self.literal_lsb is not None else ""
        text = f"ONNX Runtime {vs}fused vs literal {lsb(self.gap_lsb)}"
        if self.per_output:
            each = ", ".join(f"{name} {lsb(r.literal_lsb)} / {lsb(r.fused_lsb)}" for name, r in self.per_output.items())
            text += f" (worst of {len(self.per_output)} outputs; literal / fused per output: {each})"
        return text

    @classmethod
    def of_outputs(cls, named: list[tuple[str, Readings]]) -> Readings:
        """One output's readings as they are; several outputs' as the worst LSB over them, each kept
        in ``per_output`` under its graph output name."""
        if len(named) == 1:
            return named[0][1]
        first = named[0][1]

        def worst(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return max(known) if known else None

        readings = [r for _, r in named]
        return cls(
            literal_lsb=worst([r.literal_lsb for r in readings]), fused_lsb=worst([r.fused_lsb for r in readings]),
            gap_lsb=worst([r.gap_lsb for r in readings]), scale=first.scale,
            n_values=sum(r.n_values for r in readings), literal_agreement=first.literal_agreement,
            fused_agreement=first.fused_agreement, cpu=first.cpu, reference=first.reference,
            per_output=dict(named),
        )


class Verification(float):
    """``verify_qdq``'s result: a float (the argmax agreement, as before) carrying both readings.

    ``float(v)`` / comparisons use the agreement of the reading asked for (literal by default);
    ``v.readings`` holds both readings' agreement and LSB error, and their gap.
    """

    readings: Readings

    def __new__(cls, agreement: float, readings: Readings) -> Verification:
        obj = super().__new__(cls, agreement)
        obj.readings = readings
        return obj

    def __repr__(self) -> str:
        return f"Verification({float(self)!r}, {self.readings!r})"

    __str__ = float.__repr__  # prints as the agreement, as the plain float did


class MeasuredPath(type(Path())):  # Path's concrete class (PosixPath/WindowsPath): subclassable on 3.11
    """The path ``export_qdq`` returns: an ordinary ``Path`` with ``readings`` measured on the sample."""

    readings: Readings | None = None

    @classmethod
    def of(cls, path: str | Path, readings: Readings | None) -> MeasuredPath:
        out = cls(path)
        out.readings = readings
        return out


def readings_of(literal: np.ndarray, fused: np.ndarray, scale: float | None,
                reference: np.ndarray | None = None, against: str = "torch") -> Readings:
    """Both readings of one output (the file read literally, and fused), against ``reference``
    (named ``against`` in what the readings print: the PyTorch model, or the FP32 file)."""
    literal, fused = np.asarray(literal), np.asarray(fused)

    def err(a: np.ndarray, b: np.ndarray) -> float | None:
        return lsb_error(a, b, scale).max_lsb if scale else None

    def agree(out: np.ndarray) -> float | None:
        if reference is None:
            return None
        return float((out.argmax(-1) == reference.argmax(-1)).mean())

    return Readings(
        literal_lsb=None if reference is None else err(reference, literal),
        fused_lsb=None if reference is None else err(reference, fused),
        gap_lsb=err(literal, fused), scale=scale, n_values=int(literal.size),
        literal_agreement=agree(literal), fused_agreement=agree(fused), cpu=cpu_info()[0], reference=against,
    )


def warn_if_drift(readings: Readings, what: str, stacklevel: int = 2, *, seven_bit: bool = False) -> bool:
    """Warn ``FusedKernelDrift`` once when the two readings differ by more than ``DRIFT_LSB``.

    ``seven_bit``: the file's weights already use 7 bits (``reduce_range``), so the warning does not
    offer them as the fix."""
    if not readings.drifts:
        return False
    head = (f"{what}: ONNX Runtime's default optimizations (its fused integer kernels) run this file "
            f"{readings.gap_lsb:.1f} LSB away from the file read literally on this CPU ({readings.cpu or 'unknown'}). ")
    if seven_bit:
        cause = ("Its weights already use 7 bits, so the u8 x s8 int16 saturation of CPUs without VNNI is not "
                 "the cause: the fused kernels requantize each layer's output in their own rounding, and a "
                 "deep network amplifies one-step differences. The literal reading is what the file says; "
                 "check the fused one on your data (`quantship check --run`) before deploying.")
    else:
        _, flags = cpu_info()
        vnni = bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)
        here = ("this CPU has VNNI, so saturation is less likely here than requantization rounding "
                "accumulated over depth" if vnni else "this CPU has no VNNI, so saturation is the likely cause")
        cause = ("Cause on x86 CPUs without VNNI: u8 x s8 products summed in saturating int16 pairs when int8 "
                 f"weights use their full range ({here}). Fix: quantize for target='onnxruntime-cpu' (7-bit "
                 "weights), or pass reduce_range=True.")
    warnings.warn(head + cause, FusedKernelDrift, stacklevel=stacklevel + 1)
    return True


def readings_of_outputs(names: list[str], scales: dict[str, float | None], literal: list[np.ndarray],
                        fused: list[np.ndarray], reference: list[np.ndarray] | None = None,
                        against: str = "torch") -> Readings:
    """Both readings of every output of a file (graph output ``names``, in order), each in its own output's
    LSB (``scales``, read off the file), against ``reference`` (one array per output, same order)."""
    if reference is not None and len(reference) != len(names):
        raise ValueError(f"the file has {len(names)} output(s) ({', '.join(names)}) but the reference "
                         f"{len(reference)}: compare a model with the file exported from it")
    return Readings.of_outputs([
        (name, readings_of(literal[i], fused[i], scales.get(name), None if reference is None else reference[i],
                           against))
        for i, name in enumerate(names)])


def measure_readings(path: str | Path, batches: list[list[np.ndarray]],
                     reference: np.ndarray | list[np.ndarray] | None = None) -> Readings:
    """Run ``path`` literally and fused on ``batches`` (each a list of positional inputs) and read it
    against ``reference`` (the batches' reference outputs, concatenated): an array reads the first
    output, a list one array per output (every output, each in its own LSB)."""
    scales = output_scales(path)
    names = list(scales)
    outs = []
    for optimized in (False, True):
        session = ort_session(path, optimized=optimized)
        runs = [run_session(session, batch) for batch in batches]
        outs.append([np.concatenate([run[i] for run in runs]) for i in range(len(names))])
    if reference is None or isinstance(reference, list):
        return readings_of_outputs(names, scales, outs[0], outs[1], reference)
    return readings_of(outs[0][0], outs[1][0], scales[names[0]], reference)


def torch_outputs(model: Any, batches: list[Any]) -> np.ndarray:
    """The first output of a torch model over ``batches`` (a tensor or a tuple of tensors each); every
    output, named: ``outputs.output_arrays``."""
    return output_arrays(model, batches)[1][0]


def split_batches(sample: Any, n_batches: int) -> list[Any]:
    """``sample`` cut into ``n_batches`` equal batches along dim 0; unequal cuts are refused."""
    if isinstance(n_batches, bool) or not isinstance(n_batches, int) or n_batches < 1:
        raise ValueError(f"n_batches={n_batches!r} must be a positive int")
    n = int(sample.shape[0])
    if n % n_batches:
        raise ValueError(
            f"n_batches={n_batches} does not divide the {n} inputs of `sample` into equal batches; a "
            f"pt2e model runs at one batch size only: pick n_batches among the divisors of {n}"
        )
    size = n // n_batches
    return [sample[i * size:(i + 1) * size] for i in range(n_batches)]


def _check_batch(path: str | Path, batch_size: int) -> None:
    """Refuse batches whose size is not the file's fixed batch size (read off the file, no session)."""
    import onnx


    model = onnx.load(str(path), load_external_data=False)
    first = next(iter(graph_inputs(model)), None)
    dims = first.type.tensor_type.shape.dim if first is not None else []
    dim = dims[0].dim_value if dims and dims[0].HasField("dim_value") else None
    if isinstance(dim, int) and dim != batch_size:
        raise ValueError(
            f"the file was exported at batch size {dim}, but the batches are {batch_size} inputs each: "
            f"choose n_batches so that len(sample) / n_batches == {dim}"
        )


def _outputs(model: Any, path: str | Path, sample: Any, n_batches: int, optimized: bool) -> tuple[np.ndarray, np.ndarray]:
    """First output of the torch model and of the file over every batch, concatenated."""
    batches = split_batches(sample, n_batches)
    _check_batch(path, int(batches[0].shape[0]))
    session = ort_session(path, optimized=optimized)
    ref = torch_outputs(model, batches)
    got = np.concatenate([run_session(session, [b.detach().cpu().numpy()])[0] for b in batches])
    return ref, got


def verify_qdq(model: Any, path: str | Path, sample: Any, n_batches: int = 1, *,
               optimized: bool = False) -> Verification:
    """Fraction of inputs on which the file (in ONNX Runtime) and the PyTorch model predict the same class.

    The file is read twice, literally and with ONNX Runtime's default optimizations; the result is
    a ``float`` (the agreement of the literal reading, or of the fused one with ``optimized=True``)
    whose ``.readings`` carries both readings (agreement and max LSB vs torch) and their gap. Every
    output of the model (a tuple, a dict, a ``ModelOutput``) is compared with the file's output in
    the same position, in that output's LSB (``.readings.per_output``); the agreement is the first's.
    Warns ``FusedKernelDrift`` when the readings differ by more than ``DRIFT_LSB``, and a
    ``UserWarning`` when the reference predicts one class for every input (the agreement then
    says nothing). ``sample`` is split into ``n_batches`` equal batches (the file's batch size).
    """
    if not callable(getattr(sample, "detach", None)):  # a list of batches, a numpy array: one line, not a traceback
        raise TypeError(f"verify_qdq(sample=...) takes one torch.Tensor holding every input (split into n_batches "
                        f"batches), got {type(sample).__name__}: give torch.cat(batches) with "
                        "n_batches=len(batches), or torch.from_numpy(array)")
    batches = split_batches(sample, n_batches)
    _check_batch(path, int(batches[0].shape[0]))
    _, refs = output_arrays(model, batches)
    readings = measure_readings(path, [[b.detach().cpu().numpy()] for b in batches], refs)
    ref_pred = refs[0].argmax(-1)
    if len(ref_pred) > 1 and np.unique(ref_pred).size == 1:
        warnings.warn(
            f"the reference model predicts class {int(ref_pred.flat[0])} for all {ref_pred.size} inputs, "
            "so this agreement is 1.0 whatever the file computes: the check is vacuous. Use a trained "
            "model on inputs whose predictions vary, or compare_logits() for a logit-level check.",
            UserWarning,
            stacklevel=2,
        )
    warn_if_drift(readings, str(path))
    agreement = readings.fused_agreement if optimized else readings.literal_agreement
    return Verification(math.nan if agreement is None else agreement, readings)


def compare_logits(model: Any, path: str | Path, sample: Any, n_batches: int = 1, *, optimized: bool = False) -> LSBError:
    """Error of the file's first output against the PyTorch model, in steps (LSB) of its output scale."""
    scale = next(iter(output_scales(path).values()), None)
    if scale is None:
        raise ValueError(
            f"{path}: the first output is not produced by a per-tensor DequantizeLinear, so it has no "
            "quantization step to measure in; compare it in absolute terms instead"
        )
    ref, got = _outputs(model, path, sample, n_batches, optimized)
    return lsb_error(ref, got, scale)
