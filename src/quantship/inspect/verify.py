"""Does the file compute what the PyTorch model computes? Argmax agreement and logit error in LSB.

The file is run in ONNX Runtime with graph optimizations disabled by default, so what is measured
is the arithmetic the file describes (its Q/DQ pairs), not the runtime's own fused requantization.
torch is imported only inside the functions that run a torch model.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from quantship.inspect.lsb import LSBError, lsb_error, output_scales


def ort_session(model: str | Path | onnx.ModelProto, *, optimized: bool = False) -> ort.InferenceSession:
    """A CPU ONNX Runtime session, with graph optimizations disabled unless ``optimized``."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def run_session(session: ort.InferenceSession, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Run ``session`` on positional ``inputs`` (one array per graph input, in order)."""
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(inputs):
        raise ValueError(f"the file has {len(names)} input(s) {names}, but {len(inputs)} array(s) were given")
    return session.run(None, dict(zip(names, inputs)))


def split_batches(sample: Any, n_batches: int) -> list[Any]:
    """``sample`` cut into ``n_batches`` equal batches along dim 0; unequal cuts are refused."""
    if isinstance(n_batches, bool) or not isinstance(n_batches, int) or n_batches < 1:
        raise ValueError(f"n_batches={n_batches!r} must be a positive int")
    n = int(sample.shape[0])
    if n % n_batches:
        raise ValueError(
            f"n_batches={n_batches} does not divide the {n} inputs of `sample` into equal batches; a "
            f"pt2e model runs at one batch size only: pick n_batches among the divisors of {n}"
        )
    size = n // n_batches
    return [sample[i * size:(i + 1) * size] for i in range(n_batches)]


def _check_batch(session: ort.InferenceSession, batch_size: int) -> None:
    dim = session.get_inputs()[0].shape[0] if session.get_inputs()[0].shape else None
    if isinstance(dim, int) and dim != batch_size:
        raise ValueError(
            f"the file was exported at batch size {dim}, but the batches are {batch_size} inputs each: "
            f"choose n_batches so that len(sample) / n_batches == {dim}"
        )


def _outputs(model: Any, path: str | Path, sample: Any, n_batches: int, optimized: bool) -> tuple[np.ndarray, np.ndarray]:
    """First output of the torch model and of the file over every batch, concatenated."""
    import torch

    batches = split_batches(sample, n_batches)
    session = ort_session(path, optimized=optimized)
    _check_batch(session, int(batches[0].shape[0]))
    ref, got = [], []
    with torch.no_grad():
        for batch in batches:
            out = model(batch)
            out = out[0] if isinstance(out, (tuple, list)) else out
            ref.append(out.detach().float().cpu().numpy())
            got.append(run_session(session, [batch.detach().cpu().numpy()])[0])
    return np.concatenate(ref), np.concatenate(got)


def verify_qdq(model: Any, path: str | Path, sample: Any, n_batches: int = 1, *, optimized: bool = False) -> float:
    """Fraction of inputs on which the file (in ONNX Runtime) and the PyTorch model predict the same class.

    ``sample`` is split into ``n_batches`` equal batches (the file's batch size). Warns when the
    reference predicts one class for every input: the agreement then says nothing.
    """
    ref, got = _outputs(model, path, sample, n_batches, optimized)
    ref_pred, got_pred = ref.argmax(-1), got.argmax(-1)
    if len(ref_pred) > 1 and np.unique(ref_pred).size == 1:
        warnings.warn(
            f"the reference model predicts class {int(ref_pred.flat[0])} for all {ref_pred.size} inputs, "
            "so this agreement is 1.0 whatever the file computes: the check is vacuous. Use a trained "
            "model on inputs whose predictions vary, or compare_logits() for a logit-level check.",
            UserWarning,
            stacklevel=2,
        )
    return float((ref_pred == got_pred).mean())


def compare_logits(model: Any, path: str | Path, sample: Any, n_batches: int = 1, *, optimized: bool = False) -> LSBError:
    """Error of the file's first output against the PyTorch model, in steps (LSB) of its output scale."""
    scale = next(iter(output_scales(path).values()), None)
    if scale is None:
        raise ValueError(
            f"{path}: the first output is not produced by a per-tensor DequantizeLinear, so it has no "
            "quantization step to measure in; compare it in absolute terms instead"
        )
    ref, got = _outputs(model, path, sample, n_batches, optimized)
    return lsb_error(ref, got, scale)
