"""Every input path a command line names, checked before the command imports anything heavy.

A missing model or data file is refused in one line (exit 2) in a fraction of a second, instead of
after the seconds torch, onnx and ONNX Runtime take to import. Standard library only: this module
runs before any of them loads. The loaders keep their own checks (they serve the Python API too).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from quantship.cli.usage import UsageError

# argparse dest -> what the path is, as the refusal names it. The one list of input-path arguments.
INPUT_PATHS: dict[str, str] = {
    "file": "ONNX file",
    "float_file": "float ONNX file",
    "int8_file": "INT8 ONNX file",
    "float_model": "float ONNX file",
    "model": "model file",
    "calib": "calibration data (--calib)",
    "inputs": "input data (--inputs)",
    "fidelity_data": "fidelity data (--fidelity-data)",
    "eval": "labelled data (--eval)",
    "config": "config file (--config)",
    "weights": "weights file (--weights)",
}
_MODEL_FILE_SUFFIXES = (".py", ".onnx", ".json")  # file.py:factory, a float .onnx, hf:config.json


def _named_path(dest: str, value: str) -> str | None:
    """The filesystem path ``value`` names for argument ``dest``, or None when it names no local file
    (``torchvision:resnet18``, an ``hf:`` hub reference, a torchvision weight set name such as ``DEFAULT``)."""
    if dest == "model":
        kind, _, name = value.partition(":")
        candidate = name if kind == "hf" else kind
        return candidate if candidate.endswith(_MODEL_FILE_SUFFIXES) else None
    if dest == "weights":  # a state_dict file, or a weight set name (no folder, no suffix)
        return value if ("/" in value or Path(value).suffix) else None
    return value


def refuse_missing_inputs(args: argparse.Namespace) -> None:
    """Refuse (``UsageError``, one line) the first input path the command line names that does not exist."""
    for dest, what in INPUT_PATHS.items():
        value = getattr(args, dest, None)
        if not isinstance(value, str) or not value:
            continue
        path = _named_path(dest, value)
        if path is not None and not Path(path).expanduser().exists():
            raise UsageError(f"{what} {path} does not exist")
