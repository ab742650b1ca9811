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
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    return load_public(__name__, _PUBLIC, name)


def __dir__() -> list[str]:
    return sorted(__all__)
