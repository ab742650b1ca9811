"""The two readings ONNX Runtime (and OpenVINO) give a weight-only file, and how far apart they are.

At its default optimization level ONNX Runtime fuses a ``DequantizeLinear`` of a 4- or 8-bit
weight and the ``MatMul`` reading it into its own ``MatMulNBits``, at the accuracy level the session
option ``session.qdq_matmulnbits_accuracy_level`` names, 4 by default: the activations are then
quantized to int8 inside the kernel (per block, at run time), so the default reading of a standard
weight-only file is not the arithmetic the file writes. The option at ``0`` (unset: float
activations) reads it exactly. A ``MatMulNBits`` node already in the file is run at its own
``accuracy_level`` attribute, which the option does not change. Both readings are measured against
the file read literally (no graph optimization), or against a torch model by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from quantship.inspect.run.consumers import Inputs, ort_session, run_openvino

ACCURACY_OPTION = "session.qdq_matmulnbits_accuracy_level"
ORT_DEFAULT_ACCURACY_LEVEL = 4  # what ONNX Runtime takes when the option is not set (int8 activations)
WEIGHT_ONLY_RTOL = 2e-3  # max |reading - reference| / max |reference| a weight-only file is held to


@dataclass(frozen=True)
class Reading:
    """One way to open a session on the file: its name, its config entries, and what no entry means."""

    name: str
    options: tuple[tuple[str, str], ...]
    unset: str = f"{ACCURACY_OPTION} unset: {ORT_DEFAULT_ACCURACY_LEVEL}"

    def describe(self) -> str:
        """``default session (session.qdq_matmulnbits_accuracy_level unset: 4)``: the options it ran with."""
        return f"{self.name} session ({', '.join(f'{k}={v}' for k, v in self.options) or self.unset})"


DEFAULT = Reading("default", ())  # what InferenceSession(path) gives a user
EXACT = Reading("exact", ((ACCURACY_OPTION, "0"),))  # float activations in the MatMulNBits ORT fuses
READINGS = (DEFAULT, EXACT)
# OpenVINO's CPU plugin does the same to a compressed (low-bit) weight's MatMul: it quantizes the activations to
# int8 in groups at run time unless DYNAMIC_QUANTIZATION_GROUP_SIZE is 0 (measured: an int4 file 8.1e-3 from
# ONNX Runtime read literally by default, 2.7e-7 with 0)
OV_DYNAMIC_QUANTIZATION = "DYNAMIC_QUANTIZATION_GROUP_SIZE"
OPENVINO_READINGS = (Reading("default", (), f"{OV_DYNAMIC_QUANTIZATION} unset: int8 activations in groups"),
                     Reading("exact", ((OV_DYNAMIC_QUANTIZATION, "0"),)))
RUNTIME_READINGS = {"onnxruntime-fused": READINGS, "openvino-cpu": OPENVINO_READINGS}  # by a target's runner


def relative_error(got: np.ndarray, reference: np.ndarray) -> float:
    """max |got - reference| / max |reference|."""
    ref = np.asarray(reference, np.float64)
    return float(np.abs(np.asarray(got, np.float64).reshape(ref.shape) - ref).max() / max(np.abs(ref).max(), 1e-12))


def worst_relative_error(got: list[list[np.ndarray]], reference: list[list[np.ndarray]]) -> float:
    """The largest ``relative_error`` over every feed and every float output (outputs in graph order; NaN
    when any output is not finite)."""
    errors = [relative_error(out, ref) for outs, refs in zip(got, reference) for out, ref in zip(outs, refs)
              if np.issubdtype(np.asarray(ref).dtype, np.floating)]
    return float("nan") if any(np.isnan(errors)) else max(errors, default=0.0)


def without_accuracy_level(model: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    """The file with every MatMulNBits node's ``accuracy_level`` removed (0: float activations), in memory: the
    arithmetic its codes and scales store, which a file written at level 4 runs with int8 activations instead."""
    proto = onnx.load(str(model)) if isinstance(model, (str, Path)) else onnx.ModelProto.FromString(
        model.SerializeToString())
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend(kept)
    return proto


def run_reading(model: str | Path | onnx.ModelProto, feeds: list[Inputs], reading: Reading,
                runner: str = "onnxruntime-fused") -> list[list[np.ndarray]]:
    """Outputs (in graph order) for each feed in ``runner``'s runtime with ``reading``'s options: ONNX Runtime at
    its default optimization level, or OpenVINO on CPU (f32 inference precision)."""
    if runner == "openvino-cpu":
        return run_openvino(model, feeds, dict(reading.options))
    session = ort_session(model, optimized=True, config=dict(reading.options))
    return [session.run(None, feed) for feed in feeds]


def read_both(model: str | Path | onnx.ModelProto, feeds: list[Inputs],
              runner: str = "onnxruntime-fused") -> dict[str, list[list[np.ndarray]]]:
    """Each reading's outputs in ``runner``'s runtime (``RUNTIME_READINGS``), by reading name (``default``, ``exact``)."""
    return {reading.name: run_reading(model, feeds, reading, runner) for reading in RUNTIME_READINGS[runner]}
