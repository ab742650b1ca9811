"""The one data loader: feeds for an ONNX file's declared inputs, read from the user's data or generated.

Every command that runs a file (``check --run``, ``compare``, ``sensitivity``, ``quantize-onnx``) and
``verify_qdq`` read their data here, by the same rules:

- ``read_data``: ``.npy`` (a single-input file), ``.npz`` keyed by the file's input names (or one array
  for a single input; ``key`` picks one), or a folder of images (one N x C x H x W float input,
  preprocessed as ``Preprocessing`` states), as one whole array per input name.
- ``cut``: whole arrays checked against the declared inputs and cut into batches. Each input is cast
  to its declared dtype when the cast is exact (int32 ids to int64, whole floats to ints, 0/1 to
  bool); a cast that would change a value (fractions or NaN for an integer input, NaN or infinity
  anywhere) is refused naming the input and the fix. Ranks and fixed dims must match; symbolic dims
  are free.
- ``as_feeds``: the Python API's data (an array or tensor, a dict by input name, or a list of either,
  each a batch) checked the same way.
- ``generated``: seeded data of each input's dtype and range when no data is given: a float input
  standard normal, an integer input that indexes a stored table through a Gather (token ids) ids in
  [0, rows), any other integer input ones (masks), a bool input True; every dynamic dim 1, but a key/value
  cache's length (``past_sequence_length``, ONNX Runtime GenAI's name, which decoder files use) 0: a prefill
  from an empty cache, so the mask's total length agrees with the new tokens'.
- ``for_run``: the feeds of a run (given or generated) at the file's batch size, with what they are.

Refusals are ``DataRefused`` with one line that names the input.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quantship.errors import DataRefused, one_line
from quantship.inspect.read.inputs import DeclaredInput, declared_inputs

Feed = dict[str, np.ndarray]
Input = DeclaredInput  # the one record of a graph input: name, dtype, dims (None where symbolic)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
GENERATED_BATCHES = 8  # batches generated when no data is given and the caller names no count
CACHE_LENGTH_DIM = "past_sequence_length"  # a key/value cache's length axis (ONNX Runtime GenAI's name): generated 0
# ops an id passes through unchanged on its way to a Gather's indices (a cast, a reshape)
_ID_PRESERVING = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand"}
# a float dtype holds every integer up to 2 ** (mantissa bits + 1) exactly
_EXACT_INT_IN_FLOAT = {np.dtype(np.float16): 2 ** 11, np.dtype(np.float32): 2 ** 24, np.dtype(np.float64): 2 ** 53}


def model_inputs(model: onnx.ModelProto, path: str | Path = "the file") -> list[DeclaredInput]:
    """The inputs a feed provides (initializers listed as inputs excluded), in declared order."""
    return declared_inputs(model, path)


@dataclass(frozen=True)
class Preprocessing:
    """How a folder of images becomes model input."""

    resize: int = 256
    crop: int = 224
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD

    def describe(self) -> str:
        return f"resize {self.resize}, centre crop {self.crop}, normalise mean {self.mean} std {self.std}"


@dataclass(frozen=True)
class Feeds:
    """The batches a run is fed and what they are: ``origin`` "given" or "generated"; ``detail`` says
    how each input was generated (empty for given data)."""

    batches: list[Feed]
    origin: str
    detail: str = ""
    source: str = ""  # where given data came from (a path), when known
    names: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.origin == "generated":
            return f"generated ({self.detail})"
        return f"from {self.source}" if self.source else "given"


def load_images(folder: str | Path, prep: Preprocessing, limit: int) -> np.ndarray:
    """Up to ``limit`` images from a folder (sorted, recursively), preprocessed as ``prep`` states."""
    # late: Pillow loads only when a folder of images is read
    from PIL import Image

    files = sorted(f for f in Path(folder).rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise DataRefused(f"folder {folder} holds no image ({', '.join(sorted(IMAGE_SUFFIXES))})")
    mean = np.array(prep.mean, dtype=np.float32).reshape(3, 1, 1)
    std = np.array(prep.std, dtype=np.float32).reshape(3, 1, 1)
    out = []
    for f in files[:limit]:
        try:
            img = Image.open(f).convert("RGB")
        except OSError as exc:
            raise DataRefused(f"cannot read image {f}: {exc}") from None
        w, h = img.size
        scale = prep.resize / min(w, h)
        img = img.resize((max(prep.crop, round(w * scale)), max(prep.crop, round(h * scale))), Image.BILINEAR)
        w, h = img.size
        left, top = (w - prep.crop) // 2, (h - prep.crop) // 2
        img = img.crop((left, top, left + prep.crop, top + prep.crop))
        arr = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0
        out.append((arr - mean) / std)
    # numpy keeps the HWC layout of each image through the transpose and the stack: a channels-last
    # array (and a different exported graph); the model input is N x C x H x W in C order
    return np.ascontiguousarray(np.stack(out))


def _cast(array: Any, spec: DeclaredInput, source: str) -> np.ndarray:
    """``array`` in ``spec``'s dtype when the cast keeps every value; refused (naming the input) otherwise."""
    if hasattr(array, "detach"):  # a torch tensor, read through its own methods
        array = array.detach().cpu().numpy()
    if not isinstance(array, np.ndarray):
        raise DataRefused(f"{source}: the data for input {spec.name!r} is a {type(array).__name__}, not a numpy "
                          "array")
    have, want = array.dtype, spec.dtype
    if have.kind not in "fiub":
        raise DataRefused(f"{source}: input {spec.name!r} is declared {want}, but the data holds {have} values")
    head = f"{source}: input {spec.name!r} is declared {want}"
    if have.kind == "f" and array.size:
        bad = ~np.isfinite(array)
        if bad.any():
            raise DataRefused(f"{source}: the data for input {spec.name!r} holds {int(bad.sum())} NaN or infinite "
                              "value(s); clean it first")
    if want.kind == "f":
        if have.kind == "b":
            raise DataRefused(f"{head}, but the data holds booleans; give float values")
        if have.kind in "iu" and array.size:
            bound = _EXACT_INT_IN_FLOAT.get(want, 2 ** 11)
            if max(abs(int(array.min())), abs(int(array.max()))) > bound:
                raise DataRefused(f"{head}, but the data holds integers up to {int(np.abs(array).max())}, beyond what "
                                  f"{want} holds exactly ({bound}); give float values")
        out = array.astype(want, copy=False)
        if not np.isfinite(out).all():
            raise DataRefused(f"{source}: the data for input {spec.name!r} overflows {want} (values up to "
                              f"{float(np.abs(array).max()):.3g})")
        return out
    if want.kind in "iu":
        if have.kind == "f" and array.size:
            fractional = array != np.round(array)
            if fractional.any():
                example = array[fractional].flat[0]
                raise DataRefused(f"{head} (integers: token ids, masks), but the data holds {int(fractional.sum())} "
                                  f"value(s) with a fraction (e.g. {example:g}); give whole numbers "
                                  f"(e.g. np.rint(a).astype(np.{want}))")
        info = np.iinfo(want)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise DataRefused(f"{source}: the data for input {spec.name!r} spans [{array.min():g}, {array.max():g}], "
                              f"outside {want}")
        return array.astype(want, copy=False)
    if want.kind == "b":
        if have.kind != "b" and array.size and not np.isin(array, (0, 1)).all():
            raise DataRefused(f"{head}, but the data holds values other than 0 and 1 ({have}); give booleans")
        return array.astype(want, copy=False)
    raise DataRefused(f"{head}, which quantship cannot feed")


