"""The one call into torch's dynamo ONNX exporter, shared by the QDQ and the float paths."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

EXPORTER_OPSET = 18  # the opset torch's dynamo exporter translates natively; lower ones are rewritten


def as_inputs(sample: Any) -> tuple:
    """``sample`` as a tuple of positional model inputs (a tensor, or a tuple/list of tensors)."""
    return tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)


def as_arrays(sample: Any) -> list[np.ndarray]:
    """The sample as numpy arrays, one per model input, for ONNX Runtime."""
    return [x.detach().cpu().numpy() for x in as_inputs(sample)]


def batch_dim_is_dynamic(model: onnx.ModelProto) -> bool:
    """Whether the first graph input's leading dimension is symbolic in the file."""
    dims = model.graph.input[0].type.tensor_type.shape.dim
    return bool(dims) and not dims[0].HasField("dim_value")


def dynamo_export(
    model: Any,
    sample: Any,
    *,
    opset_version: int,
    dynamic_batch: bool,
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
) -> onnx.ModelProto:
    """``torch.onnx.export(..., dynamo=True)`` to an in-memory ModelProto (nothing touches disk)."""
    import torch

    inputs = as_inputs(sample)
    if hasattr(model, "eval"):
        model.eval()  # export what inference runs (a pt2e graph accepts .eval() as a supported switch)
    dynamic_shapes = None
    if dynamic_batch:
        dynamic_shapes = tuple({0: torch.export.Dim.DYNAMIC} for _ in inputs)
    with warnings.catch_warnings():
        # a pt2e graph has no train/eval modules: its `training` flag is not what inference runs
        warnings.filterwarnings("ignore", message="Exporting a model while it is in training mode")
        program = torch.onnx.export(
            model, inputs, None, dynamo=True, opset_version=opset_version, verbose=False,
            dynamic_shapes=dynamic_shapes,
            input_names=list(input_names) if input_names else None,
            output_names=list(output_names) if output_names else None,
        )
    if program is None:
        raise RuntimeError("torch.onnx.export returned no ONNX program")
    return program.model_proto
