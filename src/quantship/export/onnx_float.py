"""The float path: ``export_onnx``, optionally quantized by ONNX Runtime (``export.ort_quantize``).

Not for pt2e models: ONNX Runtime's graph optimizer folds Q/DQ pairs away, so a quantized graph
must go through ``export_qdq`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import onnxruntime as ort

from quantship import heap
from quantship.export import artifact, capture, ort_quantize
from quantship.export.checks import check_identical, check_model, run_unoptimized
from quantship.export.named_outputs import float_output_names
from quantship.export.opset import lower_opset
from quantship.export.refusals import has_pt2e_ops
from quantship.precision import quant_spec

QUANTIZE_MODES = ("dynamic", "static")
# export_onnx(quantize_mode='static'): ORT's defaults made complete (int8 affine activations, per-channel weights)
_STATIC = ort_quantize.OrtSettings("QInt8", activation_symmetric=False, per_channel=True, reduce_range=False)


def _refuse_pt2e(model: Any) -> None:
    spec = quant_spec(model)
    if (spec is not None and spec.backend == "pt2e") or has_pt2e_ops(model):
        raise ValueError(
            "export_onnx is the float path: its graph optimization folds the Q/DQ pairs of a pt2e-quantized "
            "model away. Use quantship.export_qdq(model, sample, path) to keep them."
        )


def _float_graph(model: Any, sample: Any, opset_version: int, dynamic_batch: bool,
                 input_names: Sequence[str] | None, output_names: Sequence[str] | None) -> onnx.ModelProto:
    """Dynamo export at opset 18, lowered (and checked) when a lower opset is asked for; a dict / tuple /
    ModelOutput's tensors are named after their keys, as in the INT8 file."""
    if output_names is None:
        output_names = float_output_names(model, sample)
    produced = capture.dynamo_export(
        model, sample, opset_version=max(opset_version, capture.EXPORTER_OPSET), dynamic_batch=dynamic_batch,
        input_names=input_names, output_names=output_names,
    )
    if dynamic_batch and not capture.batch_dim_is_dynamic(produced):
        raise ValueError("dynamic_batch=True: the exporter kept the batch dimension fixed for this model; "
                         "use dynamic_batch=False")
    if opset_version >= capture.EXPORTER_OPSET:
        return produced
    model_ir = ir.from_proto(produced)
    lower_opset(model_ir, opset_version)
    lowered = ir.to_proto(model_ir)
    what = f"lowering to opset {opset_version}"
    check_model(lowered, what)
    inputs = capture.as_arrays(sample)
    check_identical(lowered, run_unoptimized(produced, inputs), inputs, what)
    return lowered


def export_float_reference(model: Any, sample: Any, path: Path, *, opset_version: int, dynamic_batch: bool,
                           input_names: Sequence[str] | None) -> Path:
    """The float model written at ``path`` (in a work folder: no atomic move) as ``export_onnx(optimize=False)``
    writes it, except that a large model's tensors stay in the data file they were streamed to, whatever their
    size (``_write_float_graph``): the sessions that time and profile it map them instead of reading a copy."""
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        _write_float_graph(model, sample, path, opset_version, dynamic_batch, input_names, None)
    finally:
        model.train(was_training)
    return path


def _write_float_graph(model: Any, sample: Any, path: Path, opset_version: int, dynamic_batch: bool,
                       input_names: Sequence[str] | None, output_names: Sequence[str] | None) -> None:
    """The float graph written at ``path``: a model of ``heap.LARGE_MODEL_BYTES`` of weights or more at the
    exporter's own opset streamed from its tensors with external data (``capture.dynamo_export_file``: no
    serialised copy of its weights in memory), any other as ``_float_graph`` makes it, in one file when it fits."""
    if opset_version < capture.EXPORTER_OPSET or heap.module_bytes(model) < heap.LARGE_MODEL_BYTES:
        artifact.save_model(_float_graph(model, sample, opset_version, dynamic_batch, input_names, output_names),
                            path)
        return
    if output_names is None:
        output_names = float_output_names(model, sample)
    graph = capture.dynamo_export_file(model, sample, path, artifact.external_data_name(path),
                                       opset_version=opset_version, dynamic_batch=dynamic_batch,
                                       input_names=input_names, output_names=output_names)
    if dynamic_batch and not capture.batch_dim_is_dynamic(graph):
        raise ValueError("dynamic_batch=True: the exporter kept the batch dimension fixed for this model; "
                         "use dynamic_batch=False")