def _check_shape(array: np.ndarray, spec: DeclaredInput, source: str) -> None:
    if array.ndim != len(spec.dims):
        raise DataRefused(f"{source}: the file declares input {spec.name!r} as {spec.describe()} (rank "
                          f"{len(spec.dims)}), but the data has shape {list(array.shape)} (rank {array.ndim})")
    if array.shape[0] == 0:
        raise DataRefused(f"{source}: the data for input {spec.name!r} is empty")
    wrong = [(i, d, s) for i, (d, s) in enumerate(zip(spec.dims, array.shape)) if i and d is not None and d != s]
    if wrong:
        i, d, s = wrong[0]
        raise DataRefused(f"{source}: the file declares input {spec.name!r} as {spec.describe()}, but the data "
                          f"has shape {list(array.shape)} (dimension {i} is {s}, not {d})")


def fixed_batch(inputs: Sequence[DeclaredInput]) -> int | None:
    """The batch the file serves when its inputs fix their first dim (None: a dynamic batch)."""
    fixed = {spec.dims[0] for spec in inputs if spec.dims and spec.dims[0] is not None}
    return fixed.pop() if len(fixed) == 1 else None


def cut(inputs: Sequence[DeclaredInput], arrays: Mapping[str, Any], *, batch_size: int, max_samples: int,
        source: str = "calibration data") -> list[Feed]:
    """Whole-dataset arrays (one per input, samples on axis 0) checked and cut into batches.

    A shorter last batch is kept; a file with a fixed batch dim is fed whole batches of that size only.
    """
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
    fixed = fixed_batch(inputs)
    if fixed:
        batch_size = fixed  # the file serves one batch size only
        n = (n // batch_size) * batch_size
        if n == 0:
            raise DataRefused(f"{source}: the file's batch dimension is fixed at {batch_size}, and the data holds "
                              "fewer samples than that")
    return [{k: np.ascontiguousarray(v[start:min(start + batch_size, n)]) for k, v in checked.items()}
            for start in range(0, n, batch_size)]


def _batch_dict(batch: Any, inputs: Sequence[DeclaredInput]) -> dict[str, Any]:
    if isinstance(batch, Mapping):
        return dict(batch)
    if isinstance(batch, (tuple, list)) and len(inputs) > 1 and len(batch) == len(inputs):
        return {spec.name: v for spec, v in zip(inputs, batch)}
    x = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 1 else batch
    if len(inputs) != 1:
        raise DataRefused(f"the file has {len(inputs)} inputs {[i.name for i in inputs]}: give each batch as a "
                          "dict {input name: array}")
    if not (isinstance(x, np.ndarray) or hasattr(x, "detach")):
        raise DataRefused(f"a batch is a {type(x).__name__}: give a numpy array, a torch tensor, or a dict "
                          "{input name: array}")
    return {inputs[0].name: x}


def is_one_batch(data: Any) -> bool:
    """``data`` is a single array, tensor or dict (not a list of batches)."""
    return isinstance(data, (np.ndarray, Mapping)) or hasattr(data, "detach")


def as_feeds(data: Any, inputs: Sequence[DeclaredInput], what: str = "calibration batch") -> list[Feed]:
    """The library's data argument as checked feeds: an array or tensor (one input), a dict of arrays
    (one per input name), a tuple of one array per input (in the file's order), or a list of any of
    these (each a batch)."""
    positional = (isinstance(data, tuple) and len(inputs) > 1 and len(data) == len(inputs)
                  and all(isinstance(x, np.ndarray) or hasattr(x, "detach") for x in data))
    try:
        raw = [data] if is_one_batch(data) or positional else list(data)
    except TypeError:
        raise DataRefused(f"the data is a {type(data).__name__}: give an array, a dict {{input name: array}}, or a "
                          "list of them (one per batch)") from None
    if not raw:
        raise DataRefused(f"no {what}: give at least one")
    out = []
    for i, batch in enumerate(raw):
        arrays = _batch_dict(batch, inputs)
        first = next(iter(arrays.values()), None)
        size = int(getattr(first, "shape", (1,))[0]) if getattr(first, "shape", ()) else 1
        out.extend(cut(inputs, arrays, batch_size=size or 1, max_samples=1 << 62, source=f"{what} {i}"))
    return out


def _archive_arrays(path: str, inputs: Sequence[DeclaredInput], key: str | None) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        names = list(archive.keys())
        wanted = [i.name for i in inputs]
        if key is not None:
            if key not in names:
                raise DataRefused(f"{path} holds no array {key!r}; it holds {names}")
            if len(inputs) != 1:
                raise DataRefused(f"--key picks one array, but the file has {len(inputs)} inputs {wanted}: key the "
                                  ".npz by input name and drop --key")
            return {wanted[0]: archive[key]}
        if all(n in names for n in wanted):
            return {n: archive[n] for n in wanted}
        if len(inputs) == 1 and len(names) == 1:
            return {wanted[0]: archive[names[0]]}
        raise DataRefused(f"{path} holds arrays {names}; the file's inputs are {wanted}: key the arrays by input "
                          "name" + (" (or pick one with --key)" if len(inputs) == 1 else ""))


def read_data(path: str | Path, inputs: Sequence[DeclaredInput], *, key: str | None = None,
              preprocessing: Preprocessing | None = None, limit: int = 1 << 62,
              what: str = "data") -> dict[str, np.ndarray]:
    """``.npy`` / ``.npz`` / image-folder data as one whole array per input name (not yet checked: ``cut``)."""
    p = Path(path)
    if not p.exists():
        raise DataRefused(f"{what} {path} does not exist")
    if p.is_dir():
        spec = inputs[0]
        if len(inputs) != 1 or spec.dtype.kind != "f" or len(spec.dims) != 4:
            raise DataRefused(f"{what} {path} is an image folder, but the file's inputs are "
                              f"{[f'{i.name}: {i.describe()}' for i in inputs]}; image folders feed one N x C x H x W "
                              "float input: give a .npz keyed by input name")
        return {spec.name: load_images(p, preprocessing or Preprocessing(), limit)}
    try:
        if p.suffix == ".npy":
            if len(inputs) != 1:
                raise DataRefused(f"{path}: the file has {len(inputs)} inputs {[i.name for i in inputs]}; give a "
                                  ".npz with one array per input name")
            return {inputs[0].name: np.load(p, allow_pickle=False)}
        if p.suffix == ".npz":
            return _archive_arrays(str(p), inputs, key)
    except DataRefused:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DataRefused(f"cannot read {path} as a numpy array (empty or truncated?): {one_line(exc)}") from None
    raise DataRefused(f"{what} {path}: use a .npy, a .npz keyed by input name, or a folder of images")


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in model.graph.node for out in node.output}


