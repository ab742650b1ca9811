"""Learned and searched weight rounding, in one sequential pass over the quantized layers: the
sequential MSE scale search then AdaRound on each layer, whichever are on (the math both paths share:
``quantize.weight_rounding``; here each layer is a ``weight_layers.WeightLayer``, its inputs the quantized
model's, earlier layers already rounded).
Runs after the Q/DQ pairs are written and before bias correction (which then measures the rounded file)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import onnx
import onnx_ir as ir

from quantship.quantize import weight_rounding as rounding_math
from quantship.quantize_onnx import weight_layers
from quantship.quantize_onnx.calibrate import TensorInfo
from quantship.quantize_onnx.data import Feed

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
    searched = rounding_math.SeqMse(samples=samples) if seq_mse else None
    learned = rounding_math.AdaRound(iterations=adaround_iterations, samples=samples) if adaround_iterations else None
    timings = {"seq_mse": 0.0, "adaround": 0.0}

    def step(layer: weight_layers.WeightLayer, x, target) -> None:
        if searched is not None:
            t = time.perf_counter()
            rounding_math.fit_scale(layer, x, target, searched)
            timings["seq_mse"] += time.perf_counter() - t
        if learned is not None:
            t = time.perf_counter()
            rounding_math.learn(layer, x, target, adaround_iterations, learned)
            timings["adaround"] += time.perf_counter() - t

    with rounding_math.torch_threads(rounding_math.TORCH_THREADS):
        passes = weight_layers.sequential(model, float_model, layers, feeds, step, skipped, info) if layers else 0
    reading = time.perf_counter() - start - timings["seq_mse"] - timings["adaround"]
    done: dict[str, dict] = {}
    for name, report in (("seq_mse", searched), ("adaround", learned)):
        if report is None:
            continue
        report.skipped, report.n_passes = dict(skipped), passes
        # the shared pass that reads the layers' inputs is counted in each algorithm that ran
        report.seconds = timings[name] + reading
        done[name] = report.as_dict()
    return done
