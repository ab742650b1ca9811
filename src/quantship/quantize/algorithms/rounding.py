"""The weight-rounding math both paths share (the ONNX quantizer's ``quantize_onnx.rounding`` and the pt2e
path's ``quantize.rounding``): the sequential MSE weight-scale search and AdaRound, on one layer at a
time, given its real inputs and the float model's output of it. A path supplies the layer as an object
with the ``RoundingLayer`` surface (its float weight, bound, channel axis, its torch computation, and how
its stored integers and scale are read and written).

Sequential MSE: for every candidate fraction k (``CANDIDATES``, 1.0 down to 0.5: 1.0 is the absmax/bound
scale that nearest rounding uses), the whole weight is rounded at ``k x scale`` and the layer run on its
inputs; each output channel keeps the k whose output is closest, in squared error, to the float model's
output of that layer (a per-tensor weight keeps the k with the least total error). Only the weight's scale
and its integers change. Since k = 1.0 is a candidate, no layer's error on the calibration samples grows.

AdaRound (Nagel et al. 2020, "Up or Down? Adaptive Rounding for Post-Training Quantization"): with the
scale fixed, every weight w/s = floor + rest gets a continuous variable V whose rectified sigmoid h(V)
(stretched to [-0.1, 1.1], clipped to [0, 1]) starts at ``rest`` and is learned with Adam to minimise
the layer output's squared error against the float output, plus a regulariser sum(1 - |2h - 1|^beta)
that pushes each h to 0 or 1, its beta annealed from ``BETA_START`` to ``BETA_END`` after a warm-up
without it. After the steps each weight is rounded up where h(V) >= 0.5, down elsewhere. A layer whose
learned rounding does not beat nearest rounding on all its calibration samples keeps nearest rounding.
Only the integer weights change.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from quantship.errors import SpecRefused

ERROR_ROWS = 8  # samples per torch run while measuring a layer's output error
CANDIDATES = np.linspace(1.0, 0.5, 20)  # fractions of the absmax scale; ties keep the larger (1.0 first)

ITERATIONS = 300  # Adam steps per layer by default (the paper's 10,000 do not fit 2 cores in minutes)
MAX_ITERATIONS = 100_000
BATCH = 16  # calibration samples per step
LEARNING_RATE = 1e-2
REGULARISATION = 0.01  # lambda
WARM_UP = 0.2  # fraction of the steps without the regulariser
BETA_START, BETA_END = 20.0, 2.0
ZETA, GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch
SEED = 0
TORCH_THREADS = 1  # the layers are small: with two threads torch's barriers cost 100x on a busy machine (measured)


def along_axis(per_channel: torch.Tensor, ndim: int, axis: int | None) -> torch.Tensor:
    """A per-channel (or scalar) tensor shaped to multiply a weight of ``ndim`` dims along ``axis``
    (None: per tensor, a scalar)."""
    if axis is None:
        return per_channel.reshape(())
    shape = [1] * ndim
    shape[axis] = -1
    return per_channel.reshape(shape)


class RoundingLayer(Protocol):
    """What the math reads of a layer, whichever path it lives in."""

    weight: np.ndarray  # the float weight, as before quantization
    axis: int | None  # the weight's channel axis (None: per tensor)
    bound: int  # integers lie in [-bound, bound]
    relu: bool  # a Relu is its only reader: applied to both sides

    @property
    def out_axis(self) -> int: ...

    def broadcast(self, per_channel: torch.Tensor) -> torch.Tensor: ...

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...

    def integers_and_scale(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write(self, integers: np.ndarray, scale: np.ndarray | None = None) -> None: ...


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def activate(layer: RoundingLayer, y: torch.Tensor) -> torch.Tensor:
    return torch.relu(y) if layer.relu else y


def channel_errors(layer: RoundingLayer, x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum of squared output errors per output channel (float64), over every sample and position."""
    total = None
    with torch.no_grad():
        for start in range(0, len(x), ERROR_ROWS):
            stop = start + ERROR_ROWS
            diff = activate(layer, layer.forward(x[start:stop], w)) - activate(layer, target[start:stop])
            moved = diff.movedim(layer.out_axis, 0).reshape(diff.shape[layer.out_axis], -1)
            part = moved.pow(2).sum(dim=1).double()  # float32 sums of one slice, float64 across slices
            total = part if total is None else total + part
    return total


