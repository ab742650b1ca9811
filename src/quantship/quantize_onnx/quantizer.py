"""``quantize_onnx_file``: a float ONNX file to a verified INT8 QDQ file, with quantship's own engine.

The steps, each its own module: normalise (``normalize``, every pass proven in ONNX Runtime), probe
and calibrate (``calibrate``), plan and write the Q/DQ pairs (``roles``, ``place``), then the same
guarantees as ``export_qdq``: the export post-conditions and the target's rules on the written file,
provenance in ``metadata_props``, both ONNX Runtime readings, the census of what ONNX Runtime runs,
and the verdict of ``quantship check --run``. Nothing appears at the destination unless every check
passed (``export.artifact``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantship import targets
from quantship.errors import ExportRefused, FileRefused, SpecRefused, cause
from quantship.export import artifact, float_pairs, target_forms
from quantship.export.checks import run_passes
from quantship.export.kernel_shape import write_kernel_shapes
from quantship.export.metadata import ALGORITHMS_KEY, add_file_metadata, algorithms_summary, write_metadata
from quantship.export.ort_quantize import refuse_quantized
from quantship.export.postconditions import check_spec_held as check_spec
from quantship.export.postconditions import check_target
from quantship.export.roles import Placement
from quantship.fidelity import METADATA_KEY as FIDELITY_KEY
from quantship.fidelity import Budget, Fidelity, widened
from quantship.fidelity import measure as measure_fidelity
from quantship.inspect.judge.check import check_file
from quantship.inspect.judge.reference import SOURCE_KEY, source_record
from quantship.inspect.read.facts import read_file
from quantship.inspect.read.feeds import Feed, as_feeds, model_inputs
from quantship.inspect.read.loading import load_onnx
from quantship.inspect.read.lsb import output_scales
from quantship.inspect.run.consumers import fidelity_reading, joined, native_runtime, ort_optimized_ops, ort_session
from quantship.inspect.run.literal import parts_of_at_most, run_feeds
from quantship.inspect.run.verify import readings_of_outputs
from quantship.precision import ACT_OBSERVERS, resolve_spec
from quantship.quantize.algorithms.bias_correction import SAMPLES as BIAS_SAMPLES
from quantship.quantize_onnx import bias_correction as bias_correcting
from quantship.quantize_onnx import calibrate, memory, normalize, place, recurrent, selection
from quantship.quantize_onnx import equalize as equalizing
from quantship.quantize_onnx import int16 as sixteen
from quantship.quantize_onnx import smooth_quant as smoothing
from quantship.quantize_onnx.memory import refuse_if_too_large, slice_budget
from quantship.recipe import takes_algorithms
from quantship.targets import Target
from quantship.targets.target import wide_dtype

ENGINE_KEY = "quantship.engine"
ENGINE = "quantize_onnx"
NORMALISED_KEY = "quantship.normalised"
PROOF_SAMPLES = 16  # calibration samples each normalisation pass is proven on
READING_SAMPLES = 64  # calibration samples the written file is read on (both readings, fidelity, check --run)
INTEGER_KERNELS = ("QLinearConv", "QLinearMatMul", "QGemm", "MatMulIntegerToFloat", "ConvInteger", "MatMulInteger",
                   "QLinearConvTranspose", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM")
# every float compute kernel, recurrent layers included (a file whose float LSTMs do the work says so)
FLOAT_KERNELS = ("Conv", "FusedConv", "ConvTranspose", "MatMul", "FusedMatMul", "Gemm", "FusedGemm", "LSTM", "GRU",
                 "RNN")


@dataclass
class FloatReference:
    """The float file's outputs on the samples a quantize call reads (``read``) and holds out (``held``): run once
    per call and shared by every file the call makes (the repair's steps, placement by profile, the runtime's
    confirmation), each of which would otherwise run the float file on the same samples again. ``key`` names
    the float file and the sample counts it was run on; another key is run afresh, never served stale."""

    key: tuple | None = None
    read: list | None = None
    held: list | None = None
    runs: int = 0  # float sessions run to fill it (what sharing it saves is counted by the tests)

    def outputs(self, key: tuple, float_file: Any, read_on: Sequence[Feed],
                held_out: Sequence[Feed] | None) -> tuple[list, list | None]:
        """The float outputs on ``read_on`` and ``held_out`` for ``key``, run only when not already held."""
        if self.key != key:
            self.key, self.read, self.held = key, None, None
        if self.read is None:
            self.read = _run(_session(float_file, optimized=True), read_on)  # FP32 as users run it
            self.runs += 1
        if held_out is not None and self.held is None:
            self.held = _run(_session(float_file, optimized=True), held_out)
            self.runs += 1
        return self.read, (self.held if held_out is not None else None)

    def held_for(self, src: Path, feeds: Sequence[Feed], held_out: bool) -> list | None:
        """The outputs already run on ``feeds`` (the held-out samples, or else the read ones) of ``src``, or None."""
        if self.key is None:
            return None
        key = reference_key(src, [] if held_out else feeds, feeds if held_out else None)
        same = key[:2] == self.key[:2] and (key[3] == self.key[3] if held_out else key[2] == self.key[2])
        return (self.held if held_out else self.read) if same else None


def reference_key(src: Path, read_on: Sequence[Feed], held_out: Sequence[Feed] | None) -> tuple:
    """What a ``FloatReference`` is valid for: the float file as it is on disk, and the samples (each array's
    name, shape, dtype and sum: another draw of the same shape is another key)."""
    stat = src.stat() if src.is_file() else None
    return (str(src.resolve()), stat and (stat.st_size, stat.st_mtime_ns), _fingerprint(read_on),
            _fingerprint(held_out) if held_out is not None else None)


def _fingerprint(feeds: Sequence[Feed]) -> tuple:
    return tuple(tuple((k, v.shape, str(v.dtype), float(np.sum(v, dtype=np.float64))) for k, v in f.items())
                 for f in feeds)


@dataclass(frozen=True)
class PassRecord:
    """One normalisation pass as it ran: changes made, its proof, the largest output difference."""

    name: str
    changes: int
    proof: str
    max_abs_diff: float | None  # None: nothing changed, nothing to prove


def normalised_summary(records: Sequence[PassRecord]) -> str:
    """The file's ``NORMALISED_KEY`` value: each pass that changed something and how many times, or none."""
    return ", ".join(f"{r.name}: {r.changes}" for r in records if r.changes) or "none"


