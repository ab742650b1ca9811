"""``export_qdq``: a pt2e-quantized model to a QDQ ONNX file, every guarantee checked on the file.

The pipeline is a list of small onnx_ir passes, each with one job; each pass's ``ensures()`` checks
it against the graph as the exporter produced it (ONNX Runtime, optimizations off, byte-identical
outputs; on one row of the sample when the batch is symbolic). Each graph state is run once: the
written file is loaded optimized once (its own check and the fused reading). The file is written
atomically: it appears at ``path`` only when every pass and post-condition held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantship import targets
from quantship.errors import DataRefused, one_line
from quantship.export import artifact, capture, float_pairs, target_forms, weight_only
from quantship.export.activations import GraphState, check_read_back, sixteen_bit_values, to_uint8_activations
from quantship.export.checks import (
    ExactPass,
    ExportRefused,
    check_identical,
    check_model,
    check_runs_optimized,
    run_passes,
    run_unoptimized,
    same_op_steps,
)
from quantship.export.ir_edit import replace_model
from quantship.export.kernel_shape import write_kernel_shapes
from quantship.export.metadata import (
    ALGORITHMS_KEY,
    INT16_KEY,
    algorithms_summary,
    strip_source_metadata,
    write_metadata,
)
from quantship.export.named_outputs import check_outputs_line_up, graph_output_names, reference_outputs
from quantship.export.opset import INT16_OPSET, LOWEST_OPSET, lower_opset
from quantship.export.ort_fusion import constants_to_uint8, requantize_before_relu
from quantship.export.postconditions import check_spec_held, check_target
from quantship.export.refusals import exportable_spec, resolve_activation_dtype
from quantship.heap import LARGE_MODEL_BYTES, give_back, large_blocks_mapped, module_bytes
from quantship.inspect.read.facts import read_file
from quantship.inspect.run.literal import LITERAL_PART_BYTES, parts_of_at_most, tensors_in, weights_to_disk
from quantship.inspect.run.verify import (
    MeasuredPath,
    Readings,
    ort_session,
    readings_of_outputs,
    run_session,
    warn_if_drift,
)
from quantship.precision import ALGORITHMS_ATTRIBUTE, QuantSpec, quant_preset
from quantship.progress import step
from quantship.ranks import rank_zero_writes
from quantship.targets import Target


@dataclass
class ExportContext:
    """What every pass may read: the request, the sample, and the graph as produced."""

    spec: QuantSpec
    opset_version: int
    activation_dtype: str
    target: Target | None
    inputs: list[np.ndarray]
    produced: onnx.ModelProto
    checked: onnx.ModelProto | None = None  # the last graph an ensures() ran, while nothing changed it since
    probe: list[np.ndarray] | None = None  # a smaller input the graph states are compared on (None: ``inputs``)
    algorithms: dict | None = None  # the post-training algorithms the model went through (Quantizer's record)
    place_as_onnx: bool = False  # PlacementPass runs (not exact: opt-in, ``export_qdq(place_as_onnx=True)``)
    _reference: list[np.ndarray] | None = field(default=None, repr=False)

    @property
    def check_inputs(self) -> list[np.ndarray]:
        """What the identity checks run on: ``probe`` when given, else the sample's ``inputs``."""
        return self.inputs if self.probe is None else self.probe

    @property
    def reference(self) -> list[np.ndarray]:
        """ORT outputs (optimizations off) of the produced graph on ``check_inputs``, run the first time
        a pass needs them: when no pass changes the graph, there is nothing to compare and no session
        is built."""
        if self._reference is None:
            try:
                self._reference = run_unoptimized(self.produced, self.check_inputs)
            except Exception as exc:  # ORT raises its own exception types
                rows = f" on {len(self.probe[0])} input(s) of the symbolic batch" if self.probe is not None else ""
                raise ExportRefused(f"ONNX Runtime cannot run the graph as the exporter produced it{rows} "
                                    f"({type(exc).__name__}: {one_line(exc)})") from exc
        return self._reference

    def rebase(self, proto: onnx.ModelProto) -> None:
        """``proto`` (a pass that moves roundings checked it) is the graph the later passes are proven against:
        run now, so a graph ONNX Runtime cannot run is refused here."""
        self.produced, self._reference, self.checked = proto, None, None
        self.reference  # noqa: B018  (runs it)
        self.checked = proto