# -- sequential MSE --

@dataclass
class SeqMse:
    """What the search did: layers searched, channels whose scale moved, the error before and after."""

    n_layers: int = 0
    n_channels: int = 0
    n_channels_changed: int = 0
    smallest_fraction: float = 1.0  # the smallest k any channel kept
    error_before: float = 0.0  # summed squared output error of the searched layers, nearest rounding
    error_after: float = 0.0
    skipped: dict[str, str] = field(default_factory=dict)
    n_passes: int = 0
    samples: int = 0
    inputs: str = "quantized"  # each layer's inputs: the quantized model's, earlier layers already rewritten
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"n_layers": self.n_layers, "n_channels": self.n_channels,
                "n_channels_changed": self.n_channels_changed, "smallest_fraction": round(self.smallest_fraction, 4),
                "error_ratio": self.error_after / self.error_before if self.error_before else 1.0,
                "error_before": self.error_before, "error_after": self.error_after, "skipped": dict(self.skipped),
                "n_passes": self.n_passes, "samples": self.samples, "inputs": self.inputs,
                "seconds": round(self.seconds, 3)}


def rounded(layer: RoundingLayer, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Nearest-rounded integers of ``w`` at ``scale`` (shaped to the weight), clipped to the layer's bound."""
    return torch.clamp(torch.round(w / scale), -layer.bound, layer.bound)


def fit_scale(layer: RoundingLayer, x: torch.Tensor, target: torch.Tensor, report: SeqMse) -> None:
    """Choose and store ``layer``'s scale per output channel (see the module docstring)."""
    w = torch.from_numpy(layer.weight)
    _, base = layer.integers_and_scale()
    errors = []
    for k in CANDIDATES:
        scale = base * float(k)
        errors.append(channel_errors(layer, x, rounded(layer, w, scale) * scale, target))
    table = torch.stack(errors)  # [candidate, output channel]
    if layer.axis is None:
        best = torch.full((table.shape[1],), int(torch.argmin(table.sum(dim=1))))
    else:
        best = torch.argmin(table, dim=0)
    fraction = torch.from_numpy(CANDIDATES.astype(np.float32))[best]
    channels = table.shape[1] if layer.axis is not None else 1
    new_scale = base * layer.broadcast(fraction if layer.axis is not None else fraction[:1])
    layer.write(rounded(layer, w, new_scale).numpy(), new_scale.numpy())
    report.n_layers += 1
    report.n_channels += channels
    report.n_channels_changed += int((fraction != 1.0).sum()) if layer.axis is not None else int(fraction[0] != 1.0)
    report.smallest_fraction = min(report.smallest_fraction, float(fraction.min()))
    report.error_before += float(table[0].sum())
    report.error_after += float(table.gather(0, best.reshape(1, -1)).sum())


# -- AdaRound --

@dataclass
class AdaRound:
    """What AdaRound did: layers learned, weights rounded the other way, the error before and after."""

    iterations: int = ITERATIONS
    n_layers: int = 0
    n_kept_nearest: int = 0  # layers whose learned rounding did not beat nearest rounding
    n_weights: int = 0
    n_flipped: int = 0  # weights rounded the other way from nearest
    error_before: float = 0.0  # summed squared output error of the learned layers, nearest rounding
    error_after: float = 0.0
    skipped: dict[str, str] = field(default_factory=dict)
    n_passes: int = 0
    samples: int = 0
    inputs: str = "quantized"
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"iterations": self.iterations, "n_layers": self.n_layers, "n_kept_nearest": self.n_kept_nearest,
                "n_weights": self.n_weights, "n_flipped": self.n_flipped,
                "error_ratio": self.error_after / self.error_before if self.error_before else 1.0,
                "error_before": self.error_before, "error_after": self.error_after, "skipped": dict(self.skipped),
                "n_passes": self.n_passes, "samples": self.samples, "inputs": self.inputs,
                "seconds": round(self.seconds, 3)}