@dataclass
class OnnxQuantizeResult:
    """What ``quantize_onnx_file`` wrote and measured."""

    path: Path | None
    target: str
    placement: Placement
    normalised: list[PassRecord]
    plan: dict
    counts: dict
    qdq_stats: Any  # inspect.read.stats.QDQStats
    readings: Any  # inspect.run.verify.Readings (literal and fused, against the float file)
    fidelity: dict  # agreement and error against the float file, both readings: the first output's, and
    # with several outputs each one's under ``per_output`` (by graph output name)
    census: dict  # what ONNX Runtime's optimized graph runs: integer vs float compute kernels
    verdict: Any  # inspect.judge.check.CheckReport (check --run)
    spec: Any  # precision.QuantSpec recorded in the file
    excluded: list[str] = field(default_factory=list)
    algorithms: dict = field(default_factory=dict)  # name -> what it changed (equalize, seq_mse, adaround, ...)
    int16: list[str] = field(default_factory=list)  # activation tensors stored in 16 bits (``int16``)
    fp32: Any = None  # quantship.fidelity.Fidelity: each output against the float file, judged by the budget
    speed: Any = None  # inspect.run.speed.SpeedReading: against the float file on this CPU (None: not timed)
    profile: Any = None  # profile_place.ProfilePlacement: what the profile kept float for speed (None: not run)

    def move_to(self, final: Path, src: Path, wait: bool) -> OnnxQuantizeResult:
        """The file, written in a scratch folder, moved into place at ``final`` (``artifact.atomic_destination``:
        ``src`` is never overwritten); its path and verdict's path are then ``final``."""
        with artifact.atomic_destination(final, wait=wait, inputs=(src,)) as staged:
            artifact.move_with_data(Path(self.path), staged)
        self.path = final
        self.verdict.path = str(final)
        return self

    def as_dict(self) -> dict:
        return {"path": str(self.path) if self.path else None, "target": self.target, "engine": ENGINE,
                "placement": self.placement.as_dict(), "normalised": [asdict(p) for p in self.normalised],
                "plan": self.plan, "counts": self.counts, "qdq_stats": self.qdq_stats.as_dict(),
                "readings": self.readings.as_dict() if self.readings else None, "fidelity": self.fidelity,
                "census": self.census, "verdict": self.verdict.verdict, "check": self.verdict.as_dict(),
                "spec": self.spec.as_dict(), "excluded": self.excluded, "algorithms": self.algorithms,
                "int16": self.int16, "fidelity_fp32": self.fp32.as_dict() if self.fp32 is not None else None,
                "speed": self.speed.as_dict() if self.speed is not None else None,
                "placement_by_profile": self.profile.as_dict() if self.profile is not None else None}


def placement_for(target: str | Target, *, per_tensor: bool = False) -> tuple[Placement, Target, Any]:
    """The placement a target's preset asks for, and what its file rules demand (a target that refuses
    a mixed graph gets ``full`` placement; one that runs it keeps its float rules)."""

    p = targets.get(target)
    spec = resolve_spec(**p.spec_kwargs)
    mixed = p.runs_mixed_graphs
    placement = Placement(mode="integer" if mixed else "full", activation_dtype=p.activation_dtype,
                          symmetric=spec.symmetric, weight_bound=63 if spec.reduce_range else 127,
                          per_channel=spec.qscheme == "per_channel" and not per_tensor,
                          float_rules=p.float_rules if mixed else (), float_output_ops=p.float_output_ops if mixed else ())
    return placement, p, spec


def refuse_unusable(model: onnx.ModelProto, path: str | Path) -> None:
    """Already-quantized files and files that declare a weight as an input a caller may feed are refused
    before any work."""
    refuse_quantized(model, path)
    refuse_weight_inputs(model, path)
    refuse_half_precision(model, path)