def one_row_probe(produced: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray] | None:
    """The first row of each input when every graph input has a symbolic leading (batch) dimension.

    The passes rewrite attributes, zero-points and the declared opset: node by node, nothing that
    depends on the batch size, so one row runs every node exactly as the whole sample does and
    proves a rewrite exact at an eighth of the cost of a batch of 8. None when the batch is static
    (the graph runs that batch only) or already one row.
    """
    initializers = {t.name for t in produced.graph.initializer}
    graph_inputs = [v for v in produced.graph.input if v.name not in initializers]
    if len(graph_inputs) != len(inputs) or not all(x.ndim and x.shape[0] > 1 for x in inputs):
        return None
    for value in graph_inputs:
        dims = value.type.tensor_type.shape.dim
        if not dims or dims[0].HasField("dim_value"):
            return None
    return [x[:1] for x in inputs]


class LowerOpsetPass(ExactPass):
    """Declare the requested opset; ensured by onnx.checker and an identical ORT run."""

    def __init__(self, ctx: ExportContext):
        super().__init__(ctx)
        self.what = f"lowering to opset {ctx.opset_version}"

    def rewrite(self, model: ir.Model) -> int:
        return lower_opset(model, self.ctx.opset_version)

    def changed(self, model: ir.Model) -> bool:
        return self.count > 0 or model.opset_imports.get("") != capture.EXPORTER_OPSET

    def verify(self, proto: onnx.ModelProto) -> None:
        check_model(proto, self.what)


class KernelShapePass(ExactPass):
    """Every Conv carries kernel_shape; ensured by an identical ORT run when anything was written."""

    what = "writing Conv kernel_shape"

    def rewrite(self, model: ir.Model) -> int:
        return write_kernel_shapes(model)


class FloatInputWeightPass(ExactPass):
    """For a runtime that runs mixed graphs: a conv/linear whose activation input stays float keeps the weight
    values the quantized model computes, stored as floats (``float_pairs.store_float_weights``) instead of a
    DequantizeLinear run on every call; ensured by an identical ORT run."""

    what = "storing the weights of float-input ops as floats"

    def rewrite(self, model: ir.Model) -> int:
        target = self.ctx.target
        return float_pairs.store_float_weights(model) if target is not None and target.runs_mixed_graphs else 0

    def verify(self, proto: onnx.ModelProto) -> None:
        check_model(proto, self.what)


class PlacementPass(ir.passes.InPlacePass):
    """For a runtime that runs mixed graphs, the ONNX path's placement on the PyTorch path's file: a hard swish
    written out with a Q/DQ pair after its ops becomes one HardSwish between x's pair and the output's
    (``target_forms.hard_swish_one_op_quantized``, for ``Target.hard_swish_faster_as_one_op``), then the pairs
    no integer kernel reads are dropped (``float_pairs``, by the ONNX path's role table). Roundings go, so it is
    not exact: ensured by onnx.checker and an ORT run; the graph it leaves is the reference the later passes
    are proven against, the file's readings measure it against the torch model, and the CLI's fidelity
    judgement holds it to FP32."""

    def __init__(self, ctx: ExportContext):
        self.ctx = ctx
        self.counts: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        target = self.ctx.target if self.ctx.place_as_onnx else None
        if target is not None and target.hard_swish_faster_as_one_op and self.ctx.opset_version >= 14:
            self.counts["hard swish(es) as one HardSwish"] = target_forms.hard_swish_one_op_quantized(model)
        if target is not None and target.runs_mixed_graphs:
            self.counts["pair(s) between float ops dropped"] = float_pairs.drop_float_pairs(model)
        return ir.passes.PassResult(model, modified=any(self.counts.values()))

    def ensures(self, model: ir.Model) -> None:
        if not any(self.counts.values()):
            return
        what = "placing pairs as the ONNX path does (" + ", ".join(f"{v} {k}" for k, v in self.counts.items() if v) + ")"
        with step(f"export check: {what}"):
            proto = ir.to_proto(model)
            check_model(proto, what)
            self.ctx.rebase(proto)


