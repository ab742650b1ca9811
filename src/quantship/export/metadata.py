"""Provenance that travels with the file: the spec, the quantship version, the export choices."""

from __future__ import annotations

import onnx_ir as ir

from quantship.precision import METADATA_KEY, QuantSpec

VERSION_KEY = "quantship.version"
ACTIVATION_DTYPE_KEY = "quantship.activation_dtype"
TARGET_KEY = "quantship.target"


def write_metadata(model: ir.Model, spec: QuantSpec, *, activation_dtype: str, target: str | None) -> None:
    """Record ``spec`` (as JSON), the quantship version and the export choices in ``metadata_props``."""
    from quantship import __version__

    model.metadata_props[METADATA_KEY] = spec.to_json()
    model.metadata_props[VERSION_KEY] = __version__
    model.metadata_props[ACTIVATION_DTYPE_KEY] = activation_dtype
    if target is not None:
        model.metadata_props[TARGET_KEY] = target