HALF = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16"}


def refuse_half_precision(model: onnx.ModelProto, path: str | Path) -> None:
    """A float16 / bfloat16 model is refused by name: its ranges and the INT8 file's float parts are float32."""
    found = [(v.name, HALF[v.type.tensor_type.elem_type]) for v in (*model.graph.input, *model.graph.output)
             if v.type.tensor_type.elem_type in HALF]
    found += [(t.name, HALF[t.data_type]) for t in model.graph.initializer if t.data_type in HALF]
    if found:
        kinds = sorted({k for _, k in found})
        raise FileRefused(f"{path} is a {'/'.join(kinds)} model ({len(found)} input(s), output(s) or weight(s), e.g. "
                          f"{found[0][0]!r}); quantship quantizes float32 models: give the float32 file (export it "
                          "before any conversion to half precision)")


def refuse_weight_inputs(model: onnx.ModelProto, path: str | Path) -> None:
    """Refuse a file (IR 4 or later) whose graph inputs list initializers: each is a weight a caller may
    override at run time (``keep_initializers_as_inputs=True``), an input of the float file's interface that
    the INT8 file cannot keep, since it stores that weight as int8 and an override would change nothing.
    (Below IR 4 every initializer is listed as an input by rule and ONNX Runtime reads them as constants.)"""
    if model.ir_version < 4:
        return
    stored = {t.name for t in model.graph.initializer}
    declared = [i.name for i in model.graph.input if i.name in stored]
    if declared:
        shown = ", ".join(repr(n) for n in declared[:3]) + (f" and {len(declared) - 3} more" if len(declared) > 3 else "")
        raise FileRefused(
            f"{path}: input(s) {shown} are also initializers (weights a caller may override at run time, as "
            "keep_initializers_as_inputs=True writes them); the INT8 file stores its weights as int8, so it cannot "
            "keep those inputs: export without keep_initializers_as_inputs, or drop them from graph.input, and "
            "quantize again")


def _session(model: onnx.ModelProto | Path, optimized: bool = False, base_dir: str | None = None):

    return ort_session(model, optimized=optimized, base_dir=base_dir)


def external_dir(model: ir.Model) -> str | None:
    """The folder ``model``'s weights are mapped from when it was read lazily (``ir.load`` of a file with
    external data); None when every weight is in memory."""
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            return value.const_value.base_dir
    return None


def _ir_session(model: ir.Model, optimized: bool = False):
    """A session of ``model`` as it is now, literal unless ``optimized``; weights still on disk are mapped by ONNX
    Runtime, not copied."""
    return _session(ir.to_proto(model), optimized=optimized, base_dir=external_dir(model))


def _run(session, feeds: Sequence[Feed]) -> list[np.ndarray]:
    """Every output over every feed, concatenated along the batch."""
    return joined(run_feeds(session, feeds))


def read_both(path: Path, feeds: Sequence[Feed], what: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The written file's outputs over ``feeds``, read literally (ORT's optimizations off) and fused (its
    defaults); refused when ONNX Runtime cannot run it, or a fused float output is not finite."""
    try:
        literal = _run(_session(path), feeds)
        fused = _run(_session(path, optimized=True), feeds)
    except Exception as exc:
        raise ExportRefused(f"ONNX Runtime cannot run the {what} file: {cause(exc)}") from exc
    if not all(np.isfinite(o).all() for o in fused if o.dtype.kind == "f"):
        raise ExportRefused(f"the {what} file gives NaN or infinite outputs in ONNX Runtime")
    return literal, fused


def first_feeds(feeds: Sequence[Feed], samples: int = PROOF_SAMPLES) -> list[Feed]:
    """The leading batches holding at least ``samples`` samples (all of them when fewer)."""
    chosen, n = [], 0
    for feed in feeds:
        chosen.append(feed)
        n += len(next(iter(feed.values())))
        if n >= samples:
            break
    return chosen


class ProvenPass(ir.passes.InPlacePass):
    """A ``normalize.Pass`` on onnx-ir's pass infrastructure: ``call`` rewrites, ``ensures`` proves the rewrite
    on the calibration data in ONNX Runtime read literally (an ``"exact"`` pass gives the same bytes, a
    ``"float"`` one agrees within ``normalize.FLOAT_TOLERANCE``), as ``export.checks.ExactPass`` does for the
    export's rewrites. ``proof`` carries the feeds and the outputs before; ``records`` receives the pass."""

    def __init__(self, p: normalize.Pass, proof: dict, records: list[PassRecord]):
        self.p, self.proof, self.records, self.changes = p, proof, records, 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        try:
            self.changes = self.p.run(model)
        except Exception as exc:  # a converter or an attribute the pass cannot read: the file is not supported
            raise ExportRefused(f"normalisation pass {self.p.name} failed on the file: {cause(exc)}") from exc
        return ir.passes.PassResult(model, modified=bool(self.changes))

    def ensures(self, model: ir.Model) -> None:
        name, before = self.p.name, self.proof["before"]
        if not self.changes:
            self.records.append(PassRecord(name, 0, self.p.proof, None))
            return
        try:
            after = _run(_ir_session(model), self.proof["feeds"])
        except Exception as exc:
            raise ExportRefused(f"normalisation pass {name} broke the file (ONNX Runtime cannot run it: "
                                f"{cause(exc)})") from exc
        diffs = [_max_diff(a, b) for a, b in zip(before, after)]
        worst = max(diffs) if diffs else 0.0
        if self.p.proof == "exact":
            same = all(a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
                       for a, b in zip(before, after))
            if not same:
                raise ExportRefused(f"normalisation pass {name} changed the outputs (max abs diff {worst:.3g}); "
                                    "refusing to quantize a rewritten model that is not the same model")
        else:
            scale = max((float(np.abs(a).max()) for a in before if a.size and a.dtype.kind == "f"), default=1.0)
            if worst > normalize.FLOAT_TOLERANCE * max(scale, 1e-6):  # then, and only then, the model's own noise
                noise = _float_noise(model, self.proof["feeds"], after)
                if worst > normalize.NOISE_FACTOR * noise:
                    raise ExportRefused(f"normalisation pass {name} moved the outputs by {worst:.3g} (tolerance "
                                        f"{normalize.FLOAT_TOLERANCE:g} x {scale:.3g}, or {normalize.NOISE_FACTOR:g} "
                                        f"x the {noise:.3g} ONNX Runtime's own optimizations move them by)")
        self.records.append(PassRecord(name, self.changes, self.p.proof, worst))
        self.proof["before"] = after


