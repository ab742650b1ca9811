"""``qdq_stats`` and ``quant_spec_of_file``: what a QDQ file contains, from one read of it (``FileFacts``).

The counting itself lives in ``counts`` (below ``facts``, which counts every file it reads); this
module is the public way in by path, model or facts.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from quantship.inspect.read.counts import COMPUTE_OPS, QDQ_OPS, QDQStats  # noqa: F401 - public names of this module
from quantship.inspect.read.facts import FileFacts, facts_of
from quantship.precision import QuantSpec


def qdq_stats(path: str | Path | onnx.ModelProto | FileFacts) -> QDQStats:
    """Count the Q/DQ nodes of an ONNX file (or in-memory model, or ``FileFacts``) and audit their zero-points.

    A file that is not a readable ONNX model is refused (``FileRefused``; ``FileNotFoundError`` when absent).
    """
    return facts_of(path).stats


def quant_spec_of_file(path: str | Path | onnx.ModelProto | FileFacts) -> QuantSpec | None:
    """The ``QuantSpec`` written into the file's ``metadata_props``; ``None`` if the file carries none."""
    return facts_of(path).quant_spec()