class FloatReadsPass(ExactPass):
    """For a runtime that quantizes a float Conv/Gemm between a per-tensor pair itself (``Target.quantizes_float_convs``):
    each such op kept float reads its input through its own per-axis DequantizeLinear, the same values
    (``float_pairs.float_reads_per_axis``); ensured by an identical ORT run."""

    what = "keeping float convs float in the runtime"

    def rewrite(self, model: ir.Model) -> int:
        target = self.ctx.target
        return float_pairs.float_reads_per_axis(model) if target is not None and target.quantizes_float_convs else 0

    def verify(self, proto: onnx.ModelProto) -> None:
        check_model(proto, self.what)


# forms that write the same operation with another ONNX Runtime kernel whose float sums run in another order: a
# mean over H and W as GlobalAveragePool (on random NCHW tensors 2,827 of 3,489 means differed by an ulp or two
# from ReduceMean's, read literally), so a QuantizeLinear after it can round a value differently. Each is kept when
# the graph with it returns the produced graph's bytes; else when each op it wrote, run alone on the values the
# produced graph gives its inputs, quantizes within ``SAME_OP_STEPS`` of the produced one (``checks.same_op_steps``),
# and the graph with it becomes the reference of the later passes (as ``PlacementPass``'s does: the readings
# measure the file against the torch model, the fidelity judgement holds it to FP32); else it is left out (the file
# keeps the op as produced)
SAME_OP_FORMS = ("spatial_mean_as_global_pool",)
SAME_OP_STEPS = 1  # a sum summed in another order lands on the other side of a rounding boundary: one step


class TargetFormsPass(ExactPass):
    """The target's rewrites that apply to a quantized graph (``target_forms.exported_forms``: the ONNX path's
    PRelu written out for ONNX Runtime; a hard sigmoid's Clip(0, 1) as Relu6 for TiGrIS); ensured by
    onnx.checker and an identical ORT run."""

    def __init__(self, ctx: ExportContext):
        super().__init__(ctx)
        self.forms = target_forms.exported_forms(ctx.target) if ctx.target is not None else ()
        self.what = f"rewriting for {ctx.target.target}" if ctx.target is not None else "target rewrites"
        self.counts: dict[str, int] = {}
        self.dropped: dict[str, str] = {}  # a ``SAME_OP_FORMS`` form left out: why
        self.moved: dict[str, str] = {}  # a ``SAME_OP_FORMS`` form kept within ``SAME_OP_STEPS``: what moved
        self.proven: onnx.ModelProto | None = None  # the graph as the last form left it, proven identical by it

    def rewrite(self, model: ir.Model) -> int:
        self.counts, self.dropped, self.moved, self.proven = {}, {}, {}, None
        for form in self.forms:
            before = ir.to_proto(model) if form.name in SAME_OP_FORMS else None
            n = form.run(model)
            if n:
                self.proven = None
            if n and before is not None:
                after = ir.to_proto(model)
                try:
                    check_identical(after, self.ctx.reference, self.ctx.check_inputs, f"{self.what} ({form.name})")
                    self.proven = after
                except ExportRefused as exc:
                    steps = same_op_steps(before, after, self.ctx.check_inputs)
                    if steps is not None and steps <= SAME_OP_STEPS:
                        if any(self.counts.values()):  # the exact forms before it, proven before the reference moves
                            check_identical(before, self.ctx.reference, self.ctx.check_inputs, self.what)
                        self.moved[form.name] = f"each op it wrote within {steps} step(s) of the produced one"
                    else:  # the file keeps the op as produced; the target's check judges it
                        replace_model(model, ir.from_proto(before))
                        self.dropped[form.name] = one_line(exc)
                        logging.getLogger(__name__).warning("%s left out: %s", form.name, one_line(exc))
                        n = 0
            self.counts[form.name] = n
        return sum(self.counts.values())

    def verify(self, proto: onnx.ModelProto) -> None:
        check_model(proto, f"{self.what} ({', '.join(f'{k}: {v}' for k, v in self.counts.items() if v)})")

    def ensures(self, model: ir.Model) -> None:
        if not self.modified or not (self.moved or self.proven is not None):
            return super().ensures(model)
        with step(f"export check: {self.what}"):
            if self.moved:  # a same-op form moved a rounding: the graph is the new reference
                proto = ir.to_proto(model)
                self.verify(proto)
                self.ctx.rebase(proto)
            else:  # the last form's own identity run read this whole graph
                self.verify(self.proven)
                self.ctx.checked = self.proven