def _float_noise(model: ir.Model, feeds: Sequence[Feed], literal: list[np.ndarray]) -> float:
    """How far ONNX Runtime's own default optimizations (its Conv + BatchNormalization fusion, its reordered
    sums) move the float model's outputs from its literal reading (``literal``): the float rounding this model
    amplifies. A ``"float"`` pass that moves them no more than a few times this is float rounding too (a deep
    random network with re-estimated BatchNorms amplified a last-bit change to 1e-4 of its output: untrained
    EfficientNet-B0, where ORT's own fusion moved it by 0.0507 and folding its spatial means into pools by
    0.0487). Measured only when the fixed tolerance is passed; 0 when the optimized session cannot run."""
    try:
        fused = _run(_ir_session(model, optimized=True), feeds)
    except Exception:  # noqa: BLE001 - ONNX Runtime's own exception types; the literal reading ran
        return 0.0
    return max((_max_diff(a, b) for a, b in zip(literal, fused) if a.dtype.kind == "f"), default=0.0)


def normalise(model: ir.Model, feeds: Sequence[Feed], passes: Sequence[normalize.Pass] | None = None
              ) -> list[PassRecord]:
    """Run ``passes`` (``normalize.PASSES``, then a target's ``target_forms``) in order with onnx-ir's pass
    manager, each proven in its ``ensures()`` (``ProvenPass``); a refusal surfaces as itself."""
    proof = {"feeds": first_feeds(feeds)}
    proof["before"] = _run(_ir_session(model), proof["feeds"])
    records: list[PassRecord] = []
    run_passes([ProvenPass(p, proof, records) for p in (normalize.PASSES if passes is None else passes)], model)
    return records


def feeds_for(p: Target, feeds: Sequence[Feed]) -> list[Feed]:
    """The calibration feeds as ``p``'s file takes them: one sample each for a batch-1 target."""
    return target_forms.one_sample_feeds(feeds) if not p.dynamic_batch else list(feeds)


@dataclass
class Prepared:
    """The float model as the quantizer plans it: normalised (with the target's forms, each proven),
    probed for shapes and dtypes, and placed. ``quantize_onnx_file`` and the per-node SQNR report
    (``sensitivity.node_sqnr``) both start here, so they plan the same file."""

    model: ir.Model  # normalised, to receive the Q/DQ pairs
    normal: onnx.ModelProto  # the same, as the float reference every tensor is read from
    records: list[PassRecord]
    info: dict  # calibrate.TensorInfo per tensor
    excluded: set[int]
    layout: place.Plan
    recurrent_plan: recurrent.RecurrentPlan  # the LSTM/GRU/RNN nodes: which run as integer kernels, why others stay float
    smoother: smoothing.Smoother | None = None  # what SmoothQuant did, when it ran
    base_dir: str | None = None  # where ``normal``'s external tensors are mapped from (None: all in memory)


