"""Apply a validated precision to a model: pt2e, FX backends, torchao, QAT callback.

``Quantizer`` is loaded on first use: importing one module of this package (the format-neutral
``algorithms``, which the ONNX front-end reads) does not import torch's quantization stack.
"""

from __future__ import annotations

from typing import Any

from quantship.lazy import load_public
from quantship.noise import silence_library_noise

silence_library_noise()  # before torchao loads

_PUBLIC = {
    "Quantizer": "quantship.quantize.quantizer",
    # for a pt2e flow run by hand (torchao's prepare_pt2e / convert_pt2e): quantship's annotator, and the
    # ops it left float named by module
    "QuantshipQuantizer": "quantship.quantize.annotator",
    "describe_float_ops": "quantship.quantize.pt2e",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    return load_public(__name__, _PUBLIC, name)
