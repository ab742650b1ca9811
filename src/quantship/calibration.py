"""Calibration data, read one way on every path: ``Quantizer`` (pt2e, FX, torchao), distributed
calibration, the command line, and the ONNX quantizer.

A leaf: it needs numpy and ``quantship.errors`` only (torch tensors are read through their own
methods, never imported here), so the ONNX path reads through it without importing torch.

API
- A *batch* is one array with a leading batch dimension (a numpy array or a torch tensor), or a
  dict ``{input name: array}`` whose arrays share that leading dimension (a model with several
  inputs). ``n_samples(batch)`` is that dimension, ``sample_shape(batch)`` the rest, and
  ``total_samples(batches)`` the sum.
- The cap, one for every path: ``max_samples``, a positive int (``check_max_samples``); at most that
  many samples are ever read.
  - ``take(batches, max_samples)``: batches in order, whole, until the next one would pass the cap;
    a first batch larger than the cap is refused (batches are never cut). The iterable is consumed
    lazily and never past the cap.
  - ``split(data, batch_size, max_samples, keep_last=False)``: the first ``min(N, max_samples)``
    samples of an array (or a dict of arrays) cut into C-contiguous batches of ``batch_size``.
    ``keep_last`` keeps a shorter last batch (a symbolic-batch capture takes it); otherwise only
    whole batches are used.
- ``as_numpy(batch)``: the batch as float32 numpy arrays (a dict stays a dict), e.g. the feed of an
  ONNX Runtime ``CalibrationDataReader``.
- ``counted_sample(x, shape)``: what a histogram observer counts of one activation tensor in the second
  calibration pass, on both paths (a numpy array or a torch tensor, read through its own methods).

Refusals are ``DataRefused`` (a ``ValueError``) naming the argument (``cap_name``/``batch_size_name``
let each caller use its own spelling: ``max_calibration_samples``, ``--max-samples``, ``--batch-size``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from quantship.errors import DataRefused

OBSERVED_PER_SAMPLE = 1 << 16  # values of one sample of a tensor a histogram counts (an even stride through it)


def _first_array(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        if not batch:
            raise DataRefused("a calibration batch is an empty dict; give {input name: array}")
        return next(iter(batch.values()))
    return batch


def n_samples(batch: Any) -> int:
    """The batch's leading dimension (of its first array, for a dict)."""
    shape = tuple(getattr(_first_array(batch), "shape", ()))
    if not shape:
        raise DataRefused("a calibration batch has no leading batch dimension (a 0-d value)")
    return int(shape[0])


def sample_shape(batch: Any) -> tuple[int, ...]:
    """The shape of one sample of the batch (of its first array, for a dict)."""
    return tuple(int(d) for d in getattr(_first_array(batch), "shape", ())[1:])


def total_samples(batches: Iterable[Any]) -> int:
    return sum(n_samples(b) for b in batches)


def check_max_samples(max_samples: Any, cap_name: str = "max_samples") -> int:
    """The cap, refused unless it is a positive int."""
    if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1:
        raise DataRefused(f"{cap_name}={max_samples!r} must be a positive integer")
    return max_samples


def take(batches: Iterable[Any], max_samples: int, *, cap_name: str = "max_samples") -> Iterator[Any]:
    """Whole batches in order until the next would pass ``max_samples`` (see the module docstring)."""
    check_max_samples(max_samples, cap_name)
    seen = 0
    for batch in batches:
        n = n_samples(batch)
        if seen and seen + n > max_samples:
            return
        if not seen and n > max_samples:
            raise DataRefused(
                f"the first calibration batch holds {n} samples, more than {cap_name}={max_samples}; raise "
                f"{cap_name} to at least {n} or use smaller batches (batches are never cut)")
        yield batch
        seen += n
        if seen >= max_samples:
            return


def split(data: Any, batch_size: int, max_samples: int, *, keep_last: bool = False,
          batch_size_name: str = "batch_size", cap_name: str = "max_samples") -> list[Any]:
    """Batches of ``batch_size`` from the first ``max_samples`` samples of ``data`` (see the module docstring)."""
    check_max_samples(max_samples, cap_name)
    if batch_size < 1:
        raise DataRefused(f"{batch_size_name} {batch_size} must be at least 1")
    held = n_samples(data)
    n = min(held, max_samples)
    if n < batch_size and not keep_last:
        raise DataRefused(f"calibration data holds {held} sample(s), fewer than {batch_size_name} {batch_size}; "
                          f"give more samples or a smaller {batch_size_name}")
    usable = n if keep_last else (n // batch_size) * batch_size

    def cut(a: Any, lo: int, hi: int) -> Any:
        return np.ascontiguousarray(a[lo:hi])

    out = []
    for lo in range(0, usable, batch_size):
        hi = min(lo + batch_size, usable)
        out.append({k: cut(v, lo, hi) for k, v in data.items()} if isinstance(data, Mapping) else cut(data, lo, hi))
    return out


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, read through its own methods
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def as_numpy(batch: Any) -> np.ndarray | dict[str, np.ndarray]:
    """The batch as float32 numpy arrays; a dict keeps its names."""
    if isinstance(batch, Mapping):
        return {str(k): _to_numpy(v) for k, v in batch.items()}
    return _to_numpy(batch)


def counted_sample(x: Any, shape: tuple[int, ...]) -> Any:
    """At most ``OBSERVED_PER_SAMPLE`` values of each sample (each index of ``shape``'s first axis) of an
    activation, flattened: an even stride through the sample, the same positions whatever the batch holds,
    so the counts do not depend on the batching. A histogram of a large tensor hardly moves; its cost does.
    One rule for both paths, so one model calibrated on either counts the same values. ``x`` no longer of
    ``shape`` (its non-finite values dropped) is strided whole."""
    size = int(np.prod(shape)) if shape else 1
    whole = int(np.prod(x.shape)) if len(x.shape) else 1
    rows = shape[0] if len(shape) > 1 and whole == size and shape[0] else 1
    per_row = whole // rows
    if per_row <= OBSERVED_PER_SAMPLE:
        return x.reshape(-1)
    step = -(-per_row // OBSERVED_PER_SAMPLE)
    return x.reshape(rows, per_row)[:, ::step].reshape(-1)