def prepare(proto: onnx.ModelProto | ir.Model, inputs: Sequence[Any], feeds: Sequence[Feed], p: Target, placement: Placement,
            exclude: Iterable[str] = (), *, equalize: bool = False, int16: bool = False,
            smooth_quant: float | None = None, shared_scale: Iterable[str] = ()) -> Prepared:
    """Normalise ``proto`` for ``p`` (``normalize.PASSES``, cross-layer equalization if asked, then the
    target's ``target_forms``, then opset 21 if ``int16``), probe it on the first feed and plan its Q/DQ
    pairs; ``feeds`` as ``feeds_for`` gives them. An ``ir.Model`` read lazily (``ir.load``) keeps its
    unchanged weights on disk: the sessions map them from there."""
    model = proto if isinstance(proto, ir.Model) else ir.from_proto(proto)
    forms = target_forms.passes_for(p, feeds[0], lambda m: _run(_ir_session(m), feeds[:1]))
    smoother = smoothing.Smoother(smooth_quant, feeds) if smooth_quant is not None else None
    extra = (((equalizing.PASS,) if equalize else ()) + ((smoothing.smoothing_pass(smoother),) if smoother else ())
             + forms + ((sixteen.OPSET_PASS,) if int16 else ()))
    records = normalise(model, feeds, (*normalize.PASSES, recurrent.FOLD_PASS, *extra))
    normal = ir.to_proto(model)
    base_dir = external_dir(model)
    fixed_batch = not p.dynamic_batch or any(i.dims and i.dims[0] is not None for i in inputs)
    info = calibrate.probe(normal, feeds[0], one_sample=not fixed_batch, base_dir=base_dir)
    excluded = selection.resolve_excludes(list(model.graph), exclude)
    shared = selection.resolve_shared_scale(list(model.graph), shared_scale)
    layout = place.plan(model, info, placement, excluded, shared)
    return Prepared(model, normal, records, info, excluded, layout, recurrent.plan(layout.nodes, excluded, p), smoother,
                    base_dir)


def unmap(tensors: Sequence[ir.ExternalTensor]) -> None:
    """Close the mappings of the float file's weights (their pages leave the resident set); a tensor a view
    still reads keeps its mapping until that view goes."""
    for tensor in tensors:
        try:
            tensor.release()
        except BufferError:
            pass


def largest_tensor(names: Sequence[str], info: dict) -> tuple[int, str]:
    """(bytes, name) of the largest of ``names`` for one sample: the smallest calibration slice possible."""
    sizes = [(info[n].bytes_per_sample, n) for n in names if n in info]
    return max(sizes, default=(0, ""))


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.dtype.kind not in "fiu" or a.size == 0:
        return 0.0 if np.array_equal(a, b) else float("inf")
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


def census(path: Path) -> dict:
    """What ONNX Runtime's optimized graph of ``path`` runs: integer and float compute kernels
    (Conv/MatMul/Gemm, and the recurrent LSTM/GRU/RNN)."""

    ops = ort_optimized_ops(path)
    integer = {k: v for k, v in sorted(ops.items()) if k in INTEGER_KERNELS}
    floating = {k: v for k, v in sorted(ops.items()) if k in FLOAT_KERNELS}
    return {"integer": integer, "float": floating, "n_integer": sum(integer.values()),
            "n_float": sum(floating.values()), "n_quantize": ops.get("QuantizeLinear", 0),
            "n_dequantize": ops.get("DequantizeLinear", 0)}


def fidelity_of_outputs(names: list[str], reference: list[np.ndarray], literal: list[np.ndarray],
                        fused: list[np.ndarray]) -> dict:
    """``_fidelity`` of the first output, and with several outputs of each one under ``per_output``."""
    each = {name: _fidelity(reference[k], literal[k], fused[k]) for k, name in enumerate(names)}
    first = each[names[0]]
    return first if len(names) == 1 else {**first, "per_output": each}


def check_outputs_kept(float_names: list[str], names: list[str], reference: list[np.ndarray],
                       literal: list[np.ndarray]) -> None:
    """The written file has the float file's outputs: the same names in the same order, each of the
    same shape and dtype on the same inputs (every output is then read against its own reference)."""
    if names != float_names:
        raise ExportRefused(f"the quantized file's outputs {names} are not the float file's {float_names}")
    for name, ref, got in zip(names, reference, literal):
        if ref.shape != got.shape or ref.dtype != got.dtype:
            raise ExportRefused(f"output {name!r} is {got.dtype} {list(got.shape)} in the quantized file and "
                                f"{ref.dtype} {list(ref.shape)} in the float file: not the same model")


def _fidelity(reference: np.ndarray, literal: np.ndarray, fused: np.ndarray) -> dict:
    def one(out: np.ndarray) -> dict:
        diff = np.abs(out.astype(np.float64) - reference.astype(np.float64))
        agree = float((out.argmax(-1) == reference.argmax(-1)).mean()) if reference.ndim >= 2 else None
        return {"argmax_agreement": agree, "max_abs_error": float(diff.max()), "mean_abs_error": float(diff.mean())}

    gap = float(np.abs(literal.astype(np.float64) - fused.astype(np.float64)).max())
    return {"literal": one(literal), "fused": one(fused), "fused_vs_literal_max_abs": gap,
            "n_values": int(reference.size), "reference_max_abs": float(np.abs(reference).max())}


