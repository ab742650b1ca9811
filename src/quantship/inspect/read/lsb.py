"""Errors in units of the output's quantization step (LSB), read off a QDQ file."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from quantship.inspect.read.facts import facts_of

if TYPE_CHECKING:
    from quantship.inspect.read.facts import FileFacts


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


def output_scales(path: str | Path | onnx.ModelProto | FileFacts) -> dict[str, float | None]:
    """For each graph output, the scale of the DequantizeLinear that produces it (None if float).

    Only a per-tensor scale counts: that is the step the output is stored at. Shape-only ops between
    the DequantizeLinear and the output (a final Reshape, Unsqueeze...) keep the values and are looked
    through. Read off ``FileFacts`` (one read of the file).
    """

    return dict(facts_of(path).output_scales)


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