def _table_rows(model: onnx.ModelProto, name: str, producers: dict[str, onnx.NodeProto], axis: int) -> int | None:
    """Rows (along ``axis``) of the stored table behind ``name``: an initializer, a Constant, or either
    through a DequantizeLinear / Cast / Identity (a table quantize-onnx stored in 8 bits), or a Reshape that
    keeps axis 0 (``[rows, -1]``: a table whose packed codes a tied head's MatMulNBits holds)."""
    stored = {t.name: t for t in model.graph.initializer}
    for _ in range(8):
        if name in stored:
            dims = list(stored[name].dims)
            return int(dims[axis]) if dims and -len(dims) <= axis < len(dims) else None
        node = producers.get(name)
        if node is None:
            return None
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            dims = list(value.dims) if value is not None else []
            return int(dims[axis]) if dims and -len(dims) <= axis < len(dims) else None
        if node.op_type == "Reshape" and axis == 0 and len(node.input) > 1 and node.input[1] in stored:
            target = onnx.numpy_helper.to_array(stored[node.input[1]]).reshape(-1)
            rows = _table_rows(model, node.input[0], producers, 0)
            return rows if rows is not None and len(target) and int(target[0]) in (rows, 0) else None
        if node.op_type not in ("DequantizeLinear", "Cast", "Identity"):
            return None
        name = node.input[0]
    return None


