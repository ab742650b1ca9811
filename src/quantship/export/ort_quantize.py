"""ONNX Runtime's quantizer with a deployment preset's settings: the library behind ``quantize-onnx``.

Settings come from the target's preset (``quantship.targets``: activation dtype, symmetric activations, weight
granularity and range), never from a second table. Inputs are checked before any work: a file
that already holds Q/DQ or QOperator nodes is refused in milliseconds (ORT's quantizer would loop
on it), and every calibration batch must fit the declared input. ORT writes its temporaries (and
``sym_shape_infer_temp.onnx`` on failure) into the private directory of the destination, never
into the current directory; the file appears only when the target's check passes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quantship import targets
from quantship.errors import DataRefused, ExportRefused, FileRefused, cause
from quantship.export import artifact
from quantship.export.kernel_shape import write_kernel_shapes
from quantship.inspect.judge.check import check_file
from quantship.inspect.read.inputs import DeclaredInput, declared_inputs
from quantship.inspect.read.loading import load_onnx
from quantship.inspect.read.stats import qdq_stats
from quantship.precision import resolve_spec
from quantship.targets import Target

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
QOPERATOR_OPS = frozenset({"ConvInteger", "MatMulInteger", "QGemm", "QAttention", "DynamicQuantizeMatMul",
                           "MatMulIntegerToFloat", "DynamicQuantizeLSTM", "QEmbedLayerNormalization"})


@dataclass(frozen=True)
class OrtSettings:
    """What ``quantize_static`` is asked for, read off a preset (``ort_settings``)."""

    activation_type: str  # onnxruntime.quantization.QuantType member name
    activation_symmetric: bool
    per_channel: bool
    reduce_range: bool  # 7-bit weights, as the preset's spec asks

    def describe(self) -> str:
        return (f"QDQ, static, {self.activation_type} activations{' (symmetric)' if self.activation_symmetric else ''}, "
                f"int8 weights per {'channel' if self.per_channel else 'tensor'}"
                f"{', 7-bit range' if self.reduce_range else ''}")


def ort_settings(target: str | Target, *, per_tensor: bool = False) -> OrtSettings:
    """The ORT quantizer settings that write what the preset asks for."""
    p = targets.get(target)
    spec = resolve_spec(**p.spec_kwargs)
    return OrtSettings("QUInt8" if p.activation_dtype == "uint8" else "QInt8", spec.symmetric,
                       spec.qscheme == "per_channel" and not per_tensor, spec.reduce_range)


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


def refuse_quantized(model: onnx.ModelProto, path: str | Path) -> None:
    """A float file only: Q/DQ or QOperator nodes mean it was quantized already."""
    found = sorted({n.op_type for n in model.graph.node
                    if n.op_type in QDQ_OPS or n.op_type in QOPERATOR_OPS or n.op_type.startswith("QLinear")})
    if found:
        raise FileRefused(f"{path} is already quantized (it holds {', '.join(found[:4])}); give quantize-onnx "
                          "the float ONNX file it was made from")


def float_input(model: onnx.ModelProto, path: str | Path) -> DeclaredInput:
    """The one float input ``quantize-onnx`` calibrates; its declared dims are checked."""
    inputs = declared_inputs(model, path)
    if len(inputs) != 1:
        raise FileRefused(f"{path} has {len(inputs)} inputs; quantize-onnx calibrates single-input graphs")
    if inputs[0].dtype.kind != "f":
        raise FileRefused(f"{path}: input {inputs[0].name!r} is {inputs[0].dtype}; quantize-onnx needs a float input")
    return inputs[0]


def check_batches(batches: Sequence[Any], declared: DeclaredInput, path: str | Path) -> None:
    """Every calibration batch: real finite numbers of the input's rank and fixed dims."""
    if not batches:
        raise DataRefused("no calibration batch: give at least one")
    for i, batch in enumerate(batches):
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        array = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
        if array.dtype.kind not in "fiu" or array.dtype == np.bool_:
            raise DataRefused(f"calibration batch {i} holds {array.dtype} values; give real float (or uint8) data")
        if array.size == 0:
            raise DataRefused(f"calibration batch {i} is empty (shape {list(array.shape)})")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise DataRefused(f"calibration batch {i} holds {int((~np.isfinite(array)).sum())} NaN or infinite "
                              "value(s); clean the data first")
        shape = tuple(array.shape)
        fits = len(shape) == len(declared.dims) and all(d is None or d == s for d, s in zip(declared.dims, shape))
        if not fits:
            raise DataRefused(f"calibration batch {i} has shape {list(shape)}, but {Path(path).name} declares "
                              f"input {declared.name!r} as {declared.describe()}; give data of that shape")