class ActivationDtypePass(ExactPass):
    """uint8 activations when asked; ensured by a node-by-node read-back, onnx.checker and identity.

    The optimized ORT run of this graph state is the written file's (metadata changes no output).
    """

    what = "moving activations to uint8"
    _before: GraphState | None = None  # the graph before the move (its nodes and Q/DQ parameters), for the read-back

    def rewrite(self, model: ir.Model) -> int:
        if self.ctx.activation_dtype != "uint8":
            return 0
        self._before = GraphState.of_ir(model)
        return to_uint8_activations(model)

    def changed(self, model: ir.Model) -> bool:
        return self.ctx.activation_dtype == "uint8"

    def verify(self, proto: onnx.ModelProto) -> None:
        before, self._before = self._before, None
        self.count = check_read_back(before, GraphState.of_proto(proto))
        check_model(proto, self.what)


class BinaryConstantDtypePass(ExactPass):
    """In a uint8 file, the stored int8 operand of an Add/Mul beside a uint8 activation moves to uint8
    (q + 128, z + 128), so ONNX Runtime fuses QLinearAdd/QLinearMul; ensured by an identical ORT run."""

    what = "moving Add/Mul constants to uint8"

    def rewrite(self, model: ir.Model) -> int:
        return constants_to_uint8(model) if self.ctx.activation_dtype == "uint8" else 0

    def verify(self, proto: onnx.ModelProto) -> None:
        check_model(proto, self.what)


class ReluRequantizePass(ExactPass):
    """For ONNX Runtime: a Q/DQ pair between a Conv/Gemm/MatMul and the Relu it feeds, where ORT could
    not fold that Relu into its QuantizeLinear (zero-point above the type's minimum), so the product
    fuses into an integer kernel; ensured by an identical ORT run."""

    what = "requantizing before a Relu"

    def rewrite(self, model: ir.Model) -> int:
        target = self.ctx.target
        if self.ctx.activation_dtype != "uint8" or (target is not None and not target.requantize_before_relu):
            return 0
        return requantize_before_relu(model)

    def verify(self, proto: onnx.ModelProto) -> None:
        check_model(proto, self.what)


class MetadataPass(ir.passes.InPlacePass):
    """Write the spec and provenance into metadata_props, and drop the exporter's per-node source text
    (stack traces with the machine's paths, FX node text; module scopes stay). No output changes."""

    def __init__(self, ctx: ExportContext):
        self.ctx = ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ctx = self.ctx
        write_metadata(model, ctx.spec, activation_dtype=ctx.activation_dtype,
                       target=ctx.target.target if ctx.target is not None else None)
        if ctx.algorithms:
            model.metadata_props[ALGORITHMS_KEY] = algorithms_summary(ctx.algorithms)
        strip_source_metadata(model)
        ctx.checked = None  # the model now differs from the last checked graph
        return ir.passes.PassResult(model, modified=True)


