"""Calibration: the float model run in ONNX Runtime with its intermediate tensors exposed.

``probe`` runs one sample with every tensor exposed: the dtype and shape of each (what symbolic
shape inference could not tell on the Paddle and YOLO files comes from this run). ``observe`` runs
the calibration batches with the tensors to quantize exposed, feeding quantship's activation
observers (the PyTorch path's, through ``torch.from_numpy``) one batch at a time, and twice when an observer
keeps a histogram, as the PyTorch path calibrates (``quantize.calibration.run_batches``): the first pass finds
each tensor's exact range, the second counts every batch on bins over that range, so the ranges do not
depend on how the calibration data is batched or sliced (a per-batch sample and a histogram re-binned
whenever a batch widened its range made them depend on it: docs/fidelity.md has nudenet's figures). A batch whose
exposed tensors would exceed the budget (``MEMORY_BUDGET``, or what ``--max-memory`` leaves) is run in
shorter slices, and tensors whose one sample together exceeds it are exposed a group at a time (one session
per group), so memory stays bounded whatever the batch size and the number of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from quantship.calibration import counted_sample
from quantship.inspect.run.consumers import session_of
from quantship.quantize_onnx.memory import MEMORY_BUDGET  # bytes of exposed tensors held at once

QMIN, QMAX = -128, 127  # observers work in int8, as the PyTorch path's do; uint8 is the same scale, z + 128


@dataclass(frozen=True)
class TensorInfo:
    """What the probe run saw of one tensor (for one sample)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    rows: int = 1  # samples the probe ran

    @property
    def bytes_per_sample(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize // max(self.rows, 1)


Feed = dict[str, np.ndarray]


def exposing_session(model: onnx.ModelProto, exposed: Sequence[str], base_dir: str | Path | None = None):
    """An ONNX Runtime session of ``model`` with every tensor of ``exposed`` also a graph output, read literally.

    The outputs are added to ``model`` for the session's creation and removed after it (no copy of the
    weights: ``model`` is as it was when this returns or raises). ``base_dir``: where ``model``'s external
    tensors live (ONNX Runtime maps them from there)."""
    import onnxruntime as ort

    outputs = model.graph.output
    n_declared = len(outputs)
    present = {o.name for o in outputs}
    outputs.extend(onnx.ValueInfoProto(name=name) for name in dict.fromkeys(exposed) if name not in present)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # basic level: constant folding and redundant-node removal only; no fusion touches an exposed tensor
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    try:
        return session_of(model, options, base_dir)
    finally:
        del outputs[n_declared:]


def _first_sample(feed: Feed) -> Feed:
    return {k: v[:1] for k, v in feed.items()}


def probe(model: onnx.ModelProto, feed: Feed, *, one_sample: bool = True,
          base_dir: str | Path | None = None) -> dict[str, TensorInfo]:
    """Dtype and shape of every node output (and input), read off one run of one sample (of the whole
    batch when the file's batch dimension is fixed: ``one_sample=False``)."""
    names = [o for n in model.graph.node for o in n.output if o]
    session = exposing_session(model, names, base_dir)
    wanted = [o.name for o in session.get_outputs()]
    fed = _first_sample(feed) if one_sample else feed
    outs = session.run(wanted, fed)
    rows = len(next(iter(fed.values())))
    info = {name: TensorInfo(np.asarray(v).dtype, tuple(np.shape(v)), rows) for name, v in zip(wanted, outs)}
    for name, value in fed.items():
        info[name] = TensorInfo(value.dtype, tuple(value.shape), rows)
    return info


class TensorObserver:
    """One activation observer (the PyTorch path's range rule) for one tensor, plus what the rule
    does not track: the exact min/max and whether every value seen was an integer. Called on every
    batch (the first pass); an observer that keeps a histogram (``counts``) then gets ``on_range`` and
    ``count`` on every batch again (the second pass)."""

    def __init__(self, make, qscheme) -> None:
        import torch

        self.observer = make(dtype=torch.int8, quant_min=QMIN, quant_max=QMAX, qscheme=qscheme)
        self.counts = isinstance(getattr(self.observer, "histogram", None), torch.Tensor)
        self.integral = True  # every value seen is an integer: scale 1 represents them exactly
        self.low, self.high = np.inf, -np.inf

    def __call__(self, array: np.ndarray) -> None:
        import torch

        finite = _finite(array)
        if finite.size == 0:
            return
        self.low, self.high = min(self.low, float(finite.min())), max(self.high, float(finite.max()))
        if self.integral:
            self.integral = bool(np.all(finite == np.round(finite)))
        if not self.counts:
            self.observer(torch.from_numpy(finite))

    def on_range(self) -> None:
        """Between the passes: the histogram's range set to the exact one seen, its counts emptied (a batch
        inside the range then adds its counts on the same bins; torchao's observer re-bins only when a
        batch widens it)."""
        if self.counts and self.low != np.inf:
            self.observer.min_val.fill_(self.low)
            self.observer.max_val.fill_(self.high)
            self.observer.histogram.zero_()

    def count(self, array: np.ndarray) -> None:
        """The second pass: ``array``'s values (``calibration.counted_sample``: a strided sample of each of its
        samples, the PyTorch path's rule too) counted."""
        import torch

        if self.counts and self.low != np.inf:
            finite = _finite(array)
            if finite.size:
                self.observer(torch.from_numpy(np.ascontiguousarray(counted_sample(finite, array.shape))))

    def qparams(self, symmetric: bool) -> tuple[float, int]:
        """(scale, int8 zero-point) from the observer's range rule; integer-valued tensors that fit
        the int8 grid at scale 1 keep it (shape arithmetic and one-hot codes stay exact)."""
        if self.low == np.inf:
            return 1.0, 0
        if self.integral:
            if symmetric and max(-self.low, self.high) <= QMAX:
                return 1.0, 0
            low, high = min(self.low, 0.0), max(self.high, 0.0)  # the grid holds 0 exactly
            if not symmetric and high - low <= QMAX - QMIN:
                return 1.0, int(QMIN - low)
        scale, zero = self.observer.calculate_qparams()
        return _checked(float(scale.reshape(-1)[0]), int(zero.reshape(-1)[0]))

    def clipping_range(self, symmetric: bool) -> tuple[float, float]:
        """The range the observer's qparams represent (what a shared scale must cover for this tensor)."""
        scale, zero = self.qparams(symmetric)
        return (QMIN - zero) * scale, (QMAX - zero) * scale


def _finite(array: np.ndarray) -> np.ndarray:
    """``array`` as contiguous float32, its infinite and NaN values left out (flattened when any is)."""
    x = np.ascontiguousarray(array, dtype=np.float32)
    ok = np.isfinite(x)
    return x if ok.all() else x[ok]


def _checked(scale: float, zero: int) -> tuple[float, int]:
    if not np.isfinite(scale) or scale < np.finfo(np.float32).tiny:
        return 1.0, 0
    return scale, zero


def shared_qparams(members: Sequence[TensorObserver], symmetric: bool) -> tuple[float, int]:
    """One (scale, zero-point) for tensors that must share it: the union of their clipping ranges,
    turned into qparams by the first member's observer formula."""
    import torch

    if len(members) == 1:
        return members[0].qparams(symmetric)
    seen = [m for m in members if m.low != np.inf]
    if not seen:
        return 1.0, 0
    if all(m.integral for m in seen):
        merged = TensorObserver.__new__(TensorObserver)
        merged.integral, merged.observer = True, seen[0].observer
        merged.low, merged.high = min(m.low for m in seen), max(m.high for m in seen)
        scale, zero = merged.qparams(symmetric)
        if scale == 1.0:
            return scale, zero
    ranges = [m.clipping_range(symmetric) for m in seen]
    low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
    scale, zero = seen[0].observer._calculate_qparams(torch.tensor([low]), torch.tensor([high]))
    return _checked(float(scale.reshape(-1)[0]), int(zero.reshape(-1)[0]))


def observer_factory(name: str):
    """The observer class for an ``act_observer`` name: the PyTorch path's table, not a second one."""

    from quantship.quantize.annotator import activation_observer  # torchao's observers: loaded to calibrate

    return activation_observer(name)


def tensor_groups(names: Sequence[str], info: dict[str, TensorInfo], budget: int) -> list[list[str]]:
    """``names`` in order, cut into groups whose exposed bytes for one sample fit ``budget`` (a tensor larger
    than the budget alone is a group of its own)."""
    groups: list[list[str]] = []
    held = 0
    for name in names:
        size = info[name].bytes_per_sample if name in info else 0
        if not groups or held + size > budget:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += size
    return groups


def observe(model: onnx.ModelProto, batches: Sequence[Feed], tensors: Sequence[str], info: dict[str, TensorInfo],
            *, observer: str, symmetric: bool, budget: int = MEMORY_BUDGET,
            base_dir: str | Path | None = None) -> dict[str, TensorObserver]:
    """Run every batch with ``tensors`` exposed, at most ``budget`` bytes of them held at once; one
    ``TensorObserver`` per tensor. ``base_dir``: where ``model``'s external tensors live."""
    import torch

    qscheme = torch.per_tensor_symmetric if symmetric else torch.per_tensor_affine
    make = observer_factory(observer)
    observers = {name: TensorObserver(make, qscheme) for name in tensors}
    computed = [name for name in tensors if name not in batches[0]]
    groups = tensor_groups(computed, info, budget) if computed else []
    _run(model, batches, groups, info, budget, base_dir, {n: o.__call__ for n, o in observers.items()})
    counting = {n: o for n, o in observers.items() if o.counts and o.low != np.inf}
    if counting:  # the second pass, on the exact ranges (module docstring)
        for o in counting.values():
            o.on_range()
        kept = [[n for n in g if n in counting] for g in groups]
        _run(model, batches, [g for g in kept if g], info, budget, base_dir, {n: o.count for n, o in counting.items()})
    return observers


def _run(model: onnx.ModelProto, batches: Sequence[Feed], groups: list[list[str]], info: dict[str, TensorInfo],
         budget: int, base_dir: str | Path | None, record: dict) -> None:
    """Every batch's value of each tensor in ``record`` handed to its function: fed tensors from the
    batches, computed ones a group at a time (one session each), a batch in slices of at most ``budget``
    exposed bytes."""
    for feed in batches:
        for name, value in feed.items():
            if name in record:
                record[name](value)
    for group in groups:
        session = exposing_session(model, group, base_dir)
        per_sample = sum(info[n].bytes_per_sample for n in group if n in info) or 1
        rows = max(1, budget // per_sample)
        for feed in batches:
            n = len(next(iter(feed.values())))
            for start in range(0, n, rows):
                part = {k: v[start:start + rows] for k, v in feed.items()}
                outs = session.run(group, part)
                for name, value in zip(group, outs):
                    record[name](value)
                del outs
        del session
