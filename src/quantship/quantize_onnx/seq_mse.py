"""Sequential MSE weight-scale search: each layer's weight scale, per output channel, chosen among
fractions of the absmax scale to minimise the layer's output error on the calibration data.

For every candidate fraction k (``CANDIDATES``, 1.0 down to 0.5: 1.0 is the absmax/bound scale that
nearest rounding uses), the whole weight is rounded at ``k x scale`` and the layer run in torch on its
real inputs (``weight_layers.sequential``: the quantized model's, earlier layers already searched); each
output channel keeps the k whose output is closest, in squared error, to the float model's output of
that layer. A per-tensor weight keeps the k with the least total error. Only the weight's scale and
its integers change: the bias, every activation scale and the graph stay as they are. Since k = 1.0 is
a candidate, no layer's error on the calibration samples can grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from quantship.quantize_onnx import weight_layers
from quantship.quantize_onnx.weight_layers import WeightLayer

CANDIDATES = np.linspace(1.0, 0.5, 20)  # fractions of the absmax scale; ties keep the larger (1.0 first)


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


def rounded(layer: WeightLayer, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Nearest-rounded integers of ``w`` at ``scale`` (shaped to the weight), clipped to the layer's bound."""
    return torch.clamp(torch.round(w / scale), -layer.bound, layer.bound)


def fit_scale(layer: WeightLayer, x: torch.Tensor, target: torch.Tensor, report: SeqMse) -> None:
    """Choose and store ``layer``'s scale per output channel (see the module docstring)."""
    w = torch.from_numpy(layer.weight)
    _, base = weight_layers.integers_and_scale(layer)
    errors = []
    for k in CANDIDATES:
        scale = base * float(k)
        errors.append(weight_layers.channel_errors(layer, x, rounded(layer, w, scale) * scale, target))
    table = torch.stack(errors)  # [candidate, output channel]
    if layer.axis is None:
        best = torch.full((table.shape[1],), int(torch.argmin(table.sum(dim=1))))
    else:
        best = torch.argmin(table, dim=0)
    fraction = torch.from_numpy(CANDIDATES.astype(np.float32))[best]
    channels = table.shape[1] if layer.axis is not None else 1
    new_scale = base * layer.broadcast(fraction if layer.axis is not None else fraction[:1])
    weight_layers.write(layer, rounded(layer, w, new_scale).numpy(), new_scale.numpy())
    report.n_layers += 1
    report.n_channels += channels
    report.n_channels_changed += int((fraction != 1.0).sum()) if layer.axis is not None else int(fraction[0] != 1.0)
    report.smallest_fraction = min(report.smallest_fraction, float(fraction.min()))
    report.error_before += float(table[0].sum())
    report.error_after += float(table.gather(0, best.reshape(1, -1)).sum())

