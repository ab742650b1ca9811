"""Learned and searched weight rounding, in one sequential pass over the quantized layers: the
sequential MSE scale search then AdaRound on each layer, whichever are on (the math both paths share:
``quantize.algorithms.rounding``; here each layer is a ``weight_layers.WeightLayer``, its inputs the quantized
model's, earlier layers already rounded).
Runs after the Q/DQ pairs are written and before bias correction (which then measures the rounded file)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import onnx
import onnx_ir as ir

from quantship.inspect.read.feeds import Feed
from quantship.quantize.algorithms import rounding as rounding_math
from quantship.quantize_onnx import weight_layers
from quantship.quantize_onnx.calibrate import TensorInfo

SAMPLES = weight_layers.SAMPLES  # calibration samples each layer is fitted on


def round_weights(model: ir.Model, float_model: onnx.ModelProto, weighted: Sequence[ir.Node], feeds: Sequence[Feed],
                  info: dict[str, TensorInfo], bound: int, *, seq_mse: bool, adaround_iterations: int
                  ) -> dict[str, dict]:
    """Rewrite the integer weights (and, with ``seq_mse``, the weight scales) of ``weighted`` in place;
    returns each algorithm's record by name."""
    start = time.perf_counter()
    skipped: dict[str, str] = {}
    layers = weight_layers.collect(model, float_model, weighted, bound, skipped)
    samples = min(weight_layers.SAMPLES, sum(len(next(iter(f.values()))) for f in feeds))
    rounder = rounding_math.Rounder(seq_mse, adaround_iterations, samples, start)
    with rounding_math.torch_threads(rounding_math.TORCH_THREADS):
        passes = weight_layers.sequential(model, float_model, layers, feeds, rounder.step, skipped, info) if layers else 0
    return rounder.records(skipped, passes)
