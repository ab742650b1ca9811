"""The float path: ``export_onnx`` (optionally quantized by ONNX Runtime), ``ONNXModel``, ``verify_onnx``.

Not for pt2e models: ONNX Runtime's graph optimizer folds Q/DQ pairs away, so a quantized graph
must go through ``export_qdq`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from quantship.export import artifact, capture
from quantship.export.checks import check_identical, check_model, run_unoptimized
from quantship.export.opset import lower_opset
from quantship.export.refusals import has_pt2e_ops
from quantship.precision import quant_spec

QUANTIZE_MODES = ("dynamic", "static")


def _refuse_pt2e(model: Any) -> None:
    spec = quant_spec(model)
    if (spec is not None and spec.backend == "pt2e") or has_pt2e_ops(model):
        raise ValueError(
            "export_onnx is the float path: its graph optimization folds the Q/DQ pairs of a pt2e-quantized "
            "model away. Use quantship.export_qdq(model, sample, path) to keep them."
        )


def _float_graph(model: Any, sample: Any, opset_version: int, dynamic_batch: bool,
                 input_names: Sequence[str] | None, output_names: Sequence[str] | None) -> onnx.ModelProto:
    """Dynamo export at opset 18, lowered (and checked) when a lower opset is asked for."""
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


def _optimize(src: Path, dst: Path) -> None:
    """ONNX Runtime's basic (portable, standard-ops-only) graph optimizations, written to ``dst``."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(dst)
    options.log_severity_level = 3
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])


class CalibrationReader:
    """An ONNX Runtime ``CalibrationDataReader`` over tensors, arrays or ``(x, y)`` batches.

    Shared by every caller of ``onnxruntime.quantization.quantize_static`` in quantship.
    """

    def __init__(self, data: Iterable, input_name: str):
        self._batches = iter(data)
        self._name = input_name

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        if batch is None:
            return None
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return {self._name: np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x, dtype=np.float32)}


def _quantize(src: Path, dst: Path, mode: str, calibration_data: Iterable | None) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if mode == "dynamic":
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
        return
    pre = src.with_name(src.stem + ".pre.onnx")
    quant_pre_process(str(src), str(pre))
    name = onnx.load(str(pre), load_external_data=False).graph.input[0].name
    quantize_static(
        str(pre), str(dst), CalibrationReader(calibration_data, name), quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
        extra_options={"ForceQuantizeNoInputCheck": True},
    )
    pre.unlink()


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
            graph = _float_graph(model, sample, opset_version, dynamic_batch, input_names, output_names)
            exported = staged.with_name(staged.stem + ".exported.onnx")
            artifact.save_model(graph, exported)
            current = exported
            if optimize:
                optimized = staged.with_name(staged.stem + ".optimized.onnx")
                _optimize(current, optimized)
                current = optimized
            if quantize:
                _quantize(current, staged, quantize_mode, calibration_data)
            else:
                artifact.save_model(onnx.load(str(current)), staged)
            for p in staged.parent.iterdir():
                if p != staged and p.suffix == ".onnx":
                    p.unlink()
    finally:
        model.train(was_training)
    return Path(output_path).expanduser().resolve()


class ONNXModel:
    """An ONNX Runtime session called like a PyTorch module: tensors in, tensor (or tuple) out."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        providers = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
        if device not in providers:
            raise ValueError(f"device={device!r}; valid values: {list(providers)}")
        if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ValueError("device='cuda' but this onnxruntime build has no CUDA provider; use device='cpu'")
        self.path = Path(path)
        self.session = ort.InferenceSession(str(path), providers=providers[device])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def __call__(self, *inputs: Any) -> Any:
        import torch

        if len(inputs) != len(self.input_names):
            raise ValueError(f"{self.path.name} takes {len(self.input_names)} input(s) {self.input_names}, "
                             f"got {len(inputs)}")
        feeds = {name: (x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x))
                 for name, x in zip(self.input_names, inputs)}
        outputs = [torch.from_numpy(o) for o in self.session.run(None, feeds)]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def verify_onnx(model: Any, path: str | Path, sample: Any, rtol: float = 1e-3, atol: float = 1e-5) -> bool:
    """Whether every output of the file matches the PyTorch model on ``sample`` within ``rtol``/``atol``."""
    import torch

    model.eval()
    with torch.no_grad():
        expected = model(*capture.as_inputs(sample))
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    got = ONNXModel(path)(*capture.as_inputs(sample))
    got = list(got) if isinstance(got, tuple) else [got]
    if len(got) != len(expected):
        return False
    return all(
        g.shape == e.shape and np.allclose(g.numpy(), e.detach().cpu().numpy(), rtol=rtol, atol=atol)
        for g, e in zip(got, expected)
    )
