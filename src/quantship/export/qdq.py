"""``export_qdq``: a pt2e-quantized model to a QDQ ONNX file, every guarantee checked on the file.

The pipeline is a list of small passes, each with one job and its own check against the graph
as the exporter produced it (ONNX Runtime, optimizations off, byte-identical outputs). The file is
written atomically: it appears at ``path`` only when every pass and post-condition held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantship.export import artifact, capture, weight_only
from quantship.export.activations import check_read_back, to_uint8_activations
from quantship.export.checks import (
    ExportRefused,
    check_identical,
    check_model,
    check_runs_optimized,
    run_unoptimized,
)
from quantship.export.kernel_shape import write_kernel_shapes
from quantship.export.metadata import write_metadata
from quantship.export.opset import LOWEST_OPSET, lower_opset
from quantship.export.postconditions import check_file, check_target
from quantship.export.refusals import exportable_spec, resolve_activation_dtype
from quantship.precision import QuantSpec


@dataclass
class ExportContext:
    """What every pass may read: the request, the sample, and the graph as produced."""

    spec: QuantSpec
    opset_version: int
    activation_dtype: str
    target: str | None
    inputs: list[np.ndarray]
    reference: list[np.ndarray] = field(default_factory=list)  # ORT outputs of the produced graph
    log: dict[str, int] = field(default_factory=dict)


def lower_opset_pass(model: ir.Model, ctx: ExportContext) -> None:
    """Declare the requested opset; checked by onnx.checker and an identical ORT run."""
    n = lower_opset(model, ctx.opset_version)
    ctx.log["opset_rewrites"] = n
    if n or model.opset_imports.get("") != capture.EXPORTER_OPSET:
        proto = ir.to_proto(model)
        what = f"lowering to opset {ctx.opset_version}"
        check_model(proto, what)
        check_identical(proto, ctx.reference, ctx.inputs, what)


def kernel_shape_pass(model: ir.Model, ctx: ExportContext) -> None:
    """Every Conv carries kernel_shape; checked by an identical ORT run when anything was written."""
    n = write_kernel_shapes(model)
    ctx.log["kernel_shapes_written"] = n
    if n:
        check_identical(ir.to_proto(model), ctx.reference, ctx.inputs, "writing Conv kernel_shape")


def activation_dtype_pass(model: ir.Model, ctx: ExportContext) -> None:
    """uint8 activations when asked; read back node by node, checked, identical, and run optimized."""
    if ctx.activation_dtype != "uint8":
        return
    before = ir.to_proto(model)
    to_uint8_activations(model)
    after = ir.to_proto(model)
    what = "moving activations to uint8"
    ctx.log["uint8_nodes"] = check_read_back(before, after)
    check_model(after, what)
    check_identical(after, ctx.reference, ctx.inputs, what)
    check_runs_optimized(after, ctx.inputs, what)


def metadata_pass(model: ir.Model, ctx: ExportContext) -> None:
    """Write the spec and provenance into metadata_props."""
    write_metadata(model, ctx.spec, activation_dtype=ctx.activation_dtype, target=ctx.target)


# The pass list: one place, run in order by export_qdq.
PASSES: tuple[Callable[[ir.Model, ExportContext], None], ...] = (
    lower_opset_pass, kernel_shape_pass, activation_dtype_pass, metadata_pass,
)


def _check_opset(opset_version: int) -> None:
    if isinstance(opset_version, bool) or not isinstance(opset_version, int) or opset_version < LOWEST_OPSET:
        raise ValueError(f"opset_version={opset_version!r}: export_qdq writes opset {LOWEST_OPSET} or higher "
                         f"(per-axis QuantizeLinear/DequantizeLinear and the exporter's translation need it)")


def produce(model: Any, sample: Any, *, opset_version: int, dynamic_batch: bool,
            input_names: Sequence[str] | None, output_names: Sequence[str] | None) -> onnx.ModelProto:
    """The graph as the dynamo exporter produces it (opset 18, or the higher opset asked for)."""
    batch = capture.as_inputs(sample)[0].shape[0]
    fixed = (f"dynamic_batch=True: the batch dimension stays fixed at {batch}, because the pt2e graph was "
             "captured by torch.export at that batch size and its shapes are baked in. Export with "
             f"dynamic_batch=False and run the file at batch {batch} (or quantize at the batch size you serve).")
    try:
        proto = capture.dynamo_export(
            model, sample, opset_version=max(opset_version, capture.EXPORTER_OPSET), dynamic_batch=dynamic_batch,
            input_names=input_names, output_names=output_names,
        )
    except Exception as exc:  # the exporter raises many types; name the step and keep the cause
        if dynamic_batch:
            raise ExportRefused(f"{fixed} (torch.export: {str(exc).strip().splitlines()[0][:300]})") from exc
        raise ExportRefused(f"the dynamo ONNX exporter failed on {type(model).__name__}: "
                            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}") from exc
    if dynamic_batch and not capture.batch_dim_is_dynamic(proto):
        raise ExportRefused(fixed)
    return proto


def export_qdq(
    model: Any,
    sample: Any,
    path: str | Path,
    *,
    opset_version: int = 18,
    activation_dtype: str | None = None,
    dynamic_batch: bool = False,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    target: str | None = None,
) -> Path:
    """Export a pt2e-quantized model to QDQ ONNX at ``path``, keeping its scales, zero-points and axes.

    ``activation_dtype``: ``'int8'`` (default; zero-point as quantized) or ``'uint8'`` (activation
    zero-points shifted by 128, same scales; weights stay int8). ``target`` takes the activation
    dtype from the deployment preset, records the target, and refuses a file that target's rules
    would not accept. Refusals raise ``ValueError`` and
    leave nothing at ``path`` (a file already there is kept as it was).
    """
    spec = exportable_spec(model)
    if weight_only.is_weight_only(spec):  # W8A16 / W4A16: their own writer (DequantizeLinear or MatMulNBits)
        return weight_only.export_weight_only(model, sample, path, spec, opset_version=opset_version, target=target,
                                              dynamic_batch=dynamic_batch, input_names=input_names,
                                              output_names=output_names)
    dtype = resolve_activation_dtype(activation_dtype, target)
    _check_opset(opset_version)
    with artifact.atomic_destination(path) as staged:
        produced = produce(model, sample, opset_version=opset_version, dynamic_batch=dynamic_batch,
                           input_names=input_names, output_names=output_names)
        inputs = capture.as_arrays(sample)
        ctx = ExportContext(spec=spec, opset_version=opset_version, activation_dtype=dtype, target=target,
                            inputs=inputs, reference=run_unoptimized(produced, inputs))
        model_ir = ir.from_proto(produced)
        for step in PASSES:
            step(model_ir, ctx)
        final = ir.to_proto(model_ir)
        artifact.save_model(final, staged)
        check_file(staged, spec, activation_dtype=dtype, opset_version=opset_version)
        if target is not None:
            check_target(staged, target)
        check_runs_optimized(staged, inputs, "the written file")
    return Path(path).expanduser().resolve()
