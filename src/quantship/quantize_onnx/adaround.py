"""AdaRound (Nagel et al. 2020, "Up or Down? Adaptive Rounding for Post-Training Quantization"): each
weight of a layer rounded up or down as learned on the calibration data, not to the nearest integer.

Per layer, with its scale fixed: every weight w/s = floor + rest gets a continuous variable V whose
rectified sigmoid h(V) (stretched to [-0.1, 1.1], clipped to [0, 1]) starts at ``rest`` (nearest-like)
and is learned with Adam by torch autograd on CPU to minimise the layer output's squared error against
the float model's output of that layer (its inputs the quantized model's, earlier layers already
rounded: ``weight_layers.sequential``), plus a regulariser sum(1 - |2h - 1|^beta) that pushes each h to
0 or 1, its beta annealed from ``BETA_START`` to ``BETA_END`` after a warm-up without it. After
``iterations`` steps each weight is rounded up where h(V) >= 0.5, down elsewhere. A layer whose learned
rounding does not beat nearest rounding on all its calibration samples keeps nearest rounding.
Only the integer weights change: the scales, the bias and the graph stay as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from quantship.errors import SpecRefused
from quantship.quantize_onnx import weight_layers
from quantship.quantize_onnx.weight_layers import WeightLayer

ITERATIONS = 300  # Adam steps per layer by default (the paper's 10,000 do not fit 2 cores in minutes)
MAX_ITERATIONS = 100_000
BATCH = 16  # calibration samples per step
LEARNING_RATE = 1e-2
REGULARISATION = 0.01  # lambda
WARM_UP = 0.2  # fraction of the steps without the regulariser
BETA_START, BETA_END = 20.0, 2.0
ZETA, GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch
SEED = 0


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
    """Steps per layer for ``quantize_onnx_file(adaround=...)``: True is ``ITERATIONS``, an int that many
    (0 / False: off); anything else is refused."""
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


def learn(layer: WeightLayer, x: torch.Tensor, target: torch.Tensor, iterations: int, report: AdaRound) -> None:
    """Learn and store ``layer``'s rounding (see the module docstring)."""
    w = torch.from_numpy(layer.weight)
    nearest, scale = weight_layers.integers_and_scale(layer)
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
        out = weight_layers.activate(layer, weight_layers.forward(layer, x[rows], soft))
        loss = ((out - weight_layers.activate(layer, target[rows])) ** 2).sum(dim=out_axis).mean()
        if step >= warm:
            progress = (step - warm) / max(iterations - warm - 1, 1)
            beta = BETA_END + 0.5 * (BETA_START - BETA_END) * (1 + math.cos(math.pi * progress))
            loss = loss + REGULARISATION * (1 - (2 * h - 1).abs().pow(beta)).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        learned = torch.clamp(floor + (v >= 0).float(), -layer.bound, layer.bound)
    before = float(weight_layers.channel_errors(layer, x, nearest * scale, target).sum())
    after = float(weight_layers.channel_errors(layer, x, learned * scale, target).sum())
    report.n_layers += 1
    report.n_weights += int(nearest.numel())
    report.error_before += before
    if after < before:
        weight_layers.write(layer, learned.numpy())
        report.n_flipped += int((learned != nearest).sum())
        report.error_after += after
    else:
        report.n_kept_nearest += 1
        report.error_after += before
