"""quantship's own ONNX quantizer: a float ONNX file to a verified INT8 QDQ file (``quantize_onnx_file``).

``normalize`` (passes, each proven in ONNX Runtime), ``calibrate`` (ONNX Runtime with intermediates
exposed, the PyTorch path's observers), ``roles`` (the op -> role table), ``place`` (the Q/DQ layout,
written with onnx_ir), ``data`` (calibration feeds per declared input), ``equalize`` (cross-layer
equalization, a float pass), ``smooth_quant`` (SmoothQuant: activation outliers moved into the weights, a
float pass), ``target_forms`` (what a target cannot read, rewritten), ``bias_correction``
(each quantized layer's bias corrected on the calibration data), ``seq_mse`` and ``adaround`` (weight
scales searched, weight rounding learned, on the calibration data; ``weight_layers`` their layers and
sequential pass, ``rounding`` the pass that runs them), ``quantizer`` (the facade),
``sensitivity`` (per-node SQNR of the written file), ``search`` (the accuracy search), ``memory``
(the working-set estimate a file is refused on), ``dynamic`` and ``dynamic_file`` (the dynamic-activation
form, ``quantize_dynamic_file``: int8 weights, activations quantized at run time; data-free),
``repair`` (``quantize_onnx``, the default verb: the file judged for fidelity to FP32 and repaired when it
misses the budget, written only when it keeps it), and its default placement for ONNX Runtime, ``export.profile_place`` (shared with the PyTorch path):
weighted ops whose integer form profiles slower kept float when one timing of the file says faster.
"""

from __future__ import annotations

from typing import Any

from quantship.lazy import load_public

# public name -> defining module, loaded on first use: importing one module of this package
# (``data``, ``memory``) does not import the quantizer, and with it torch (a refusal answers at once)
_PUBLIC = {
    "DynamicQuantizeResult": "quantship.quantize_onnx.dynamic_file",
    "quantize_dynamic_file": "quantship.quantize_onnx.dynamic_file",
    "OnnxQuantizeResult": "quantship.quantize_onnx.quantizer",
    "quantize_onnx_file": "quantship.quantize_onnx.quantizer",
    "Repair": "quantship.quantize_onnx.repair",
    "quantize_onnx": "quantship.quantize_onnx.repair",
    "quantize_weight_only_file": "quantship.quantize_onnx.weight_only_file",
    "node_sqnr": "quantship.quantize_onnx.sensitivity",
    "speed_search_onnx": "quantship.quantize_onnx.speed",
    "runs_int16": "quantship.quantize_onnx.int16",
    "ISLAND_RULES": "quantship.quantize_onnx.float_islands",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    return load_public(__name__, _PUBLIC, name)


def __dir__() -> list[str]:
    return sorted(__all__)
