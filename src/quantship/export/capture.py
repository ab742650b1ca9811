"""The one call into torch's dynamo ONNX exporter, shared by the QDQ and the float paths."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quantship.heap import forget_module_caches

EXPORTER_OPSET = 18  # the opset torch's dynamo exporter translates natively; lower ones are rewritten
BATCH_DIM_NAME = "batch"  # the name of the symbolic batch dimension in every dynamic file
# Written by quantship.quantize.capture on a graph captured at a static batch (the reason why).
STATIC_BATCH_ATTRIBUTE = "quantship_static_batch_reason"
EXTERNAL_MIN_BYTES = 1024  # dynamo_export_file: smaller tensors (scales, shapes) stay in the graph
IN_FLIGHT_BYTES = 64 << 20  # dynamo_export_file: tensor bytes being written at once (onnx_ir's default: 1 GiB)


def as_inputs(sample: Any) -> tuple:
    """``sample`` as a tuple of contiguous positional model inputs (a tensor, or a tuple/list of tensors).

    Strides and memory format never reach the exporter: a channels-last sample gives the same graph.
    """
    inputs = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
    return tuple(_contiguous(x) for x in inputs)


def _contiguous(x: Any) -> Any:
    import torch

    return x.contiguous(memory_format=torch.contiguous_format) if isinstance(x, torch.Tensor) else x


def static_batch_of(model: Any) -> int | None:
    """The batch size a torch.export graph is fixed at (read off its input placeholder); None if symbolic
    or not a captured graph."""
    for node in getattr(getattr(model, "graph", None), "nodes", ()):
        if getattr(node, "op", None) == "placeholder":
            shape = getattr(getattr(node, "meta", {}).get("val"), "shape", None)
            return shape[0] if shape and isinstance(shape[0], int) else None
    return None


def static_batch_reason(model: Any) -> str | None:
    """Why ``model`` runs one batch size only (None when its batch is symbolic, or nothing says so)."""
    reason = getattr(model, STATIC_BATCH_ATTRIBUTE, None)
    if reason:
        return str(reason)
    batch = static_batch_of(model)
    return f"captured by torch.export at batch {batch}, with the batch baked into its shapes" if batch else None


def _trace_inputs(inputs: tuple, dynamic_batch: bool) -> tuple:
    # torch.export specialises a dimension of size 1: trace a symbolic batch on a batch of 2
    import torch

    if not dynamic_batch or not all(isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == 1 for x in inputs):
        return inputs
    return tuple(torch.cat([x, x]) for x in inputs)


def name_batch_dim(model: onnx.ModelProto, name: str = BATCH_DIM_NAME) -> None:
    """Rename the symbolic leading dimension of the graph inputs (and wherever it appears) to ``name``."""
    symbols = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim[:1] if d.dim_param}
    values = list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
    for value in values:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in symbols:
                dim.dim_param = name


def as_arrays(sample: Any) -> list[np.ndarray]:
    """The sample as numpy arrays, one per model input, for ONNX Runtime."""
    return [x.detach().cpu().numpy() for x in as_inputs(sample)]


def batch_dim_is_dynamic(model: onnx.ModelProto) -> bool:
    """Whether the first graph input's leading dimension is symbolic in the file."""
    dims = model.graph.input[0].type.tensor_type.shape.dim
    return bool(dims) and not dims[0].HasField("dim_value")


class _SharedTables:
    """The exporter's translation tables, one per (opset, set of translatable torch operators).

    torch builds the table from the torchlib functions whose torch operator exists at that moment:
    an operator registered later (``quantized_decomposed.*`` comes with torchao's pt2e) is missing from
    a table built before it. The key is therefore what a fresh build would read, so a shared table
    never answers differently from the one torch would build now.
    """

    def __init__(self) -> None:
        self.tables: dict[tuple, Any] = {}
        self.builds = 0

    def get(self, build: Any, registry_class: type, opset_version: Any, key: tuple) -> Any:
        full_key = (registry_class, opset_version, key)
        if full_key not in self.tables:
            self.builds += 1
            self.tables[full_key] = build(registry_class, opset_version=opset_version)
        return self.tables[full_key]

    def clear(self) -> None:
        self.tables.clear()


_tables = _SharedTables()


def _translatable_operators() -> tuple | None:
    """What ``ONNXRegistry.from_torchlib`` would read now: the number of its torch-side translations, and
    each onnxscript torchlib name with its number of functions, for the names whose torch operator
    resolves (a few ms: names and counts only; the functions' IR, what makes a build slow, is not
    touched). None if torch's or onnxscript's private layout is not the one this reads."""
    import logging

    try:
        from onnxscript.function_libs.torch_lib import ops as _registers_every_function  # noqa: F401
        from onnxscript.function_libs.torch_lib.registration import default_registry
        from torch.onnx._internal.exporter import _registration
        from torch.onnx._internal.exporter._torchlib import _torchlib_registry as torch_side

        logger = _registration.logger
        level = logger.level
        logger.setLevel(logging.ERROR)  # torch logs every unresolved name; the build it keys logs them too
        try:
            resolved = frozenset(
                (name, len(functions.overloads), len(functions.complex)) for name, functions in default_registry.items()
                if not name.startswith("internal::") and _registration._get_overload(name) is not None)
        finally:
            logger.setLevel(level)
        return (len(torch_side.get_torchlib_ops()), resolved)
    except (ImportError, AttributeError):
        return None