# The pass list: one place, run in order by export_qdq (each class is built with the ExportContext).
# Metadata first: it changes no output, and the last rewrite's checked graph is then the file's.
PASSES: tuple[Callable[[ExportContext], ir.passes.PassBase], ...] = (
    MetadataPass, LowerOpsetPass, KernelShapePass, FloatInputWeightPass, PlacementPass, TargetFormsPass,
    ActivationDtypePass, BinaryConstantDtypePass, ReluRequantizePass, FloatReadsPass,
)


def _check_opset(opset_version: int) -> None:
    if isinstance(opset_version, bool) or not isinstance(opset_version, int) or opset_version < LOWEST_OPSET:
        raise ValueError(f"opset_version={opset_version!r}: export_qdq writes opset {LOWEST_OPSET} or higher "
                         f"(per-axis QuantizeLinear/DequantizeLinear and the exporter's translation need it)")


def refuse_non_finite(sample: Any) -> None:
    """A sample holding NaN or infinite values is refused (``DataRefused``): every check and reading of
    the file runs on it, and a non-finite reference measures nothing."""
    for i, x in enumerate(capture.as_inputs(sample)):
        if getattr(x, "is_floating_point", lambda: False)() and not bool(x.isfinite().all()):
            which = f"sample input {i}" if isinstance(sample, (tuple, list)) else "the sample"
            raise DataRefused(f"{which} holds {int((~x.isfinite()).sum())} NaN or infinite value(s) of "
                              f"{x.numel()}: give a sample of real inputs (the file is checked and read on it)")


def resolve_dynamic_batch(dynamic_batch: bool | None, target: Target | None) -> bool:
    """``dynamic_batch`` as given, else the target preset's choice, else False (the sample's batch)."""
    if dynamic_batch is not None:
        if not isinstance(dynamic_batch, bool):
            raise ValueError(f"dynamic_batch={dynamic_batch!r} must be True, False or None (the target's choice)")
        return dynamic_batch
    return target.dynamic_batch if target is not None else False


def refuse_batch(model: Any, sample: Any, dynamic_batch: bool) -> None:
    """Refuse a sample or a symbolic batch this pt2e graph cannot run, with the reason torch.export gave."""
    if dynamic_batch:
        reason = capture.static_batch_reason(model)
        if reason:
            raise ExportRefused(
                f"dynamic_batch=True: this pt2e graph runs one batch size only ({reason}). Export it with "
                "dynamic_batch=False at that batch, or make the model's batch symbolic and quantize again.")
    fixed, batch = capture.static_batch_of(model), int(capture.as_inputs(sample)[0].shape[0])
    if not dynamic_batch and fixed and fixed != batch:
        raise ExportRefused(f"the sample holds {batch} input(s), but this pt2e graph runs batch {fixed} only "
                            f"({capture.static_batch_reason(model)}): export it with a sample of {fixed}")


def produce(model: Any, sample: Any, *, opset_version: int, dynamic_batch: bool,
            input_names: Sequence[str] | None, output_names: Sequence[str] | None) -> onnx.ModelProto:
    """The graph as the dynamo exporter produces it (opset 18, or the higher opset asked for).

    ``dynamic_batch``: the batch dimension is symbolic and named ``batch``; a graph captured at a
    static batch is refused with the reason torch.export gave at capture.
    """
    refuse_batch(model, sample, dynamic_batch)
    try:
        proto = capture.dynamo_export(
            model, sample, opset_version=max(opset_version, capture.EXPORTER_OPSET), dynamic_batch=dynamic_batch,
            input_names=input_names, output_names=output_names,
        )
    except Exception as exc:  # the exporter raises many types; name the step and keep the cause
        what = "with a symbolic batch " if dynamic_batch else ""
        raise ExportRefused(f"the dynamo ONNX exporter failed {what}on {type(model).__name__}: "
                            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}") from exc
    if dynamic_batch and not capture.batch_dim_is_dynamic(proto):
        raise ExportRefused("dynamic_batch=True: the exporter kept the batch dimension fixed for this graph; "
                            "export with dynamic_batch=False")
    return proto


