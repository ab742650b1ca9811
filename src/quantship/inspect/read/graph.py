"""``inspect_file``: what any ONNX file contains, read off the file itself.

Operator census, tensor counts, quantization format, the scale/zero-point each input and output
is stored at, weight bytes and the naive activation peak. Works on quantship's files and on
anyone else's (ONNX Runtime's quantizer, other exporters).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

from quantship.inspect.read.facts import FileFacts, facts_of
from quantship.inspect.read.float_ops import float_ops
from quantship.inspect.read.memory import TensorSize, naive_peak
from quantship.inspect.read.view import DEQUANTIZE, QUANTIZE, GraphView, dtype_name, dtype_size
from quantship.report_json import strict_json

REPORT_VERSION = 1


@dataclass(frozen=True)
class BoundaryTensor:
    """A graph input or output: its declared interface and how the graph stores it."""

    name: str
    shape: list[int | str]
    dtype: str
    stored_as: str  # the integer type at the boundary Q/DQ, or the declared dtype when none
    scale: float | None
    zero_point: int | None

    def describe(self) -> str:
        shape = "x".join(str(d) for d in self.shape)
        if self.scale is None:
            return f"{shape} {self.dtype}, not quantized"
        return f"{shape} {self.dtype}, stored as {self.stored_as} at scale {self.scale:.6g}, zero point {self.zero_point}"


@dataclass(frozen=True)
class MemoryReport:
    """Naive activation peak and largest tensor, as stored and at one byte per element."""

    naive_peak_bytes: int
    largest_tensor: TensorSize | None
    naive_peak_bytes_int8: int
    largest_tensor_int8: TensorSize | None
    unknown_shapes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["largest_tensor"] = self.largest_tensor.as_dict() if self.largest_tensor else None
        out["largest_tensor_int8"] = self.largest_tensor_int8.as_dict() if self.largest_tensor_int8 else None
        return out


@dataclass(frozen=True)
class FileReport:
    """What an ONNX file contains; ``as_dict()`` is the versioned JSON form."""

    path: str
    format: str
    opset: int | None
    producer: str
    operators: dict[str, int]
    n_operators: int
    n_compute_operators: int
    n_tensors: int
    n_activations: int
    n_weights: int
    weight_bytes: int
    activation_dtypes: list[str]
    n_quantize: int
    n_dequantize: int
    n_per_channel: int
    inputs: list[BoundaryTensor]
    outputs: list[BoundaryTensor]
    memory: MemoryReport
    float_tensors: list[str]
    quant_spec: dict[str, Any] | None = None
    # the compute ops left in float, by module path (``float_ops``: the list ``quantize`` prints)
    float_ops: dict[str, Any] = field(default_factory=dict)
    # a weight-only file: its low-bit weights and the weights left float (``WeightOnlyFacts.as_dict``); else None
    weight_only: dict[str, Any] | None = None
    version: int = REPORT_VERSION

    def as_dict(self) -> dict[str, Any]:
        out = {"report": "quantship-inspect", "version": self.version}
        for key, value in asdict(self).items():
            if key != "version":
                out[key] = value
        out["memory"] = self.memory.as_dict()
        return out

    def to_json(self) -> str:
        """Strict JSON (a non-finite scale is written as null, with a note)."""
        return strict_json(self.as_dict())


def _declared(view: GraphView, name: str) -> tuple[list[int | str], str]:
    values = {v.name: v for v in [*view.model.graph.input, *view.model.graph.output]}
    if name not in values:
        return [], "undefined"
    tensor_type = values[name].type.tensor_type
    shape: list[int | str] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                              for d in tensor_type.shape.dim]
    return shape, dtype_name(tensor_type.elem_type)


def _boundary(view: GraphView, name: str, node) -> BoundaryTensor:
    shape, dtype = _declared(view, name)
    if node is None:
        return BoundaryTensor(name, shape, dtype, dtype, None, None)
    scale = view.value(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    zp_name = node.input[2] if len(node.input) > 2 else ""
    zero = view.value(zp_name) if zp_name else None
    if zero is not None and zero.dtype.kind not in "iub":
        zero = None  # not a zero-point: the parameter rule names it
    if node.op_type == DEQUANTIZE:
        stored = dtype_name(view.elem_type.get(node.input[0], 0))
    else:
        stored = dtype_name(view.elem_type.get(zp_name, 0)) if zp_name else "uint8"
    if scale is None or scale.size != 1 or scale.dtype.kind != "f":
        return BoundaryTensor(name, shape, dtype, stored, None, None)
    zp = int(zero.reshape(-1)[0]) if zero is not None and zero.size else 0
    return BoundaryTensor(name, shape, dtype, stored, float(scale.reshape(())), zp)


def boundaries(view: GraphView) -> tuple[list[BoundaryTensor], list[BoundaryTensor]]:
    """Inputs (stored at the QuantizeLinear that reads them) and outputs (at the DequantizeLinear)."""
    inputs = []
    for name in view.inputs:
        quant = [c for t, c in view.through_shape_ops_down(name) if c is not None and c.op_type == QUANTIZE]
        inputs.append(_boundary(view, name, quant[0] if quant else None))
    outputs = []
    for name in view.outputs:
        node = view.node_of(view.through_shape_ops_up(name))
        outputs.append(_boundary(view, name, node if node is not None and node.op_type == DEQUANTIZE else None))
    return inputs, outputs


def report_of(file: FileFacts) -> FileReport:
    """Build the report from one read of the file (``check_file`` reuses it)."""
    view, facts, model, path = file.view, file.quant, file.model, file.path
    stored = naive_peak(view)
    folded = naive_peak(view, one_byte=True)
    inputs, outputs = boundaries(view)
    weight_bytes = sum(len(t.raw_data) or _elements(t) * _itemsize(t) for t in model.graph.initializer)
    names = {n for node in view.nodes for n in [*node.input, *node.output] if n} | set(view.initializers)
    activations_quantized = facts.format not in ("float", "weight-only")  # else every activation is float
    return FileReport(
        path=path, format=facts.format, opset=facts.opset,
        producer=f"{model.producer_name} {model.producer_version}".strip(),
        operators=dict(sorted(Counter(n.op_type for n in view.nodes).items())),
        n_operators=len(view.nodes),
        n_compute_operators=sum(n.op_type not in (QUANTIZE, DEQUANTIZE, "Constant") for n in view.nodes),
        n_tensors=len(names), n_activations=folded.n_activations, n_weights=len(view.initializers),
        weight_bytes=int(weight_bytes), activation_dtypes=facts.activation_dtypes,
        n_quantize=sum(q.op_type == QUANTIZE for q in facts.qdq),
        n_dequantize=sum(q.op_type == DEQUANTIZE for q in facts.qdq),
        n_per_channel=sum(q.per_channel for q in facts.qdq),
        inputs=inputs, outputs=outputs,
        memory=MemoryReport(stored.peak_bytes, stored.largest, folded.peak_bytes, folded.largest,
                            list(stored.unknown_shapes)),
        float_tensors=list(facts.float_tensors) if activations_quantized else [],
        quant_spec=file.spec,
        float_ops=float_ops(file) if activations_quantized else {},
        weight_only=facts.weight_only.as_dict() if facts.weight_only is not None else None,
    )


def _elements(tensor: onnx.TensorProto) -> int:
    count = 1
    for d in tensor.dims:
        count *= max(d, 0)
    return count


def _itemsize(tensor: onnx.TensorProto) -> int:
    return dtype_size(tensor.data_type)


def inspect_file(path: str | Path | onnx.ModelProto | FileFacts) -> FileReport:
    """Report what ``path`` contains (``FileRefused``/``FileNotFoundError`` if unreadable)."""
    return report_of(facts_of(path))
