"""Provenance that travels with the file: the spec, the quantship version, the export choices."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from quantship import __version__
from quantship.inspect.read import external
from quantship.precision import METADATA_KEY, QuantSpec
from quantship.targets import TARGET_KEY

VERSION_KEY = "quantship.version"
ACTIVATION_DTYPE_KEY = "quantship.activation_dtype"
INT16_KEY = "quantship.int16"  # provenance: the activation tensors stored in 16 bits (both front-ends)
ALGORITHMS_KEY = "quantship.algorithms"  # the post-training algorithms that ran, and what each changed
# per-node properties torch's exporter writes that a deployable file should not carry: the Python stack
# of each op (absolute paths and source lines of the exporting machine) and the FX node's text. The
# module scopes (pkg.torch.onnx.name_scopes), the namespace and class hierarchy stay: inspect reads them.
SOURCE_NODE_KEYS = ("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node")


def write_metadata(model: ir.Model, spec: QuantSpec, *, activation_dtype: str, target: str | None) -> None:
    """Record ``spec`` (as JSON), the quantship version and the export choices in ``metadata_props``."""

    model.metadata_props[METADATA_KEY] = spec.to_json()
    model.metadata_props[VERSION_KEY] = __version__
    model.metadata_props[ACTIVATION_DTYPE_KEY] = activation_dtype
    if target is not None:
        model.metadata_props[TARGET_KEY] = target


def algorithms_summary(algorithms: dict[str, dict]) -> str:
    """``name: key value, ...`` per algorithm for the provenance (no timings or per-layer tables: the file
    stays reproducible), ``none`` when none ran."""
    def one(done: dict) -> str:
        shown = [f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in done.items()
                 if k != "seconds" and not isinstance(v, dict) and v is not None]
        return ", ".join(shown) or "ran"

    return "; ".join(f"{k}: {one(v)}" for k, v in algorithms.items()) or "none"


def strip_source_metadata(model: ir.Model) -> int:
    """Drop ``SOURCE_NODE_KEYS`` from every node (subgraphs included); returns how many were dropped."""
    dropped = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for key in SOURCE_NODE_KEYS:
            if node.metadata_props.pop(key, None) is not None:
                dropped += 1
    return dropped


def add_file_metadata(path: str | Path, entries: dict[str, str]) -> None:
    """Set ``entries`` in the ``metadata_props`` of the file at ``path`` (a staged file: what was measured
    on it after it was written); the graph and its tensors are copied unchanged, never read into memory
    (``external.set_metadata_streamed``: a 1 GB INT8 file held twice, parsed and serialised, was the CLI's largest
    step after its export)."""
    if not entries:
        return  # nothing to record: the file is not read and written again
    external.set_metadata_streamed(path, entries)
