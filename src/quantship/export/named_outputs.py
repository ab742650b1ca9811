"""The outputs of the model being exported: the torch reference of every one, and the file's output names.

A forward may return a tensor, a tuple, a dict or a transformers ``ModelOutput``
(``inspect.run.outputs``): every tensor becomes a graph output named after its key, in the model's
order, and each is compared with the torch model in its own LSB. A single tensor is named
``SINGLE_OUTPUT_NAME`` in the float file and in the INT8 file alike, never after the torch node that
made it (``linear`` in one, ``dequantize_per_tensor_124`` in the other): code that looks the output
up by name works on both files and across builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from quantship.errors import ExportRefused, OutputsRefused, one_line
from quantship.inspect.run.outputs import names_of, output_arrays

SINGLE_OUTPUT_NAME = "output"  # a forward that returns one tensor: its graph output, in every file we write


def reference_outputs(model: Any, batches: list[Any], sample: Any) -> tuple[list[str] | None, list[np.ndarray]]:
    """Every output of the torch model on the sample, run as ``batches`` (its cuts) or else whole
    (``outputs.output_arrays``: names, arrays), refused in one line when the model cannot run it or
    returns something other than tensors."""
    try:
        try:
            return output_arrays(model, batches)
        except OutputsRefused:
            raise
        except Exception:  # a graph that refuses the cuts runs the sample whole (and refuses below if not)
            return output_arrays(model, [sample])
    except OutputsRefused as exc:
        raise ExportRefused(str(exc)) from exc
    except Exception as exc:  # a model that cannot run its own sample: say so before exporting
        raise ExportRefused(f"{type(model).__name__} does not run on the sample in torch "
                            f"({type(exc).__name__}: {one_line(exc)})") from exc


def graph_output_names(names: list[str] | None, reference: list[np.ndarray],
                       output_names: Sequence[str] | None) -> list[str]:
    """The names the file's outputs get: ``output_names`` when given (one per output), else the model's
    keys (``outputs.names_of``: dict keys, ``output_<i>``); ``SINGLE_OUTPUT_NAME`` for a single tensor."""
    if output_names is None:
        return names if names is not None else [SINGLE_OUTPUT_NAME]
    given = list(output_names)
    if len(given) != len(reference) or len(set(given)) != len(given) or not all(isinstance(n, str) and n for n in given):
        keys = f" ({', '.join(names)})" if names else ""
        raise ExportRefused(f"output_names={given!r}: the model returns {len(reference)} tensor output(s){keys}; "
                            f"give {len(reference)} distinct non-empty names, or leave output_names out")
    return given


def check_outputs_line_up(produced: onnx.ModelProto, reference: list[np.ndarray]) -> None:
    """The exporter wrote one graph output per tensor the model returns, in the same order (the ranks
    match where the graph declares a shape)."""
    outputs = produced.graph.output
    ranks = [len(o.type.tensor_type.shape.dim) if o.type.tensor_type.HasField("shape") else None for o in outputs]
    expected = [r.ndim for r in reference]
    if len(ranks) != len(expected) or any(r is not None and r != e for r, e in zip(ranks, expected)):
        raise ExportRefused(f"the exporter wrote {len(outputs)} output(s) of rank(s) {ranks} for a model that "
                            f"returns {len(reference)} tensor(s) of rank(s) {expected}; return a flat tuple or "
                            "dict of tensors")


def float_output_names(model: Any, sample: Any) -> list[str] | None:
    """The keys of a float model's outputs on ``sample`` (one forward), so that its float file names them
    as its INT8 file does (``SINGLE_OUTPUT_NAME`` for a single tensor); None (the exporter's names) when
    the outputs cannot be named (the float exporter then writes what it can, as before)."""
    import torch

    inputs = sample if isinstance(sample, (tuple, list)) else (sample,)
    try:
        with torch.no_grad():
            names = names_of(model(*inputs), type(model).__name__)
    except Exception:  # a forward or an output the exporter may still handle: its own names, its own error
        return None
    return names if names is not None else [SINGLE_OUTPUT_NAME]
