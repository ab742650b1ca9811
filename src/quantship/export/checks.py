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
from quantship.inspect.read import external
from quantship.inspect.run.literal import tensors_folder
from quantship.inspect.run.verify import ort_session, run_session
from quantship.progress import step


def run_unoptimized(model: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Outputs of ``model`` in ONNX Runtime with every graph optimization disabled."""
    return run_session(ort_session(model, optimized=False), inputs)


# Above this many bytes of stored tensors, ``check_model`` checks the graph with a placeholder of each tensor's
# bytes instead of in memory (``external.checked_without_weights``): given a model, onnx serialises it and parses it
# again (two more copies of every weight at once: 1 GB more at the peak of a 2 GB float model's export, measured).
CHECKED_IN_MEMORY_BELOW = 64 << 20


def check_model(model: onnx.ModelProto, what: str) -> None:
    """``onnx.checker`` at the opset the graph declares; refuse the rewrite named ``what`` otherwise. A graph whose
    tensors are in ``literal.tensors_in``'s folder is checked there, beside them."""
    folder = tensors_folder() if external.external_tensors(model) else None
    if folder is None and sum(t.ByteSize() for t in model.graph.initializer) < CHECKED_IN_MEMORY_BELOW:
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as exc:
            raise ExportRefused(f"{what}: the rewritten graph fails onnx.checker: {one_line(exc)}") from exc
        return
    invalid = external.checked_without_weights(model, folder)
    if invalid is not None:
        raise ExportRefused(f"{what}: the rewritten graph fails onnx.checker: {invalid}")


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
        self.ctx.checked = None  # stale now; not held beside the new serialisation (a copy of every weight)
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


def _typed_output(name: str, dtypes: dict[str, int], q: onnx.NodeProto) -> onnx.ValueInfoProto:
    """A graph output for the integer tensor ``q`` (a QuantizeLinear) writes: its zero-point's dtype (``dtypes``:
    the graph's stored tensors'; uint8 when it has none)."""
    zero = dtypes.get(q.input[2]) if len(q.input) > 2 else None
    return onnx.helper.make_tensor_value_info(name, zero or onnx.TensorProto.UINT8, None)


def same_op_steps(before: onnx.ModelProto, after: onnx.ModelProto, inputs: list[np.ndarray]) -> int | None:
    """For a rewrite that writes an op as another op computing the same function (``qdq.SAME_OP_FORMS``): the
    largest difference, in quantization steps, between each QuantizeLinear that reads a node the rewrite wrote
    in ``after`` and the same QuantizeLinear in ``before``, the new node run on the very values ``before`` gives
    its inputs (the op alone: a step one mean moves is not counted again in a later mean's inputs). ORT, no
    optimizations, on ``inputs``. None when a new node is not read by a QuantizeLinear alone (nothing to compare
    step for step) or a graph does not run."""
    old_names = {n.name for n in before.graph.node}
    new = [n for n in after.graph.node if n.name not in old_names]
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in after.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    stored = {t.name: t for t in after.graph.initializer}
    before_q = {n.name: n for n in before.graph.node if n.op_type == "QuantizeLinear"}
    pairs = []
    for node in new:
        users = [u for o in node.output for u in readers.get(o, [])]
        if not users or any(u.op_type != "QuantizeLinear" or u.name not in before_q for u in users):
            return None
        pairs += [(node, u) for u in users]
    if not pairs:
        return None
    probe = onnx.ModelProto()
    probe.CopyFrom(before)
    wanted = sorted({i for node, _ in pairs for i in node.input if i and i not in stored})
    del probe.graph.output[:]
    probe.graph.output.extend([onnx.helper.make_tensor_value_info(i, onnx.TensorProto.FLOAT, None) for i in wanted])
    before_dtypes = {t.name: t.data_type for t in before.graph.initializer}
    probe.graph.output.extend([_typed_output(before_q[q.name].output[0], before_dtypes, before_q[q.name])
                               for _, q in pairs])
    try:
        values = run_unoptimized(probe, inputs)
    except Exception:  # ORT's own exception types: the graph does not run as cut
        return None
    by_name = dict(zip(wanted, values[:len(wanted)]))
    after_dtypes = {name: t.data_type for name, t in stored.items()}
    worst = 0
    for (node, q), expected in zip(pairs, values[len(wanted):]):
        feeds = [i for i in node.input if i and i not in stored]
        consts = [stored[i] for i in (*node.input, *q.input[1:]) if i in stored]
        graph = onnx.helper.make_graph(
            [node, q], "same_op", [onnx.helper.make_tensor_value_info(i, onnx.TensorProto.FLOAT, None) for i in feeds],
            [_typed_output(q.output[0], after_dtypes, q)], consts)
        alone = onnx.helper.make_model(graph, opset_imports=after.opset_import, ir_version=after.ir_version)
        try:
            (got,) = run_unoptimized(alone, [by_name[i] for i in feeds])
        except Exception:  # ORT's own exception types
            return None
        if got.shape != expected.shape:
            return None
        worst = max(worst, int(np.abs(got.astype(np.int64) - expected.astype(np.int64)).max(initial=0)))
    return worst
