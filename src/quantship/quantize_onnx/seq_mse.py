"""Sequential MSE weight-scale search on the ONNX quantizer's layers: each layer's weight scale, per output
channel, chosen among fractions of the absmax scale to minimise the layer's output error on the
calibration data. The math is shared with the pt2e path (``quantize.weight_rounding``, which says what it
does); here each layer is a ``weight_layers.WeightLayer`` run in torch on its real inputs
(``weight_layers.sequential``: the quantized model's, earlier layers already searched). The bias, every
activation scale and the graph stay as they are.
"""

from __future__ import annotations

from quantship.quantize.weight_rounding import CANDIDATES, SeqMse, fit_scale, rounded

__all__ = ["CANDIDATES", "SeqMse", "fit_scale", "rounded"]