def quantize_static_file(src: Path, dst: Path, batches: Iterable, settings: OrtSettings, input_name: str) -> None:
    """``quant_pre_process`` then ``quantize_static`` from ``src`` to ``dst``; scratch files stay in dst's folder."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    workdir = dst.parent
    pre = workdir / "preprocessed.onnx"
    with artifact.scratch_in(workdir):
        try:
            quant_pre_process(str(src), str(pre))
        except Exception as exc:  # ORT raises plain Exception for an incomplete shape inference
            raise ExportRefused(f"ONNX Runtime's pre-processing failed on {src.name}: {cause(exc)}") from exc
        quantize_static(
            str(pre), str(dst), CalibrationReader(batches, input_name), quant_format=QuantFormat.QDQ,
            activation_type=getattr(QuantType, settings.activation_type), weight_type=QuantType.QInt8,
            per_channel=settings.per_channel, reduce_range=settings.reduce_range,
            extra_options={"ForceQuantizeNoInputCheck": True, "ActivationSymmetric": settings.activation_symmetric,
                           "WeightSymmetric": True},
        )


def quantize_dynamic_file(src: Path, dst: Path) -> None:
    """ORT's dynamic quantization (int8 weights, activations quantized at run time)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with artifact.scratch_in(dst.parent):
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)


@dataclass
class OrtQuantizeResult:
    """What ``quantize_onnx_file`` produced: the path (None when refused and not kept) and the facts."""

    path: Path | None
    settings: OrtSettings
    kernel_shape_written: int
    stats: Any  # inspect.read.stats.QDQStats
    verdict: Any  # inspect.judge.check.CheckReport


class _NotKept(Exception):
    pass


def quantize_onnx_file(float_path: str | Path, out: str | Path, batches: Sequence[Any], target: str, *,
                       per_tensor: bool = False, keep_refused: bool = False, wait: bool = True) -> OrtQuantizeResult:
    """Quantize a float ONNX file with ORT for ``target``; the file appears only if its check passes.

    ``keep_refused`` keeps a file the target's rules refuse; ``wait=False`` refuses at once when
    another process is writing ``out``.
    """
    import onnx_ir as ir  # onnxscript's IR loads only when ORT's path runs

    src = Path(float_path).expanduser().resolve()
    artifact.refuse_unsafe_destination(out, (src,))
    model = load_onnx(src)
    refuse_quantized(model, float_path)
    declared = float_input(model, float_path)
    check_batches(batches, declared, float_path)
    del model
    p = targets.get(target)
    settings = ort_settings(p, per_tensor=per_tensor)
    facts: dict[str, Any] = {}
    try:
        with artifact.atomic_destination(out, wait=wait, inputs=(src,)) as staged:
            quantize_static_file(src, staged, batches, settings, declared.name)
            quantized = ir.load(staged)
            facts["written"] = write_kernel_shapes(quantized)  # TensorRT's parser needs it; nothing else changes
            ir.save(quantized, staged)
            facts["verdict"] = check_file(staged, p)
            facts["stats"] = qdq_stats(staged)
            if not (facts["verdict"].ok or keep_refused):
                raise _NotKept
        path = Path(out).expanduser().resolve()
    except _NotKept:
        path = None
    return OrtQuantizeResult(path, settings, facts["written"], facts["stats"], facts["verdict"])