def _export_sample(model: Any, sample: Any, dynamic_batch: bool | None, target: Target | None) -> Any:
    # a target whose preset is static (tigris) gets a batch-1 file whenever the graph can run batch 1
    if dynamic_batch is not None or target is None or target.dynamic_batch:
        return sample
    if capture.static_batch_reason(model):
        return sample
    inputs = capture.as_inputs(sample)
    cut = tuple(x[:1] for x in inputs)
    return cut if isinstance(sample, (tuple, list)) else cut[0]


# Bytes of weights (stored and dequantized) one literal session of the export's checks holds: a quarter of the
# ONNX path's part. Here the user's float model and the quantized one stay resident beside the checks (the ONNX
# path holds neither), so a large model's checks run a few layers at a time in smaller parts (bench/scale.py
# --methods pt2e: 1 GiB parts peaked 0.75 GB higher at 2 GB of float weights); a file whose weights dequantize to
# less runs in one session, as before.
EXPORT_PART_BYTES = LITERAL_PART_BYTES // 4
# stored bytes from which the export collects the cycles it let go (an onnx_ir model holds every weight until the
# collector runs) before the next step: a collection costs about 0.25 s, worth it only where it frees hundreds of MB
COLLECTED_FROM_BYTES = 64 << 20
# A produced graph of LARGE_MODEL_BYTES of stored tensors or more keeps those of OFFLOADED_FROM bytes or more in a data
# file in WEIGHTS_FOLDER of the work folder while the passes run: its in-memory graph refers to them, each check maps
# them, and the file is written with them back inside. The graph as protobuf held them (one copy) and each pass's
# checked graph another (bench/scale.py --methods pt2e at 4 GB of float: 1 GB each, beside the user's two models).
WEIGHTS_FOLDER = "weights"
OFFLOADED_FROM = 1 << 20

REFERENCE_ROWS = 2  # rows per torch forward of the reference when the graph's batch is symbolic


def reference_batches(sample: Any, dynamic_batch: bool) -> list[Any]:
    """The sample cut into forwards of ``REFERENCE_ROWS`` rows (the last one takes an odd row) when the
    graph serves any batch, else the whole sample in one forward.

    The rows of a batch are independent in an eval-mode graph, so the reference is the same model on
    the same inputs; a pt2e forward keeps several quantized and dequantized copies of every activation
    alive, and at a batch of 8 ResNet-18's adds about 150 MB to the process's peak, against about 50 MB
    two rows at a time.
    """
    inputs = capture.as_inputs(sample)
    rows = int(inputs[0].shape[0]) if inputs and getattr(inputs[0], "ndim", 0) else 0
    if not dynamic_batch or rows < 2 * REFERENCE_ROWS:
        return [sample]
    starts = list(range(0, rows, REFERENCE_ROWS))
    if rows - starts[-1] < REFERENCE_ROWS:  # a short last cut joins the one before (a 1-row batch may not run)
        starts.pop()
    bounds = list(zip(starts, [*starts[1:], rows]))
    return [tuple(x[a:b] for x in inputs) if isinstance(sample, (tuple, list)) else inputs[0][a:b]
            for a, b in bounds]


def read_twice(path: Path, inputs: list[np.ndarray], literal: list[np.ndarray] | None,
               scales: dict[str, float | None], reference: list[np.ndarray]) -> Readings:
    """The written file's two readings on the sample, every output in its own LSB (``scales``: the
    file's output names and scales, in order): one optimized session (which must run, with finite
    outputs: the fused reading) and the literal outputs, run on the file unless already proven."""
    with step("export check: runs with ORT optimizations on"):
        fused = check_runs_optimized(path, inputs, "the written file")
    with step("export check: ORT readings vs torch"):
        if literal is None:
            try:
                literal = run_session(ort_session(path, optimized=False), inputs)
            except Exception as exc:  # ORT raises its own exception types
                raise ExportRefused(f"the written file: ONNX Runtime cannot run it literally "
                                    f"({type(exc).__name__}: {one_line(exc)})") from exc
        return readings_of_outputs(list(scales), scales, literal, fused, reference)


