"""The graph inputs a file declares, refused up front when no real input could have that shape.

A declared dimension must not be 0 and the input must be small enough to allocate: ONNX Runtime
would otherwise fail late (``Unable to allocate 8.00 PiB``). A negative dimension is dynamic, as
ONNX Runtime reads it (Paddle exports declare their batch as -1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from quantship.errors import FileRefused

MAX_INPUT_BYTES = 4 << 30  # one feed of one input; anything larger is not a model someone runs here


@dataclass(frozen=True)
class DeclaredInput:
    """A graph input: its name, numpy dtype, and dims (``None`` where symbolic or unset)."""

    name: str
    dtype: np.dtype
    dims: tuple[int | None, ...]

    def describe(self) -> str:
        return "x".join("?" if d is None else str(d) for d in self.dims) + f" {self.dtype}"


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a feed must provide: those no initializer fills, in declared order."""
    initializers = {t.name for t in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initializers]


def element_dtype(value: onnx.ValueInfoProto, where: str = "") -> np.dtype:
    """The numpy dtype of a graph input; ``FileRefused`` (prefixed with ``where``) when numpy has none."""
    elem_type = value.type.tensor_type.elem_type
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        raise FileRefused(f"{where}input {value.name!r} has element type {elem_type}, which numpy cannot "
                          "represent") from None


def declared_inputs(model: onnx.ModelProto, path: str | Path) -> list[DeclaredInput]:
    """The non-initializer graph inputs of ``model``; refuses non-positive or absurd dimensions."""
    found = []
    for value in graph_inputs(model):
        tensor_type = value.type.tensor_type
        dtype = element_dtype(value, f"{path}: ")
        dims = []
        for i, d in enumerate(tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value < 0:
                dims.append(None)  # dynamic, as ONNX Runtime reads a negative dim (Paddle's -1)
            elif d.HasField("dim_value"):
                if d.dim_value == 0:
                    raise FileRefused(f"{path}: input {value.name!r} declares dimension {i} = {d.dim_value}; "
                                      "declared dimensions must be positive (fix the exporter's input shape)")
                dims.append(int(d.dim_value))
            else:
                dims.append(None)
        elements = int(np.prod([d or 1 for d in dims], dtype=object))
        if elements * dtype.itemsize > MAX_INPUT_BYTES:
            raise FileRefused(f"{path}: input {value.name!r} declares shape {dims} ({elements * dtype.itemsize / 2**30:.3g} "
                              f"GiB for one input), larger than {MAX_INPUT_BYTES >> 30} GiB; is the shape right?")
        found.append(DeclaredInput(value.name, dtype, tuple(dims)))
    if not found:
        raise FileRefused(f"{path}: the graph declares no input to feed")
    return found
