"""AdaRound (Nagel et al. 2020) on the ONNX quantizer's layers: each weight rounded up or down as learned
on the calibration data. The math is shared with the pt2e path (``quantize.weight_rounding``, which says
what it does); here each layer is a ``weight_layers.WeightLayer``, its inputs the quantized model's,
earlier layers already rounded (``weight_layers.sequential``). Only the integer weights change: the
scales, the bias and the graph stay as they are.
"""

from __future__ import annotations

from quantship.quantize.weight_rounding import ITERATIONS, MAX_ITERATIONS, AdaRound, iterations_of, learn

__all__ = ["ITERATIONS", "MAX_ITERATIONS", "AdaRound", "iterations_of", "learn"]