def fidelity_to_float(path: Path, p: Target, names: list[str], held: tuple[list[Feed], list[np.ndarray]] | None,
                      read: tuple[list[Feed], list[np.ndarray], list[np.ndarray], list[np.ndarray]],
                      budget: Budget | None) -> Fidelity:
    """Each output of the file at ``path`` against the float file's: on ``held`` (feeds, float outputs) when
    given (with the calibration samples when the held-out ones count too few decisions: ``fidelity.widened``),
    else on the calibration samples already read (``read``: feeds, float, literal, fused outputs)."""
    fused_reading, runtime = fidelity_reading(p)
    read_on, read_reference, literal, fused = read  # run already: judging on them costs no run
    read_outputs = fused if fused_reading else literal
    n_read = sum(len(next(iter(f.values()))) for f in read_on)
    if held is None:
        return measure_fidelity(names, read_reference, read_outputs, budget=budget,
                                data=f"{n_read} calibration sample(s) (in-sample: none held out)", runtime=runtime)
    feeds, reference = held
    outputs = _run(_session(path, optimized=fused_reading), feeds)
    n = sum(len(next(iter(f.values()))) for f in feeds)
    judged = measure_fidelity(names, reference, outputs, budget=budget,
                              data=f"{n} sample(s) held out from calibration", runtime=runtime)
    return widened(judged, names, reference, outputs, lambda: (read_reference, read_outputs, n_read))


def fidelity_in_runtime(path: str | Path, float_path: str | Path, target: str | Target, calibration: Any,
                        fidelity_data: Any = None, budget: Budget | None = None,
                        float_reference: FloatReference | None = None) -> Fidelity | None:
    """The file at ``path`` judged against the float file in its target's own runtime (OpenVINO, TiGrIS's host
    runtime), where that runtime is not ONNX Runtime and runs here (``consumers.native_runtime``); None
    elsewhere. The same samples as ``quantize_onnx_file``'s reading: ``fidelity_data`` when given, else the
    calibration samples the file is read on (``float_reference``: the call's float outputs on them, when held).
    A runtime that cannot run the file raises ``ExportRefused``."""
    p = targets.get(target)
    native = native_runtime(p)
    if native is None:
        return None
    runner, runtime = native
    proto = load_onnx(float_path)
    inputs = model_inputs(proto)
    if fidelity_data is not None:
        feeds = feeds_for(p, as_feeds(fidelity_data, inputs))
        data = "sample(s) held out from calibration"
    else:
        feeds = first_feeds(feeds_for(p, as_feeds(calibration, inputs)), READING_SAMPLES)
        data = "calibration sample(s) (in-sample: none held out)"
    held = float_reference.held_for(Path(float_path).expanduser(), feeds, fidelity_data is not None) \
        if float_reference is not None else None
    reference = held if held is not None else _run(_session(proto, optimized=True), feeds)
    del proto
    quantized = load_onnx(path)
    names = [o.name for o in quantized.graph.output]
    try:
        per_feed = runner(path, feeds, quantized)
    except Exception as exc:  # the runtime's own exception types: it does not run this file here
        raise ExportRefused(f"{runtime} could not run the file to measure its fidelity: {cause(exc)}") from exc
    outputs = joined(per_feed)
    n = sum(len(next(iter(f.values()))) for f in feeds)
    return measure_fidelity(names, reference, outputs, budget=budget, data=f"{n} {data}", runtime=runtime)


