"""Write files a runtime loads: ``export_qdq`` (faithful QDQ from pt2e) and the float path ``export_onnx``.

``ONNXModel`` and ``verify_onnx`` live in ``quantship.inspect.run.onnx_model`` (they read files); they
are re-exported here for the names earlier releases published. Names load lazily, so importing
one module of this package (``quantship.export.artifact``) does not import the exporters.
"""

from __future__ import annotations

from typing import Any

from quantship.lazy import load_public

_PUBLIC = {
    "export_qdq": "quantship.export.qdq",
    "export_onnx": "quantship.export.onnx_float",
    "ONNXModel": "quantship.inspect.run.onnx_model",
    "verify_onnx": "quantship.inspect.run.onnx_model",
    "quantize_export_judged": "quantship.export.judged",
    "split_held_out": "quantship.export.data",
    "CalibrationReader": "quantship.export.ort_quantize",
    "set_accuracy_level": "quantship.export.weight_only",
    # decoder files for generation (docs/decoder.md): the export, its layout, its input names, a session on it
    "export_decoder": "quantship.export.decoder",
    "read_layout": "quantship.export.decoder",
    "prefill_feed": "quantship.export.decoder",
    "INPUT_IDS": "quantship.export.decoder",
    "ATTENTION_MASK": "quantship.export.decoder",
    "PAST_KEY": "quantship.export.decoder",
    "PAST_VALUE": "quantship.export.decoder",
    "onnx_session": "quantship.export.decoder_check",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    return load_public(__name__, _PUBLIC, name)


def __dir__() -> list[str]:
    return sorted(__all__)
