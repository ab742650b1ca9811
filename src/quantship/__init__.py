"""quantship: a PyTorch model to a deployable INT8 file, every claim checked on the file itself.

Public names are loaded lazily so that ``import quantship`` (and ``quantship --help``) stays fast.
"""

from __future__ import annotations

from typing import Any

from quantship.lazy import load_public

__version__ = "0.1.0"

# public name -> module that defines it (one place; `dir(quantship)` lists these)
_PUBLIC: dict[str, str] = {
    "QuantSpec": "quantship.precision",
    "quant_spec": "quantship.precision",
    "resolve_spec": "quantship.precision",
    "precision_table": "quantship.precision",
    "SUPPORT_MATRIX": "quantship.precision",
    "PRESETS": "quantship.targets",
    "Quantizer": "quantship.quantize",
    "Algorithms": "quantship.recipe",
    "Inputs": "quantship.quantize.calibration",
    "QuantizeCallback": "quantship.quantize.callback",
    "state_dict_size": "quantship.quantize.sizes",
    "export_qdq": "quantship.export",
    "export_onnx": "quantship.export",
    "ONNXModel": "quantship.inspect.run.onnx_model",
    "verify_onnx": "quantship.inspect.run.onnx_model",
    "qdq_stats": "quantship.inspect",
    "QDQStats": "quantship.inspect",
    "verify_qdq": "quantship.inspect",
    "compare_logits": "quantship.inspect",
    "quant_spec_of_file": "quantship.inspect",
    "quant_target": "quantship.precision",
    "target_names": "quantship.targets",
    # fidelity to FP32: the budget a file must keep, SQNR from energies and between two arrays
    "Budget": "quantship.fidelity",
    "sqnr_db": "quantship.fidelity",
    "output_sqnr_db": "quantship.fidelity",
    # the error vocabulary (quantship.errors): every one a ValueError
    "QuantshipError": "quantship.errors",
    "SpecRefused": "quantship.errors",
    "DataRefused": "quantship.errors",
    "ExportRefused": "quantship.errors",
    "TargetRefused": "quantship.errors",
    "FileRefused": "quantship.errors",
    "one_line": "quantship.errors",
    "BudgetMissed": "quantship.search_engine",  # a search (accuracy, fidelity) found no file within its budget
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    value = globals()[name] = load_public(__name__, _PUBLIC, name)
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