@rank_zero_writes("export_qdq")
def export_qdq(
    model: Any,
    sample: Any,
    path: str | Path,
    *,
    opset_version: int = 18,
    activation_dtype: str | None = None,
    dynamic_batch: bool | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    target: str | Target | None = None,
    place_as_onnx: bool = False,
) -> Path:
    """Export a pt2e-quantized model to QDQ ONNX at ``path``, keeping its scales, zero-points and axes.

    ``place_as_onnx``: also run ``PlacementPass`` (the ONNX path's hard swish as one op and its dropped pairs
    between float ops, for a target that runs mixed graphs): faster on such graphs, but the file then differs
    from the quantized torch model by the roundings it removes (up to 4 LSB measured on a small Llama), so
    it is asked for, never the default: by default the file is the quantized model, exactly.

    A model with 16-bit activations (``Quantizer(int16=...)``) is written at opset 21 at least, the first opset whose
    QuantizeLinear / DequantizeLinear take 16-bit zero-points.

    ``activation_dtype``: ``'int8'`` (default; zero-point as quantized) or ``'uint8'`` (activation
    zero-points shifted by 128, same scales; weights stay int8). ``target`` takes the activation
    dtype from the deployment preset, records the target, and refuses a file that target's rules
    would not accept; when not given, the preset the model was quantized for
    (``Quantizer.for_target``) is used. ``dynamic_batch``: a symbolic batch dimension named
    ``batch`` (the file serves any batch); ``None`` takes the target preset's choice (dynamic for
    onnxruntime-cpu, openvino and tensorrt; a static batch 1 for tigris), the given target's or the
    travelled preset's, and without either the sample's static batch. Refusals raise ``quantship.errors.ExportRefused`` (a ``ValueError``) and
    leave nothing at ``path`` (a file already there is kept as it was).

    Inside a ``torch.distributed`` process group, call it on every rank: rank 0 writes, the other
    ranks wait at a barrier and return the same path (rank 0's refusal is raised on every rank);
    a call on some ranks only is refused after ``QUANTSHIP_DIST_TIMEOUT`` seconds (default 300).

    The file is read on ``sample`` twice in ONNX Runtime, literally (when the identity checks ran
    on the whole sample, their run of the same graph) and with its default optimizations; the
    returned ``Path`` carries both readings (``.readings``: max LSB vs the torch model, and their
    gap), and ``FusedKernelDrift`` is warned when they differ by more than 2 LSB.

    A model that returns a tuple, a dict or a transformers ``ModelOutput`` gets one graph output per
    tensor, in its order, named after its key (``out``, ``logits``; ``output_<i>`` in a tuple) unless
    ``output_names`` names them (a single tensor: ``output``, as ``export_onnx`` names it); every
    output is checked and read, each in its own LSB
    (``.readings.per_output``; the top-level figures are the worst output's). A None or non-tensor
    output is refused by name.
    """
    artifact.refuse_unsafe_destination(path)  # before any work: never onto a source, a data file or a device
    refuse_non_finite(sample)
    target = targets.get(target) if target is not None else None  # the one look-up: a Target from here on
    spec = exportable_spec(model)
    if weight_only.is_weight_only(spec):  # W8A16 / W4A16: their own writer (DequantizeLinear or MatMulNBits)
        return weight_only.export_weight_only(model, sample, path, spec, opset_version=opset_version, target=target,
                                              dynamic_batch=dynamic_batch, input_names=input_names,
                                              output_names=output_names)
    if target is None:  # the preset the model was quantized for travels with it, unless an explicit
        travelled = quant_preset(model)  # activation_dtype asks for another file
        if travelled is not None and activation_dtype in (None, travelled.activation_dtype):
            target = travelled
    dtype = resolve_activation_dtype(activation_dtype, target)
    _check_opset(opset_version)
    if spec.int16 and opset_version < INT16_OPSET:  # a model with 16-bit activations is written at opset 21 at least
        opset_version = INT16_OPSET
    dynamic = resolve_dynamic_batch(dynamic_batch, target)
    sample = _export_sample(model, sample, dynamic_batch, target)
    # the torch reference first: a forward right after torch.export of the same module was measured 3-10x
    # slower on CPU (ResNet-18 pt2e, batch 1: 3.0 s instead of 0.3 s)
    refuse_batch(model, sample, dynamic)
    names, reference = reference_outputs(model, reference_batches(sample, dynamic), sample)
    output_names = graph_output_names(names, reference, output_names)
    with artifact.atomic_destination(path) as staged, parts_of_at_most(EXPORT_PART_BYTES), \
            large_blocks_mapped(module_bytes(model)):
        with step("export: torch.onnx.export (dynamo)"):
            produced = produce(model, sample, opset_version=opset_version, dynamic_batch=dynamic,
                               input_names=input_names, output_names=output_names)
            check_outputs_line_up(produced, reference)
        stored = sum(t.ByteSize() for t in produced.graph.initializer)
        large = stored >= COLLECTED_FROM_BYTES
        folder = None
        if stored >= LARGE_MODEL_BYTES:  # every check maps the weights from a file instead of copying them
            folder = staged.parent / WEIGHTS_FOLDER
            folder.mkdir()
            produced, _ = weights_to_disk(produced, folder, OFFLOADED_FROM)
        # a large model's exporter programs and graphs (cycles), freed: the proto is what the passes read
        give_back(collect=large)
        inputs = capture.as_arrays(sample)
        with tensors_in(folder):
            ctx = ExportContext(spec=spec, opset_version=opset_version, activation_dtype=dtype, target=target,
                                inputs=inputs, produced=produced, probe=one_row_probe(produced, inputs),
                                algorithms=getattr(model, ALGORITHMS_ATTRIBUTE, None), place_as_onnx=place_as_onnx)
            model_ir = ir.from_proto(produced)
            if folder is not None:
                ir.external_data.set_base_dir(model_ir.graph, folder)
            run_passes([make(ctx) for make in PASSES], model_ir)
            final = ctx.checked if ctx.checked is not None else ir.to_proto(model_ir)
            wide = sixteen_bit_values(final)
            if wide:  # provenance (no output changes): the activations stored in 16 bits
                final.metadata_props.append(onnx.StringStringEntryProto(key=INT16_KEY, value=", ".join(wide)))
            # the file is the last checked graph (or the produced one plus metadata, which changes no
            # output): read literally on the whole sample, it returns the reference bytes
            literal = ctx.reference if ctx.probe is None else None
            del model_ir, ctx, produced
            give_back(collect=large)  # the passes' graphs (cycles) and sessions, their pages back to the kernel
        if folder is not None:  # the weights back in the graph, the only copy held now
            onnx.external_data_helper.load_external_data_for_model(final, str(folder))
        with step("export: writing the file"):
            artifact.save_model(final, staged)
        del final
        with step("export check: the file holds the spec"):
            facts = read_file(staged)
            check_spec_held(facts, spec, activation_dtype=dtype, opset_version=opset_version, int16_tensors=wide)
        if target is not None:
            with step(f"export check: {target.target} rules"):
                check_target(facts, target)
        scales = dict(facts.output_scales)
        del facts
        give_back(collect=large)
        readings = read_twice(staged, inputs, literal, scales, reference)
    out = MeasuredPath.of(Path(path).expanduser().resolve(), readings)  # a Path; .readings: both ORT readings
    logging.getLogger(__name__).info("%s: %s", out, readings)
    warn_if_drift(readings, str(out), stacklevel=3, seven_bit=spec.reduce_range)  # 3: past rank_zero_writes
    return out
