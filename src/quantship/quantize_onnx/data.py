"""Calibration feeds for an ONNX file: arrays of the dtype and rank each graph input declares.

``feeds`` checks user data against the file's declared inputs (name, element type, rank, fixed
dims) and cuts it into batches (a shorter last batch is kept: fewer samples than the batch size is
one shorter batch). ``read_calibration`` reads ``.npy`` (one input), ``.npz`` (keys = input names,
or one array for a single input) or an image folder (a single 4-D float input). Refusals are
``DataRefused`` with one line that names the input.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quantship.errors import DataRefused, FileRefused, one_line
from quantship.inspect.read.inputs import element_dtype, graph_inputs

Feed = dict[str, np.ndarray]


@dataclass(frozen=True)
class Input:
    """A graph input as a feed must match it: dims ``None`` where dynamic (symbolic, -1 or 0)."""

    name: str
    dtype: np.dtype
    dims: tuple[int | None, ...]

    def describe(self) -> str:
        return f"{self.dtype} [{', '.join('?' if d is None else str(d) for d in self.dims)}]"


def model_inputs(model: onnx.ModelProto) -> list[Input]:
    """The inputs a feed provides (initializers listed as inputs excluded), as ONNX Runtime reads them."""

    found = []
    for value in graph_inputs(model):
        tensor_type = value.type.tensor_type
        dtype = element_dtype(value)
        dims = tuple(int(d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else None
                     for d in tensor_type.shape.dim)
        found.append(Input(value.name, dtype, dims))
    if not found:
        raise FileRefused("the graph declares no input to feed")
    return found


def _cast(array: np.ndarray, spec: Input, source: str) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise DataRefused(f"{source}: calibration data for input {spec.name!r} is a {type(array).__name__}, "
                          "not a numpy array")
    kind = spec.dtype.kind
    if array.dtype.kind == "c" or array.dtype.kind not in "fiub":
        raise DataRefused(f"{source}: input {spec.name!r} is declared {spec.dtype}, but the calibration data holds "
                          f"{array.dtype} values")
    if kind == "f":
        if array.dtype.kind == "b":
            raise DataRefused(f"{source}: input {spec.name!r} is declared {spec.dtype}, but the calibration data "
                              "holds booleans")
        out = array.astype(spec.dtype, copy=False)
        bad = ~np.isfinite(out)
        if bad.any():
            raise DataRefused(f"{source}: the data for input {spec.name!r} holds {int(bad.sum())} NaN or infinite "
                              "value(s); clean it first")
        return out
    if kind in "iu":
        if array.dtype.kind not in "iu":
            raise DataRefused(f"{source}: input {spec.name!r} is declared {spec.dtype} (integers: ids, bytes), "
                              f"but the calibration data holds {array.dtype} values; give an integer array")
        info = np.iinfo(spec.dtype)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise DataRefused(f"{source}: the data for input {spec.name!r} spans [{array.min()}, {array.max()}], "
                              f"outside {spec.dtype}")
        return array.astype(spec.dtype, copy=False)
    if kind == "b":
        if array.dtype.kind != "b":
            raise DataRefused(f"{source}: input {spec.name!r} is declared bool, but the data holds {array.dtype}")
        return array
    raise DataRefused(f"{source}: input {spec.name!r} is declared {spec.dtype}, which calibration cannot feed")


def _check_shape(array: np.ndarray, spec: Input, source: str) -> None:
    if array.ndim != len(spec.dims):
        raise DataRefused(f"{source}: the file declares input {spec.name!r} as {spec.describe()} (rank "
                          f"{len(spec.dims)}), but the calibration data has shape {list(array.shape)} (rank {array.ndim})")
    if array.shape[0] == 0:
        raise DataRefused(f"{source}: the calibration data for input {spec.name!r} is empty")
    wrong = [(i, d, s) for i, (d, s) in enumerate(zip(spec.dims, array.shape)) if i and d is not None and d != s]
    if wrong:
        i, d, s = wrong[0]
        raise DataRefused(f"{source}: the file declares input {spec.name!r} as {spec.describe()}, but the calibration "
                          f"data has shape {list(array.shape)} (dimension {i} is {s}, not {d})")


def feeds(inputs: Sequence[Input], arrays: Mapping[str, np.ndarray], *, batch_size: int, max_samples: int,
          source: str = "calibration data") -> list[Feed]:
    """Whole-dataset arrays (one per input, samples on axis 0) cut into checked batches."""
    missing = [i.name for i in inputs if i.name not in arrays]
    if missing:
        raise DataRefused(f"{source}: no data for input(s) {missing}; the file's inputs are "
                          f"{[i.name for i in inputs]} (a .npz needs one array per input, keyed by its name)")
    checked = {}
    for spec in inputs:
        array = _cast(arrays[spec.name], spec, source)
        _check_shape(array, spec, source)
        checked[spec.name] = array
    counts = {len(a) for a in checked.values()}
    if len(counts) != 1:
        raise DataRefused(f"{source}: the inputs hold different numbers of samples {sorted(counts)}")
    n = min(counts.pop(), max_samples)
    fixed = {spec.dims[0] for spec in inputs if spec.dims and spec.dims[0] is not None}
    if fixed:
        batch_size = fixed.pop()  # the file serves one batch size only
        n = (n // batch_size) * batch_size
        if n == 0:
            raise DataRefused(f"{source}: the file's batch dimension is fixed at {batch_size}, and the data holds "
                              f"fewer samples than that")
    return [{k: np.ascontiguousarray(v[start:min(start + batch_size, n)]) for k, v in checked.items()}
            for start in range(0, n, batch_size)]


def as_feeds(calibration: Any, inputs: Sequence[Input]) -> list[Feed]:
    """The library's calibration argument as checked feeds: an array (one input), a dict of arrays
    (one per input), or an iterable of either (each a batch)."""
    def one(batch: Any) -> dict[str, np.ndarray]:
        if isinstance(batch, Mapping):
            return {k: np.asarray(v) for k, v in batch.items()}
        if isinstance(batch, (tuple, list)) and len(inputs) > 1 and len(batch) == len(inputs):
            return {spec.name: np.asarray(v) for spec, v in zip(inputs, batch)}
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        if hasattr(x, "detach"):
            x = x.detach().cpu().numpy()
        if len(inputs) != 1:
            raise DataRefused(f"the file has {len(inputs)} inputs {[i.name for i in inputs]}: give each batch as a "
                              "dict {input name: array}")
        return {inputs[0].name: np.asarray(x)}

    if isinstance(calibration, (np.ndarray, Mapping)) or hasattr(calibration, "detach"):
        batches = [one(calibration)]
    else:
        batches = [one(b) for b in calibration]
    if not batches:
        raise DataRefused("no calibration batch: give at least one")
    out = []
    for i, batch in enumerate(batches):
        fed = feeds(inputs, batch, batch_size=len(next(iter(batch.values()))) or 1, max_samples=1 << 62,
                    source=f"calibration batch {i}")
        out.extend(fed)
    return out


def read_arrays(path: str, inputs: Sequence[Input], key: str | None = None) -> dict[str, np.ndarray]:
    """``.npy`` / ``.npz`` calibration data as one array per input name."""
    p = Path(path)
    if not p.exists():
        raise DataRefused(f"calibration data {path} does not exist")
    try:
        if p.suffix == ".npy":
            if len(inputs) != 1:
                raise DataRefused(f"{path}: the file has {len(inputs)} inputs {[i.name for i in inputs]}; give a "
                                  ".npz with one array per input name")
            return {inputs[0].name: np.load(p, allow_pickle=False)}
        if p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as archive:
                names = list(archive.keys())
                if key is not None:
                    if key not in names:
                        raise DataRefused(f"{path} holds no array {key!r}; it holds {names}")
                    if len(inputs) != 1:
                        raise DataRefused(f"--key picks one array, but the file has {len(inputs)} inputs")
                    return {inputs[0].name: archive[key]}
                wanted = [i.name for i in inputs]
                if all(n in names for n in wanted):
                    return {n: archive[n] for n in wanted}
                if len(inputs) == 1 and len(names) == 1:
                    return {wanted[0]: archive[names[0]]}
                raise DataRefused(f"{path} holds arrays {names}; the file's inputs are {wanted}: key the arrays "
                                  "by input name (or pick one with --key)")
    except DataRefused:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DataRefused(f"cannot read {path} as a numpy array (empty or truncated?): {one_line(exc)}") from None
    raise DataRefused(f"calibration data {path}: use a .npy or .npz file, or a folder of images")
