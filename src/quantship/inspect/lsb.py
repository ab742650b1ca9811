"""Errors in units of the output's quantization step (LSB), read off a QDQ file."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper


@dataclass(frozen=True)
class LSBError:
    """Disagreement between two output arrays, in output LSB and in absolute terms."""

    max_lsb: float
    mean_lsb: float
    max_abs: float
    scale: float
    n_values: int

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"max {self.max_lsb:.1f} LSB, mean {self.mean_lsb:.2f} LSB (max abs {self.max_abs:.4g})"


def _constant_value(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
    return None


def output_scales(path: str | Path | onnx.ModelProto) -> dict[str, float | None]:
    """For each graph output, the scale of the DequantizeLinear that produces it (None if float).

    Only a per-tensor scale counts: that is the step the output is stored at.
    """
    model = path if isinstance(path, onnx.ModelProto) else onnx.load(str(path), load_external_data=False)
    producer = {out: node for node in model.graph.node for out in node.output}
    scales: dict[str, float | None] = {}
    for output in model.graph.output:
        node = producer.get(output.name)
        # look through shape-only ops that keep the quantized values (e.g. a final Reshape)
        while node is not None and node.op_type in {"Reshape", "Flatten", "Squeeze", "Identity"}:
            node = producer.get(node.input[0])
        scale = None
        if node is not None and node.op_type == "DequantizeLinear":
            value = _constant_value(model, node.input[1])
            if value is not None and value.size == 1:
                scale = float(value.reshape(()))
        scales[output.name] = scale
    return scales


def lsb_error(reference: np.ndarray, candidate: np.ndarray, scale: float) -> LSBError:
    """How far ``candidate`` is from ``reference``, in steps of ``scale``."""
    reference = np.asarray(reference, dtype=np.float64)
    candidate = np.asarray(candidate, dtype=np.float64)
    if reference.shape != candidate.shape:
        raise ValueError(f"cannot compare outputs of shapes {reference.shape} and {candidate.shape}")
    if not scale or scale <= 0:
        raise ValueError(f"scale={scale!r}: an LSB comparison needs the output's positive quantization step")
    diff = np.abs(reference - candidate)
    return LSBError(
        max_lsb=float(diff.max() / scale), mean_lsb=float(diff.mean() / scale),
        max_abs=float(diff.max()), scale=float(scale), n_values=int(diff.size),
    )