@contextlib.contextmanager
def one_registry() -> Iterator[None]:
    """Inside, the exporter reuses its table of ONNX translations instead of building it anew, as long as
    the table torch would build now is the same one.

    ``torch.onnx.export`` rebuilds that table (``ONNXRegistry.from_torchlib``: every torchlib function,
    0.36 s warm, 0.7 s the first time) on every call, then only reads it while no custom translation is
    given, which is never the case here. A process that exports more than once (an accuracy search, a
    bench, a test suite) builds it once per opset and set of registered operators. When torch no longer
    has that private layout, nothing changes.
    """
    try:
        from torch.onnx._internal.exporter import _constants
        from torch.onnx._internal.exporter._registration import ONNXRegistry
    except ImportError:
        yield
        return
    built = ONNXRegistry.__dict__.get("from_torchlib")
    if not isinstance(built, classmethod) or getattr(built.__func__, "_quantship_shared", False):
        yield  # not the method we know, or already shared by an enclosing call
        return

    def shared(cls, opset_version=_constants.TORCHLIB_OPSET):
        key = _translatable_operators()
        if key is None:
            return built.__func__(cls, opset_version=opset_version)
        return _tables.get(built.__func__, cls, opset_version, key)

    shared._quantship_shared = True
    ONNXRegistry.from_torchlib = classmethod(shared)
    try:
        yield
    finally:
        ONNXRegistry.from_torchlib = built


def dynamo_program(
    model: Any,
    sample: Any,
    *,
    opset_version: int,
    dynamic_batch: bool,
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
) -> Any:
    """``torch.onnx.export(..., dynamo=True)``'s program (its tensors are the model's own: nothing copied yet)."""
    import torch

    inputs = _trace_inputs(as_inputs(sample), dynamic_batch)
    if hasattr(model, "eval"):
        model.eval()  # export what inference runs (a pt2e graph accepts .eval() as a supported switch)
    dynamic_shapes = None
    if dynamic_batch:
        dynamic_shapes = tuple({0: torch.export.Dim.DYNAMIC} for _ in inputs)
    with warnings.catch_warnings():
        # a pt2e graph has no train/eval modules: its `training` flag is not what inference runs
        warnings.filterwarnings("ignore", message="Exporting a model while it is in training mode")
        with one_registry():
            program = torch.onnx.export(
                model, inputs, None, dynamo=True, opset_version=opset_version, verbose=False,
                dynamic_shapes=dynamic_shapes,
                input_names=list(input_names) if input_names else None,
                output_names=list(output_names) if output_names else None,
            )
    release_rewriter_graphs()
    forget_module_caches()  # the exported model is the caller's to keep or let go, not torch's caches'
    if program is None:
        raise RuntimeError("torch.onnx.export returned no ONNX program")
    return program


def release_rewriter_graphs() -> None:
    """Let go of the graph onnxscript's default rewrite rules last matched on. Those rules are module-level objects,
    and each one's pattern matcher keeps the graph, node and match of its last call until its next one; after
    torch.onnx's optimization that is the exported graph, whose tensors are the model's own: a quantized model
    deleted after its export kept every weight resident (0.47 GiB on bench/scale.py's 2 GB encoder, beside the
    next step's model). A matcher sets these again on its next call. onnxscript's private layout: nothing is done
    where it is not the one this reads."""
    try:
        from onnxscript import rewriter

        rules = tuple(rewriter._DEFAULT_REWRITE_RULES)
    except (ImportError, AttributeError, TypeError):
        return
    for rule in rules:
        matcher = getattr(rule, "_matcher", None)
        for state in ("_graph", "_current_node", "_match", "_tracer"):
            if getattr(matcher, state, None) is not None:
                setattr(matcher, state, None)


def dynamo_export(model: Any, sample: Any, *, opset_version: int, dynamic_batch: bool,
                  input_names: Sequence[str] | None, output_names: Sequence[str] | None) -> onnx.ModelProto:
    """``torch.onnx.export(..., dynamo=True)`` to an in-memory ModelProto (nothing touches disk)."""
    proto = dynamo_program(model, sample, opset_version=opset_version, dynamic_batch=dynamic_batch,
                           input_names=input_names, output_names=output_names).model_proto
    if dynamic_batch:
        name_batch_dim(proto)
    return proto


def dynamo_export_file(model: Any, sample: Any, path: Path, data_name: str, *, opset_version: int,
                       dynamic_batch: bool, input_names: Sequence[str] | None,
                       output_names: Sequence[str] | None) -> onnx.ModelProto:
    """``dynamo_export`` written to ``path`` with its tensors in ``data_name`` beside it, streamed from the model's
    own (onnx_ir writes one tensor at a time, each page-aligned so ONNX Runtime can map it): no serialised copy of
    the weights is held, where ``dynamo_export``'s ModelProto is a second copy of them. Returns the graph without
    its weights."""
    import onnx_ir as ir

    program = dynamo_program(model, sample, opset_version=opset_version, dynamic_batch=dynamic_batch,
                             input_names=input_names, output_names=output_names)
    ir.save(program.model, path, external_data=data_name, size_threshold_bytes=EXTERNAL_MIN_BYTES,
            alignment=4096, max_in_flight_bytes=IN_FLIGHT_BYTES)
    del program
    graph = onnx.load(str(path), load_external_data=False)
    if dynamic_batch:
        name_batch_dim(graph)
        path.write_bytes(graph.SerializeToString())
    return graph
