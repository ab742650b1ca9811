"""``quantize_dynamic_file``: a float ONNX file to a verified dynamic-activation file (``dynamic``'s form).

Data-free: no calibration. The same guarantees as the static file's where they apply: every normalisation
pass proven in ONNX Runtime, the file's post-conditions (no QuantizeLinear, one integer MatMul per layer
planned, one DequantizeLinear per int8 table read, stored weights within their bound, the float file's outputs kept), the target's rules, both ONNX
Runtime readings (literal: the DynamicQuantizeLinear/MatMulInteger arithmetic as written; fused: the
kernels a user's session runs), the census of what ONNX Runtime runs and ``check --run``. A dynamic file
has no static output scale, so its error is read against the float file as max abs error and SQNR, never
in LSB. The readings run on the given inputs, or on generated ones (``feeds.generated``: each input's dtype and range).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantship import __version__, targets
from quantship.errors import ExportRefused, SpecRefused, cause
from quantship.export import artifact
from quantship.export.metadata import ACTIVATION_DTYPE_KEY, TARGET_KEY, VERSION_KEY
from quantship.export.postconditions import check_target
from quantship.fidelity import output_sqnr_db
from quantship.inspect.judge.check import check_file
from quantship.inspect.read.facts import read_file
from quantship.inspect.read.feeds import as_feeds, generated, model_inputs
from quantship.inspect.read.loading import load_onnx
from quantship.inspect.read.lsb import output_scales
from quantship.inspect.run.verify import readings_of_outputs
from quantship.quantize_onnx import dynamic, selection
from quantship.quantize_onnx.memory import refuse_if_too_large
from quantship.quantize_onnx.quantizer import (
    ENGINE,
    ENGINE_KEY,
    NORMALISED_KEY,
    READING_SAMPLES,
    PassRecord,
    _run,
    _session,
    census,
    check_outputs_kept,
    fidelity_of_outputs,
    first_feeds,
    normalise,
    normalised_summary,
    placement_for,
    read_both,
    refuse_unusable,
)

RUN_TIME_DTYPE = "uint8"  # what DynamicQuantizeLinear writes


@dataclass
class DynamicQuantizeResult:
    """What ``quantize_dynamic_file`` wrote and measured."""

    path: Path
    target: str
    normalised: list[PassRecord]
    plan: dynamic.DynamicPlan
    weights: dict  # how the stored weights are quantized (also in the file's metadata)
    readings: Any  # inspect.run.verify.Readings: both readings against the FP32 file (no LSB: float outputs)
    fidelity: dict  # as the static file's: max / mean abs error of both readings, per output
    sqnr_db: dict  # output name -> {"literal": dB, "fused": dB} against the FP32 file
    census: dict  # what ONNX Runtime's optimized graph runs
    n_matmul_gemm: int  # MatMul/Gemm nodes in the (normalised) float file
    verdict: Any  # inspect.judge.check.CheckReport
    inputs: str  # "given" or "generated" (feeds.generated): what the readings ran on
    excluded: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"path": str(self.path), "target": self.target, "engine": ENGINE, "activations": "dynamic",
                "normalised": [asdict(p) for p in self.normalised], "plan": self.plan.as_dict(),
                "weights": self.weights, "readings": self.readings.as_dict(), "fidelity": self.fidelity,
                "sqnr_db": self.sqnr_db, "census": self.census, "n_matmul_gemm": self.n_matmul_gemm,
                "verdict": self.verdict.verdict, "check": self.verdict.as_dict(), "inputs": self.inputs,
                "excluded": self.excluded}


def refuse_target(target: Any):
    """The preset for ``target``, refused when its runtime has no run-time quantization kernel (its rules
    refuse scales computed while the model runs: ``static_scales``)."""
    p = targets.get(target)
    if not p.runs_dynamic_activations:
        raise SpecRefused(f"--activations dynamic: target {p.target} needs static scales stored in the file (no "
                          "run-time quantization kernel); use --activations static, or --target onnxruntime-cpu")
    return p


def check_dynamic_held(path: Path, plan: dynamic.DynamicPlan, weight_bound: int, opset: int) -> None:
    """Refuse the written file unless it holds the plan: no QuantizeLinear, one DequantizeLinear per int8 table
    read, the planned DynamicQuantizeLinear and MatMulInteger nodes, int8 stored weights within
    ``weight_bound``, the opset declared."""
    model = onnx.load(str(path))
    ops = [n.op_type for n in model.graph.node]
    problems = []
    if ops.count("QuantizeLinear"):
        problems.append(f"it holds {ops.count('QuantizeLinear')} QuantizeLinear node(s)")
    if ops.count("DequantizeLinear") != len(plan.tables):
        problems.append(f"{ops.count('DequantizeLinear')} DequantizeLinear for {len(plan.tables)} int8 table read(s)")
    if ops.count("MatMulInteger") != len(plan.layers):
        problems.append(f"{ops.count('MatMulInteger')} MatMulInteger for {len(plan.layers)} planned layer(s)")
    if ops.count("DynamicQuantizeLinear") != plan.n_quantize_nodes:
        problems.append(f"{ops.count('DynamicQuantizeLinear')} DynamicQuantizeLinear for {plan.n_quantize_nodes} "
                        "planned")
    stored = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "MatMulInteger":
            w = stored.get(node.input[1])
            array = onnx.numpy_helper.to_array(w) if w is not None else None
            if array is None or array.dtype != np.int8 or (array.size and int(np.abs(array.astype(np.int32)).max())
                                                             > weight_bound):
                problems.append(f"{node.name}: B is not a stored int8 weight within +-{weight_bound}")
    declared = {o.domain: o.version for o in model.opset_import}
    if declared.get("") != opset:
        problems.append(f"it declares opset {declared} instead of {opset}")
    if problems:
        raise ExportRefused("the written dynamic file does not hold its plan: " + "; ".join(problems))


def quantize_dynamic_file(float_path: str | Path, out_path: str | Path, inputs: Any = None, *,
                          target: Any = "onnxruntime-cpu", exclude: Iterable[str] = (), per_tensor: bool = False,
                          wait: bool = True, run_check: bool = True) -> DynamicQuantizeResult:
    """Write ``float_path`` in the dynamic-activation form at ``out_path`` and verify it.

    ``inputs``: optional data the file is read on (``quantize_onnx_file``'s calibration grammar); without
    it, ``feeds.generated``. ``exclude``: nodes kept float (``--exclude``'s grammar). ``per_tensor``: one weight
    scale per tensor instead of one per output column. Refusals raise a ``QuantshipError``, writing nothing.
    """
    p = refuse_target(target)
    placement, _, base_spec = placement_for(p, per_tensor=per_tensor)
    src = Path(float_path).expanduser()
    artifact.refuse_unsafe_destination(out_path, (src,))
    if src.is_file():
        refuse_if_too_large(src)
    proto = load_onnx(src)
    refuse_unusable(proto, float_path)
    float_outputs = [o.name for o in proto.graph.output]
    given = inputs is not None
    feeds = as_feeds(inputs, model_inputs(proto)) if given else generated(proto).batches
    read_on = first_feeds(feeds, READING_SAMPLES)
    try:
        reference = _run(_session(proto, optimized=True), read_on)
    except Exception as exc:  # ORT's own exception types
        where = "the given inputs" if given else "generated inputs (batch 1, every dynamic dim 1)"
        raise ExportRefused(f"the float file does not run in ONNX Runtime on {where}: {cause(exc)}"
                            + ("" if given else "; give --calib DATA with real inputs")) from exc
    model = ir.from_proto(proto)
    del proto
    records = normalise(model, feeds)
    nodes = list(model.graph)
    n_matmul_gemm = sum(n.op_type in ("MatMul", "Gemm") for n in nodes)
    excluded = selection.resolve_excludes(nodes, exclude)
    plan = dynamic.rewrite(model, weight_bound=placement.weight_bound, per_channel=placement.per_channel,
                           excluded=excluded)
    if not plan.layers:
        raise ExportRefused(f"{src.name}: no MatMul or Gemm reads a float activation and a stored rank-2 weight "
                            "here; nothing runs as an integer kernel in the dynamic form (Convs stay float in it: use "
                            "--activations static)")
    weights = {"dtype": "int8", "symmetric": True, "bound": placement.weight_bound,
               "qscheme": "per_channel" if placement.per_channel else "per_tensor",  # a channel: an output column
               "reduce_range": bool(base_spec.reduce_range)}
    meta = model.metadata_props
    meta[VERSION_KEY], meta[TARGET_KEY], meta[ENGINE_KEY] = __version__, p.target, ENGINE
    meta[dynamic.ACTIVATIONS_KEY], meta[ACTIVATION_DTYPE_KEY] = "dynamic", RUN_TIME_DTYPE
    meta[dynamic.WEIGHTS_KEY] = json.dumps(weights)
    meta[NORMALISED_KEY] = normalised_summary(records)
    opset = int(model.opset_imports.get("", 0))
    final = ir.to_proto(model)
    del model
    with artifact.atomic_destination(out_path, wait=wait, inputs=(src,)) as staged:
        artifact.save_model(final, staged)
        del final
        check_dynamic_held(staged, plan, placement.weight_bound, opset)
        check_target(read_file(staged), p)
        literal, fused = read_both(staged, read_on, "dynamic")
        scales = output_scales(staged)  # None for every float output: no LSB is invented
        names = list(scales)
        check_outputs_kept(float_outputs, names, reference, literal)
        readings = readings_of_outputs(names, scales, literal, fused, reference, against="the FP32 file")
        fidelity = fidelity_of_outputs(names, reference, literal, fused)
        sqnr = {name: {"literal": output_sqnr_db(reference[k], literal[k]),
                       "fused": output_sqnr_db(reference[k], fused[k])}
                for k, name in enumerate(names) if reference[k].dtype.kind == "f"}
        kernels = census(staged)
        verdict = check_file(staged, p, run=run_check, inputs=read_on)
        verdict.path = str(Path(out_path).expanduser().resolve())
    skipped = sorted(selection.node_label(nodes[i], i) for i in excluded)
    return DynamicQuantizeResult(Path(out_path).expanduser().resolve(), p.target, records, plan, weights, readings,
                                 fidelity, sqnr, kernels, n_matmul_gemm, verdict, "given" if given else "generated",
                                 skipped)