def iterations_of(adaround: bool | int) -> int:
    """Steps per layer for ``adaround=...``: True is ``ITERATIONS``, an int that many (0 / False: off);
    anything else is refused."""
    if isinstance(adaround, bool):
        return ITERATIONS if adaround else 0
    if not isinstance(adaround, int) or not 0 <= adaround <= MAX_ITERATIONS:
        raise SpecRefused(f"adaround={adaround!r}: give True (the default {ITERATIONS} steps per layer) or a "
                          f"number of steps per layer from 1 to {MAX_ITERATIONS}")
    return adaround


def _h(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def _initial_v(rest: torch.Tensor) -> torch.Tensor:
    """V with h(V) = rest (inside the clip)."""
    p = torch.clamp((rest - GAMMA) / (ZETA - GAMMA), 1e-4, 1 - 1e-4)
    return torch.log(p / (1 - p))


def learn(layer: RoundingLayer, x: torch.Tensor, target: torch.Tensor, iterations: int, report: AdaRound) -> None:
    """Learn and store ``layer``'s rounding (see the module docstring)."""
    w = torch.from_numpy(layer.weight)
    nearest, scale = layer.integers_and_scale()
    floor = torch.floor(w / scale)
    v = _initial_v(w / scale - floor).requires_grad_(True)
    optimizer = torch.optim.Adam([v], lr=LEARNING_RATE)
    generator = torch.Generator().manual_seed(SEED)
    warm = int(WARM_UP * iterations)
    out_axis = layer.out_axis
    for step in range(iterations):
        rows = torch.randint(0, len(x), (min(BATCH, len(x)),), generator=generator)
        h = _h(v)
        soft = scale * torch.clamp(floor + h, -layer.bound, layer.bound)
        out = activate(layer, layer.forward(x[rows], soft))
        loss = ((out - activate(layer, target[rows])) ** 2).sum(dim=out_axis).mean()
        if step >= warm:
            progress = (step - warm) / max(iterations - warm - 1, 1)
            beta = BETA_END + 0.5 * (BETA_START - BETA_END) * (1 + math.cos(math.pi * progress))
            loss = loss + REGULARISATION * (1 - (2 * h - 1).abs().pow(beta)).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        learned = torch.clamp(floor + (v >= 0).float(), -layer.bound, layer.bound)
    before = float(channel_errors(layer, x, nearest * scale, target).sum())
    after = float(channel_errors(layer, x, learned * scale, target).sum())
    report.n_layers += 1
    report.n_weights += int(nearest.numel())
    report.error_before += before
    if after < before:
        layer.write(learned.numpy())
        report.n_flipped += int((learned != nearest).sum())
        report.error_after += after
    else:
        report.n_kept_nearest += 1
        report.error_after += before


class Rounder:
    """The algorithms that are on, run on each layer in turn (seq-MSE, then AdaRound) and timed; both paths'
    sequential passes call ``step`` per layer, then ``records``."""

    def __init__(self, seq_mse: bool, adaround_iterations: int, samples: int, start: float):
        self.searched = SeqMse(samples=samples) if seq_mse else None
        self.learned = AdaRound(iterations=adaround_iterations, samples=samples) if adaround_iterations else None
        self.timings = {"seq_mse": 0.0, "adaround": 0.0}
        self.start = start  # time.perf_counter() when the pass began (its reading counts in each algorithm)

    def step(self, layer: RoundingLayer, x: torch.Tensor, target: torch.Tensor) -> None:
        if self.searched is not None:
            t = time.perf_counter()
            fit_scale(layer, x, target, self.searched)
            self.timings["seq_mse"] += time.perf_counter() - t
        if self.learned is not None:
            t = time.perf_counter()
            with torch.enable_grad():
                learn(layer, x, target, self.learned.iterations, self.learned)
            self.timings["adaround"] += time.perf_counter() - t

    def records(self, skipped: dict[str, str], passes: int) -> dict[str, dict]:
        """Each algorithm's record by name; the shared pass that reads the layers' inputs counts in each."""
        reading = time.perf_counter() - self.start - self.timings["seq_mse"] - self.timings["adaround"]
        done: dict[str, dict] = {}
        for name, report in (("seq_mse", self.searched), ("adaround", self.learned)):
            if report is not None:
                report.skipped, report.n_passes = dict(skipped), passes
                report.seconds = self.timings[name] + reading
                done[name] = report.as_dict()
        return done
