"""Calibration data read from the user's files, for both paths, by the one loader's rules
(``inspect.read.feeds``: ``.npy``, ``.npz`` keyed by input name, image folders; each input in its dtype).

- ``read_held_out``: the calibration batches and the batches fidelity is judged on (``--fidelity-data``,
  else held out of the calibration data by ``split_held_out``), for an ONNX file's declared inputs or a
  PyTorch model's forward arguments (``forward_inputs``).
- ``forward_inputs``: a PyTorch model's inputs as the loader declares them: the forward's argument names,
  each in the dtype its data holds (floats float32, integers int64 token ids and masks, booleans bool;
  uint8 images float32), every dim free.
- ``read_images``: N x C x H x W float32 batches for the commands that take image models only.

Refusals are ``DataRefused``: one line naming the input and the fix. numpy and the loader only (no torch):
the ONNX path reads through here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from quantship import calibration
from quantship.errors import DataRefused
from quantship.fidelity import HELD_OUT_MAX
from quantship.inspect.read.feeds import Feed, Input, Preprocessing, cut, read_data

_READ_ALL = 1 << 62


def split_held_out(arrays: dict[str, Any], max_samples: int, multiple: int = 1, what: str = "--calib"
                   ) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """Calibration arrays and the arrays held out to judge fidelity on: the samples beyond ``max_samples``
    when there are any, else the last fifth (none for fewer than 5 samples); and a line saying which.
    ``multiple``: a file with a fixed batch reads whole batches, so both parts keep whole batches of it."""
    n = len(next(iter(arrays.values())))
    if n > max_samples:
        stop = max_samples + (min(n, max_samples + HELD_OUT_MAX) - max_samples) // multiple * multiple
        if stop > max_samples:
            return ({k: v[:max_samples] for k, v in arrays.items()},
                    {k: v[max_samples:stop] for k, v in arrays.items()},
                    f"{stop - max_samples} {what} sample(s) beyond --max-samples")
    k = min(HELD_OUT_MAX, n // 5) // multiple * multiple
    if n < 5 or not k or (n - k) < multiple:
        return arrays, None, f"none held out (too few {what} samples: judged in-sample)"
    return ({name: v[:n - k] for name, v in arrays.items()}, {name: v[n - k:] for name, v in arrays.items()},
            f"the last {k} of {n} {what} samples, held out from calibration")


def read_held_out(calib: str, inputs: Sequence[Input], *, batch_size: int, max_samples: int, key: str | None = None,
                  preprocessing: Preprocessing | None = None, fidelity_data: str | None = None, judged: bool = True,
                  multiple: int = 1, declare: Callable[[dict], list[Input]] | None = None
                  ) -> tuple[list[Feed], list[Feed] | None, str]:
    """Checked calibration batches, the batches fidelity is judged on (None: none) and a line saying which.

    ``fidelity_data``: those are read from it; else, when ``judged``, held out of ``calib``
    (``split_held_out``, whole batches of ``multiple``). ``declare``: the inputs as the arrays read show them
    (a PyTorch model's, ``forward_inputs``); ``inputs`` then only names what to read."""
    def read(path: str, limit: int, what: str) -> tuple[list[Input], dict]:
        arrays = read_data(path, inputs, key=key, preprocessing=preprocessing, limit=limit, what=what)
        return (declare(arrays) if declare else list(inputs)), arrays

    def batches(specs: list[Input], arrays: dict, cap: int, source: str) -> list[Feed]:
        return cut(specs, arrays, batch_size=batch_size, max_samples=cap, source=source)

    if fidelity_data or not judged:
        specs, arrays = read(calib, max_samples, "--calib")
        calibrated = batches(specs, arrays, max_samples, calib)
        if not fidelity_data:
            return calibrated, None, ""
        held_specs, held = read(fidelity_data, _READ_ALL, "--fidelity-data")
        return (calibrated, batches(held_specs, held, _READ_ALL, fidelity_data),
                f"sample(s) of --fidelity-data {fidelity_data}")
    specs, arrays = read(calib, max_samples + HELD_OUT_MAX if Path(calib).is_dir() else _READ_ALL, "--calib")
    kept, held, said = split_held_out(arrays, max_samples, multiple)
    return (batches(specs, kept, max_samples, calib),
            None if held is None else batches(specs, held, _READ_ALL, calib), said)


def forward_arguments(model: Any) -> tuple[list[str], list[str]]:
    """The names of ``model.forward``'s positional arguments: those it requires, and those with a default."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a forward without a readable signature: one input, as torch calls it
        return ["x"], []
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return ([p.name for p in positional if p.default is p.empty],
            [p.name for p in positional if p.default is not p.empty])


def _dtype_for_model(array: np.ndarray) -> np.dtype:
    """The dtype a PyTorch model is fed for data of ``array``'s dtype (``forward_inputs``)."""
    if array.dtype == np.uint8 or array.dtype.kind == "f":
        return np.dtype(np.float32)  # uint8: image pixels
    if array.dtype.kind in "iu":
        return np.dtype(np.int64)  # token ids and masks, as torch's embeddings index
    if array.dtype.kind == "b":
        return np.dtype(np.bool_)
    raise DataRefused(f"the data holds {array.dtype} values; give float, integer or boolean arrays")


def forward_inputs(model: Any, source: str = "--calib", given: Sequence[str] = ()
                   ) -> tuple[list[Input], Callable[[dict], list[Input]]]:
    """What to read for ``model`` (``read_held_out``'s ``inputs``) and how the arrays read declare its inputs.

    An ``.npz`` is keyed by the forward's argument names; every argument without a default must be there,
    one with a default is fed when given (``given``: the names the data holds). A single-input model also
    takes a ``.npy`` or an image folder."""
    required, optional = forward_arguments(model)
    names = required + [n for n in optional if n in given]
    if not names:
        names = optional[:1] or ["x"]
    missing = [n for n in names if n not in given]
    if len(names) > 1 and given and missing:
        raise DataRefused(f"{source}: no array for argument(s) {missing} of {type(model).__name__}.forward"
                          f"{tuple(names)}; it holds {list(given)}: key the .npz by argument name")
    reading = [Input(n, np.dtype(np.float32), (None,) * 4) for n in names]

    def declare(arrays: dict) -> list[Input]:
        missing = [n for n in names if n not in arrays]
        if missing:
            raise DataRefused(f"{source}: no array for argument(s) {missing} of {type(model).__name__}.forward"
                              f"{tuple(names)}; key the .npz by argument name")
        return [Input(n, _dtype_for_model(np.asarray(arrays[n])), (None,) * np.ndim(arrays[n])) for n in names]

    return reading, declare


def npz_keys(path: str) -> list[str]:
    """The array names of an ``.npz`` (empty for anything else)."""
    if Path(path).suffix != ".npz" or not Path(path).is_file():
        return []
    try:
        with np.load(path, allow_pickle=False) as archive:
            return list(archive.keys())
    except (ValueError, OSError, EOFError) as exc:
        raise DataRefused(f"cannot read {path} as a numpy archive: {exc}") from None


def read_images(path: str, *, key: str | None, prep: Preprocessing, batch_size: int, max_samples: int,
                keep_last: bool = False) -> list[np.ndarray]:
    """N x C x H x W float32 batches (finite, channels first) from ``.npy``/``.npz`` or a folder of images."""
    image = Input("images", np.dtype(np.float32), (None,) * 4)
    arrays = read_data(path, [image], key=key, preprocessing=prep, limit=max_samples, what="calibration data")
    shape = np.shape(arrays["images"])
    if len(shape) != 4:
        raise DataRefused(f"calibration array {path} has shape {shape}; expected N x C x H x W (4 dimensions)")
    if shape[-1] in (1, 3) and shape[1] not in (1, 3):
        raise DataRefused(f"calibration array {path} has shape {shape}, which looks channels-last; "
                          "transpose it to N x C x H x W (np.transpose(a, (0, 3, 1, 2)))")
    (array,) = (f["images"] for f in cut([image], arrays, batch_size=max_samples, max_samples=max_samples, source=path))
    return calibration.split(array, batch_size, max_samples, keep_last=keep_last, batch_size_name="--batch-size",
                             cap_name="--max-samples")
