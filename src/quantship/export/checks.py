"""Checks every rewrite must pass (``onnx.checker``, byte-identical ONNX Runtime outputs), and the
pass base class that runs them in ``ensures()``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantship.errors import ExportRefused, one_line
from quantship.inspect.run.verify import ort_session, run_session
from quantship.progress import step


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


def check_runs_optimized(model: onnx.ModelProto | Path, inputs: list[np.ndarray], what: str) -> list[np.ndarray]:
    """The graph must load and run at ONNX Runtime's default (full) optimization level, with finite
    outputs; returns them (the fused reading of the graph, so that no second optimized run is needed)."""
    try:
        outputs = run_session(ort_session(model, optimized=True), inputs)
    except Exception as exc:
        raise ExportRefused(f"{what}: ONNX Runtime cannot run the graph with its optimizations on "
                            f"({type(exc).__name__}: {exc})") from exc
    for i, out in enumerate(outputs):
        if np.issubdtype(out.dtype, np.floating) and not np.all(np.isfinite(out)):
            raise ExportRefused(f"{what}: output {i} is not finite when ONNX Runtime optimizes the graph")
    return outputs


class ExactPass(ir.passes.InPlacePass):
    """An in-place graph rewrite that proves itself exact in ``ensures()``.

    A subclass implements ``rewrite(model) -> int`` (how many nodes it changed) and may override
    ``changed`` (whether the graph differs, e.g. a declared opset) and ``verify(proto)`` (checks
    beyond identity). When the graph changed, ``ensures`` serialises it once and refuses the pass
    unless ONNX Runtime, optimizations off, returns the reference bytes. An unchanged graph is the
    same graph state as before, so it is not run again. ``ctx`` carries ``reference`` and
    ``check_inputs`` (what it was run on), and receives the checked graph as ``checked``.
    """

    what = "a rewrite"  # names the pass in a refusal

    def __init__(self, ctx: Any):
        self.ctx = ctx
        self.count = 0  # what rewrite() reported, for callers and tests
        self.modified = False

    def rewrite(self, model: ir.Model) -> int:
        raise NotImplementedError

    def changed(self, model: ir.Model) -> bool:
        return self.count > 0

    def verify(self, proto: onnx.ModelProto) -> None:
        """Checks a subclass adds before the identity check (``onnx.checker``, read-backs)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.count = self.rewrite(model)
        self.modified = self.changed(model)
        return ir.passes.PassResult(model, modified=self.modified)

    def ensures(self, model: ir.Model) -> None:
        if not self.modified:
            return
        with step(f"export check: {self.what}"):
            proto = ir.to_proto(model)
            self.verify(proto)
            check_identical(proto, self.ctx.reference, self.ctx.check_inputs, self.what)
        self.ctx.checked = proto  # serialised once: the file is written from it if nothing changes after


def run_passes(passes: Sequence[ir.passes.PassBase], model: ir.Model) -> ir.passes.PassResult:
    """Run ``passes`` in order with onnx_ir's PassManager; a refusal surfaces as itself, not wrapped.

    The pass infrastructure wraps what a pass, or its ``ensures()``, raises in its own
    ``PassError``/``PostconditionError``; the caller gets the original exception back.
    """
    try:
        return ir.passes.PassManager(list(passes), steps=1)(model)
    except (ir.passes.PassError, ir.passes.InvariantError) as exc:
        inner: BaseException = exc
        while isinstance(inner, (ir.passes.PassError, ir.passes.InvariantError)) and inner.__cause__ is not None:
            inner = inner.__cause__
        if inner is exc:
            raise
        raise inner from None