@takes_algorithms()
def quantize_onnx_file(float_path: str | Path, out_path: str | Path, calibration: Any, *, target: str | Target,
                       exclude: Iterable[str] = (), observer: str | None = None, per_tensor: bool = False,
                       wait: bool = True, run_check: bool = True, equalize: bool = False,
                       bias_correction: bool = False, smooth_quant: float | None = None, seq_mse: bool = False,
                       adaround: bool | int = False, int16: Iterable[str] = (),
                       shared_scale: Iterable[str] = (), metadata: Mapping[str, str] | None = None,
                       fidelity_data: Any = None, budget: Budget | None = None,
                       max_memory: int | None = None, float_reference: FloatReference | None = None,
                       ) -> OnnxQuantizeResult:
    """Quantize the float ONNX file at ``float_path`` for ``target`` and write ``out_path``.

    ``calibration``: an array (one input), a dict {input name: array}, or an iterable of either, one
    per batch, of the dtype and rank the file declares. ``exclude``: node names, name globs or op
    types to keep in float. ``observer``: the activation range rule (``precision.ACT_OBSERVERS``;
    default the preset's). ``equalize``: cross-layer equalization of Conv -> ReLU -> Conv pairs before
    calibration (``equalize``); ``bias_correction``: each quantized layer's bias corrected for the shift
    of its output mean (``bias_correction``); ``smooth_quant``: SmoothQuant's alpha in [0, 1]
    (``smooth_quant``; None: off), activation outliers moved into the weights before calibration;
    ``seq_mse``: each weight's scale per output channel searched for the least layer output error
    (``seq_mse``); ``adaround``: each weight's rounding learned (``adaround``; True: its default steps
    per layer, or a number of steps). ``int16``: nodes (``exclude``'s grammar) whose activations are
    stored in 16 bits, weights still int8, where the target runs them (``int16``). ``shared_scale``: Concat
    nodes (``exclude``'s grammar) whose inputs and output get one scale whatever their ranges (the
    ``CONCAT_TIE_RATIO`` rule and the output-Concat release set aside; bench/yolo_head.py). ``metadata``: more
    ``metadata_props`` entries for the file (e.g. what a search measured). Refusals raise a
    ``QuantshipError`` and write nothing.

    Fidelity to the float file (``quantship.fidelity``) is measured on every file, each output, in the
    target's reading (``fidelity_reading``), on ``fidelity_data`` (the calibration grammar; samples held
    out from calibration) or else on the calibration samples the file is read on (said so); it is judged
    by ``budget`` when given (``result.fp32.status``) and stored in the file's metadata. This single pass
    never refuses a file for it: ``quantize_onnx.repair.quantize_onnx`` does, after trying to repair it.

    ``max_memory``: bytes the run may use (default: ``MemAvailable``); the calibration slices are sized to stay
    under it, and a budget below what the weights and one layer's output need is refused before anything is
    written (``memory``). A file whose weights are in external data is mapped from disk, not read whole,
    unless an algorithm that rewrites weights from activations (SmoothQuant, equalization, bias correction,
    seq-MSE, AdaRound) is asked for. ``float_reference``: the float outputs a calling loop shares between the
    files it makes (``FloatReference``; the same calibration and fidelity data on every call).
    """

    if observer is not None and observer not in ACT_OBSERVERS:
        raise SpecRefused(f"observer={observer!r} is unknown; valid observers: {list(ACT_OBSERVERS)}")
    from quantship.quantize.algorithms.rounding import iterations_of  # torch: loaded when a file is made

    learn_steps = iterations_of(adaround)
    if smooth_quant is not None:
        smoothing.check_alpha(smooth_quant)
    src = Path(float_path).expanduser()
    artifact.refuse_unsafe_destination(out_path, (src,))
    rewrites_weights = smooth_quant is not None or equalize or bias_correction or seq_mse or bool(learn_steps)
    mapped = False
    if src.is_file():  # before reading it: the figure and the way out, not an allocation failure
        refuse_if_too_large(src, max_memory=max_memory)
        mapped = memory.is_mapped(src) and not rewrites_weights
    proto = load_onnx(src, external_data=not mapped)  # mapped: the graph alone, its data checked
    refuse_unusable(proto, float_path)
    inputs = model_inputs(proto)
    float_outputs = [o.name for o in proto.graph.output]
    feeds = as_feeds(calibration, inputs)
    placement, p, base_spec = placement_for(target, per_tensor=per_tensor)
    wide = tuple(int16)
    if wide:
        sixteen.refuse_unless_runs(p)
    feeds = feeds_for(p, feeds)
    needed = refuse_if_too_large(src, feeds, max_memory=max_memory) if src.is_file() else None
    read_on = first_feeds(feeds, READING_SAMPLES)
    held_out = feeds_for(p, as_feeds(fidelity_data, inputs)) if fidelity_data is not None else None
    try:
        float_file = src if mapped else proto  # by path, ONNX Runtime maps the external data itself
        shared = float_reference if float_reference is not None else FloatReference()
        reference, held_reference = shared.outputs(reference_key(src, read_on, held_out), float_file, read_on,
                                                   held_out)
    except Exception as exc:  # ORT's own exception types: the float file does not run on this data
        raise ExportRefused(f"the float file does not run in ONNX Runtime on the calibration data: {cause(exc)}") from exc
    memory.give_back()
    float_model = ir.load(src) if mapped else proto
    on_disk = [v.const_value for v in float_model.graph.initializers.values()
               if isinstance(v.const_value, ir.ExternalTensor)] if mapped else []
    ready = prepare(float_model, inputs, feeds, p, placement, exclude, equalize=equalize,
                    int16=bool(wide), smooth_quant=smooth_quant, shared_scale=shared_scale)
    del proto, float_model
    memory.give_back()
    model, normal, records, info, excluded, layout = (ready.model, ready.normal, ready.records, ready.info,
                                                      ready.excluded, ready.layout)
    smoother, recurrent_plan, base_dir = ready.smoother, ready.recurrent_plan, ready.base_dir
    del ready  # ``model`` and ``normal`` are dropped below as soon as each is done with
    slices = memory.MEMORY_BUDGET if needed is None else slice_budget(needed, memory.Room.of(max_memory),
                                                                       *largest_tensor(layout.tensors, info))
    nodes = layout.nodes
    algorithms: dict[str, dict] = {}
    if equalize:
        done = next(r for r in records if r.name == equalizing.PASS.name)
        algorithms["equalize"] = {"pairs_changed": done.changes, "max_abs_diff": done.max_abs_diff}
    if smoother is not None:
        done = next(r for r in records if r.name == "smooth_quant")
        algorithms["smooth_quant"] = {**smoother.record(), "max_abs_diff": done.max_abs_diff}
    act_observer = observer or base_spec.act_observer or "histogram"
    observers = calibrate.observe(normal, feeds, layout.tensors, info, observer=act_observer,
                                  symmetric=placement.symmetric, budget=slices, base_dir=base_dir)
    memory.give_back()
    qparams = place.group_qparams(layout, observers, placement.symmetric)
    chosen = sixteen.chosen_tensors(layout, wide, excluded) if wide else []  # read before insert rewires inputs
    float_weights = sixteen.keep_float_weights(layout, chosen) if chosen else []
    chosen_values = sixteen.values_of(layout, chosen)
    counts = place.insert(model, layout, qparams, placement)
    widened = sixteen.widen(model, chosen_values, observers, layout, wide_dtype(placement.activation_dtype),
                            placement.symmetric) if chosen else []  # as the file names them
    if chosen:
        counts["float_weights_of_int16_readers"] = len(float_weights)
        counts["int16_pairs"] = len(widened)
    integer_recurrent = recurrent.integer_indices(nodes, recurrent_plan)
    if layout.weighted == [] and layout.roles.get("matmul", 0) == 0 and not integer_recurrent:
        widened_note = f" (--int16 leaves the weights of {', '.join(float_weights)} float)" if float_weights else ""
        raise ExportRefused(f"{src.name}: no Conv, ConvTranspose, Gemm, MatMul or LSTM reads a float activation and a "
                            f"stored weight here{widened_note}; there is nothing to run as an integer kernel")
    if seq_mse or learn_steps:
        from quantship.quantize_onnx import rounding

        algorithms.update(rounding.round_weights(
            model, normal, [layout.nodes[i] for i in layout.weighted], first_feeds(feeds, rounding.SAMPLES),
            info, placement.weight_bound, seq_mse=seq_mse, adaround_iterations=learn_steps))
    if bias_correction:
        algorithms["bias_correction"] = bias_correcting.correct(
            model, normal, [layout.nodes[i] for i in layout.weighted], first_feeds(feeds, BIAS_SAMPLES),
            info).as_dict()
    del normal
    recurrent.rewrite(model, nodes, recurrent_plan, per_channel=placement.per_channel,
                      weight_bound=placement.weight_bound)
    counts["integer_recurrent"] = len(integer_recurrent)
    counts["kernel_shape_written"] = write_kernel_shapes(model)
    if p.quantizes_float_convs:
        counts["float_reads_per_axis"] = float_pairs.float_reads_per_axis(model)
    skipped = sorted(selection.node_label(nodes[i], i) for i in excluded)
    spec_kwargs = dict(p.spec_kwargs)
    if per_tensor:
        spec_kwargs["qscheme"] = "per_tensor"
    kept = sorted({*skipped, *layout.kept_float})  # left float on request, or because the runtime runs them faster so
    spec = resolve_spec(**spec_kwargs, act_observer=act_observer, skip_activations=kept or None)
    write_metadata(model, spec, activation_dtype=placement.activation_dtype, target=p.target)
    model.metadata_props[ENGINE_KEY] = ENGINE
    model.metadata_props[ALGORITHMS_KEY] = algorithms_summary(algorithms)
    if widened:
        model.metadata_props[sixteen.INT16_KEY] = ", ".join(widened)
    model.metadata_props[NORMALISED_KEY] = normalised_summary(records)
    model.metadata_props[SOURCE_KEY] = source_record(src)  # check --run and compare find the reference
    for key, value in (metadata or {}).items():
        model.metadata_props[key] = value
    opset = int(model.opset_imports.get("", 0))
    ir.external_data.load_to_model(model)  # what stays float (biases, norms) is read from the mapped file now
    unmap(on_disk)
    final = ir.to_proto(model)
    plan = {**layout.as_dict(), "recurrent": recurrent_plan.as_dict()}
    del model, layout, nodes  # the plan's nodes hold the whole graph: freed before the file is read back
    memory.give_back()
    reading = parts_of_at_most(memory.literal_part_bytes(needed, memory.Room.of(max_memory)))
    with reading, artifact.atomic_destination(out_path, wait=wait, inputs=(src,)) as staged:
        artifact.save_model(final, staged)
        del final
        facts = read_file(staged)
        stats = check_spec(facts, spec, activation_dtype=placement.activation_dtype, opset_version=opset,
                           int16_tensors=widened)
        check_target(facts, p)
        del facts
        literal, fused = read_both(staged, read_on, "quantized")
        memory.give_back()

        scales = output_scales(staged)  # every graph output, by name, in order: each read in its own LSB
        names = list(scales)
        check_outputs_kept(float_outputs, names, reference, literal)
        readings = readings_of_outputs(names, scales, literal, fused, reference, against="the FP32 file")
        fidelity = fidelity_of_outputs(names, reference, literal, fused)
        fp32 = fidelity_to_float(staged, p, names, (held_out, held_reference) if held_out is not None else None,
                                 (read_on, reference, literal, fused), budget)
        add_file_metadata(staged, {FIDELITY_KEY: fp32.metadata()})
        kernels = census(staged)
        memory.give_back()
        verdict = check_file(staged, p, run=run_check, inputs=read_on)
        verdict.path = str(Path(out_path).expanduser().resolve())
    return OnnxQuantizeResult(
        path=Path(out_path).expanduser().resolve(), target=p.target, placement=placement, normalised=records,
        plan=plan, counts=counts, qdq_stats=stats,
        readings=readings, fidelity=fidelity,
        census=kernels, verdict=verdict, spec=spec, excluded=skipped, algorithms=algorithms, int16=widened,
        fp32=fp32)

