"""Checks every rewrite must pass: ``onnx.checker`` and byte-identical ONNX Runtime outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from quantship.errors import ExportRefused, one_line
from quantship.inspect.verify import ort_session, run_session


def run_unoptimized(model: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Outputs of ``model`` in ONNX Runtime with every graph optimization disabled."""
    return run_session(ort_session(model, optimized=False), inputs)


def check_model(model: onnx.ModelProto, what: str) -> None:
    """``onnx.checker`` at the opset the graph declares; refuse the rewrite named ``what`` otherwise."""
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise ExportRefused(f"{what}: the rewritten graph fails onnx.checker: {one_line(exc)}") from exc


def check_identical(model: onnx.ModelProto, reference: list[np.ndarray], inputs: list[np.ndarray], what: str) -> None:
    """Refuse ``what`` unless ``model`` returns exactly the reference bytes (ORT, no optimizations)."""
    try:
        outputs = run_unoptimized(model, inputs)
    except Exception as exc:  # ORT raises its own exception types; all mean "does not run"
        raise ExportRefused(f"{what}: ONNX Runtime cannot run the rewritten graph ({type(exc).__name__}: {exc})") from exc
    if len(outputs) != len(reference):
        raise ExportRefused(f"{what}: the rewritten graph has {len(outputs)} outputs, the produced one {len(reference)}")
    for i, (got, ref) in enumerate(zip(outputs, reference)):
        if got.shape != ref.shape or got.dtype != ref.dtype or got.tobytes() != ref.tobytes():
            diff = np.abs(got.astype(np.float64) - ref.astype(np.float64)).max() if got.shape == ref.shape else "n/a"
            raise ExportRefused(
                f"{what}: output {i} differs from the graph as produced (max abs difference {diff}); "
                "the rewrite is not exact, so it is refused"
            )


def check_runs_optimized(model: onnx.ModelProto | Path, inputs: list[np.ndarray], what: str) -> None:
    """The graph must load and run at ONNX Runtime's default (full) optimization level."""
    try:
        outputs = run_session(ort_session(model, optimized=True), inputs)
    except Exception as exc:
        raise ExportRefused(f"{what}: ONNX Runtime cannot run the graph with its optimizations on "
                            f"({type(exc).__name__}: {exc})") from exc
    for i, out in enumerate(outputs):
        if np.issubdtype(out.dtype, np.floating) and not np.all(np.isfinite(out)):
            raise ExportRefused(f"{what}: output {i} is not finite when ONNX Runtime optimizes the graph")