def _place(current: Path, staged: Path) -> None:
    """The float file at ``current`` written as ``staged``: in one file when its tensors fit
    (``artifact.EXTERNAL_DATA_THRESHOLD``), else its one data file renamed for ``staged`` (its tensors never
    read into memory)."""
    locations = artifact.external_locations(current)
    stored = sum((current.parent / name).stat().st_size for name in locations)
    if len(locations) != 1 or stored <= artifact.EXTERNAL_DATA_THRESHOLD:
        artifact.save_model(onnx.load(str(current)), staged)
        return
    artifact.move_with_data(current, staged)


def _optimize(src: Path, dst: Path) -> None:
    """ONNX Runtime's basic (portable, standard-ops-only) graph optimizations, written to ``dst``."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(dst)
    options.log_severity_level = 3
    if artifact.external_locations(src):  # a large graph: ONNX Runtime writes the weights beside ``dst`` too
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", dst.name + ".data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                         str(artifact.EXTERNAL_TENSOR_MIN_BYTES))
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])


def _quantize(src: Path, dst: Path, mode: str, calibration_data: Iterable | None) -> None:
    if mode == "dynamic":
        ort_quantize.quantize_dynamic_file(src, dst)
        return
    model = onnx.load(str(src), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    name = next(i.name for i in model.graph.input if i.name not in initializers)
    ort_quantize.quantize_static_file(src, dst, calibration_data, _STATIC, name)


def export_onnx(
    model: Any,
    sample: Any,
    output_path: str | Path,
    *,
    opset_version: int = 17,
    quantize: bool = False,
    quantize_mode: str = "dynamic",
    calibration_data: Iterable | None = None,
    optimize: bool = True,
    dynamic_batch: bool = True,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> Path:
    """Export a float model to ONNX (dynamo exporter), optimize it, and optionally INT8-quantize it with ORT.

    ``quantize_mode='dynamic'`` needs no data; ``'static'`` needs ``calibration_data`` (tensors or
    ``(x, y)`` batches) and writes QDQ. The file appears at ``output_path`` only if every step succeeded.
    """
    artifact.refuse_unsafe_destination(output_path)  # before any work: never onto a source, a data file or a device
    _refuse_pt2e(model)
    if quant_spec(model) is not None or any(type(p).__module__.startswith("torchao") for p in getattr(model, "parameters", list)()):
        raise ValueError("export_onnx writes float models and this one is quantized: use quantship.export_qdq(model, sample, path)")
    if quantize and quantize_mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize_mode={quantize_mode!r}; valid values: {list(QUANTIZE_MODES)}")
    if quantize and quantize_mode == "static" and calibration_data is None:
        raise ValueError("quantize_mode='static' needs calibration_data (an iterable of input batches)")
    if isinstance(opset_version, bool) or not isinstance(opset_version, int) or opset_version < 17:
        raise ValueError(f"opset_version={opset_version!r}: export_onnx writes opset 17 or higher")
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        with artifact.atomic_destination(output_path) as staged:
            exported = staged.with_name(staged.stem + ".exported.onnx")
            _write_float_graph(model, sample, exported, opset_version, dynamic_batch, input_names, output_names)
            current = exported
            if optimize:
                optimized = staged.with_name(staged.stem + ".optimized.onnx")
                _optimize(current, optimized)
                current = optimized
            if quantize:
                _quantize(current, staged, quantize_mode, calibration_data)
            else:
                _place(current, staged)
    finally:
        model.train(was_training)
    return Path(output_path).expanduser().resolve()