def id_ranges(model: onnx.ModelProto) -> dict[str, tuple[int, str]]:
    """Integer graph inputs that index a stored table through a Gather (token ids): input name ->
    (rows of the smallest such table, its name)."""
    producers = _producers(model)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    found: dict[str, tuple[int, str]] = {}
    for value in model.graph.input:
        frontier, seen = [value.name], set()
        while frontier:
            tensor = frontier.pop()
            if tensor in seen:
                continue
            seen.add(tensor)
            for node in consumers.get(tensor, []):
                if node.op_type in ("Gather", "GatherBlockQuantized") and len(node.input) > 1 \
                        and node.input[1] == tensor:  # GatherBlockQuantized: a table stored blocked (com.microsoft)
                    axis = next((a.i for a in node.attribute if a.name in ("axis", "gather_axis")), 0)
                    rows = _table_rows(model, node.input[0], producers, axis)
                    if rows and (value.name not in found or rows < found[value.name][0]):
                        found[value.name] = (rows, node.input[0])
                elif node.op_type in _ID_PRESERVING and node.input and node.input[0] == tensor:
                    frontier.extend(node.output)
    return found


def generated(model: onnx.ModelProto, n: int = GENERATED_BATCHES, seed: int = 0,
              inputs: Sequence[DeclaredInput] | None = None) -> Feeds:
    """``n`` seeded feeds of each input's dtype and range (see the module docstring), every dynamic dim 1 (a cache
    length 0)."""
    if n < 1:
        raise DataRefused(f"n={n}: generate at least one batch")
    specs = list(inputs) if inputs is not None else model_inputs(model)
    ids = id_ranges(model)
    rng = np.random.default_rng(seed)
    how: dict[str, str] = {}
    for spec in specs:
        if spec.dtype.kind == "f":
            how[spec.name] = "standard normal"
        elif spec.dtype.kind in "iu" and spec.name in ids:
            how[spec.name] = f"ids in [0, {ids[spec.name][0]})"
        elif spec.dtype.kind in "iu":
            how[spec.name] = "ones"
        elif spec.dtype.kind == "b":
            how[spec.name] = "True"
        else:
            raise DataRefused(f"input {spec.name!r} is {spec.dtype}: quantship cannot generate data for it; give data")
    dim_names = {v.name: [d.dim_param for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    batches = []
    for _ in range(n):
        feed = {}
        for spec in specs:
            names = dim_names.get(spec.name, [])
            shape = [0 if d is None and i < len(names) and names[i] == CACHE_LENGTH_DIM else d or 1
                     for i, d in enumerate(spec.dims)]
            if spec.dtype.kind == "f":
                feed[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
            elif spec.name in ids:
                feed[spec.name] = rng.integers(0, ids[spec.name][0], shape).astype(spec.dtype)
            else:
                feed[spec.name] = np.ones(shape, spec.dtype)
        batches.append(feed)
    detail = "seeded; " + ", ".join(f"{name}: {what}" for name, what in how.items())
    return Feeds(batches, "generated", detail, names=[s.name for s in specs])


def for_run(model: onnx.ModelProto, data: Any = None, *, n: int = 20, seed: int = 0, key: str | None = None,
            preprocessing: Preprocessing | None = None, path: str | Path = "the file") -> Feeds:
    """At most ``n`` batches at the file's batch size (its fixed batch, else 1) for running the file.

    ``data``: None (generated), a path (``read_data``), whole arrays (an array or tensor for a
    single-input file, a dict by input name; cut here), or a list of batches (``as_feeds``, used as given).
    """
    inputs = model_inputs(model, path)
    if data is None:
        return generated(model, n, seed, inputs)
    batch = fixed_batch(inputs) or 1
    source = ""
    if isinstance(data, (str, Path)):
        source = str(data)
        data = read_data(data, inputs, key=key, preprocessing=preprocessing, limit=n * batch)
    if is_one_batch(data):
        arrays = _batch_dict(data, inputs)
        batches = cut(inputs, arrays, batch_size=batch, max_samples=n * batch, source=source or "the inputs")
    else:
        checked = as_feeds(data, inputs, "batch")
        if all(len({f[s.name].shape[1:] for f in checked}) == 1 for s in inputs):  # one sample shape: re-cut
            whole = {s.name: np.concatenate([f[s.name] for f in checked]) for s in inputs}
            batches = cut(inputs, whole, batch_size=batch, max_samples=n * batch, source="the inputs")
        else:
            batches = checked[:n]
    return Feeds(batches, "given", source=source, names=[s.name for s in inputs])
