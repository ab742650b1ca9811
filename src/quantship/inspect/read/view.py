"""An indexed, shape-inferred view of an ONNX graph: who produces and consumes each tensor.

Every reader in ``inspect`` (format, rules, memory, counts, scales) walks the same view, so a
tensor is classified (constant, activation, dtype, shape) and a constant is decoded in one place.
A field that cannot be read (an unknown element type, an absurd dimension, tensor data that does
not fit its dims) is refused as ``FileRefused`` naming the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from quantship.errors import FileRefused, cause

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"
# ops that only relabel shape: their output shares storage with their input
SHAPE_ONLY = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
# ops that move rows of their data input by indices: a stored data input is a table (an embedding), which
# no integer kernel multiplies
TABLE_READERS = ("Gather", "GatherElements", "GatherND")
# activations a runtime fuses into the operator that feeds them (pt2e annotates conv+relu as one)
FUSED_ACTIVATIONS = frozenset({"Relu", "Clip"})
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                         onnx.TensorProto.BFLOAT16})
KNOWN_TYPES = frozenset(v for v in onnx.TensorProto.DataType.values() if v)  # 0 is "undefined"
# no real model has a dimension (or a tensor) this large; such a value is corruption
MAX_DIM = 1 << 40
MAX_ELEMENTS = 1 << 44


def node_label(node: onnx.NodeProto, index: int) -> str:
    """A node's name, or ``OpType#index`` when the file left it unnamed."""
    return node.name or f"{node.op_type}#{index}"


def dtype_name(elem_type: int) -> str:
    """``int8``, ``float32``... for an ONNX element type (``undefined`` when unset or unknown)."""
    if not elem_type or elem_type not in KNOWN_TYPES:
        return "undefined"
    if elem_type == onnx.TensorProto.BFLOAT16:
        return "bfloat16"
    return str(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


def dtype_size(elem_type: int) -> int:
    """Bytes per element of an ONNX element type (0 when unset or unknown)."""
    if not elem_type or elem_type not in KNOWN_TYPES:
        return 0
    if elem_type == onnx.TensorProto.BFLOAT16:
        return 2
    return int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)


_PROBE_KEEPS_DATA = 4096  # bytes: shape tensors, axes and scalars keep their values for data propagation


def _shape_probe(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` for shape inference in which large initializers keep their dims but not their data.

    Inference reads only the dims of a weight, so the weights are not copied (a model's size in memory
    is not doubled, and one over 2 GB can still be inferred).
    """
    probe = onnx.ModelProto()
    for name in ("ir_version", "producer_name", "producer_version", "domain", "model_version"):
        setattr(probe, name, getattr(model, name))
    probe.opset_import.extend(model.opset_import)
    probe.functions.extend(model.functions)
    source, graph = model.graph, probe.graph
    graph.name = source.name
    graph.node.extend(source.node)
    graph.input.extend(source.input)
    graph.output.extend(source.output)
    graph.value_info.extend(source.value_info)
    graph.sparse_initializer.extend(source.sparse_initializer)
    for tensor in source.initializer:
        if tensor.ByteSize() <= _PROBE_KEEPS_DATA:
            graph.initializer.append(tensor)
        else:
            light = graph.initializer.add()
            light.name, light.data_type = tensor.name, tensor.data_type
            light.dims.extend(tensor.dims)
    return probe


def _refuse_type(source: str, what: str, elem_type: int) -> None:
    if elem_type and elem_type not in KNOWN_TYPES:
        raise FileRefused(f"{source}: {what} has element type {elem_type}, which ONNX does not define; "
                          "the file is corrupt or from a newer ONNX: re-export it")


def _refuse_dims(source: str, what: str, dims) -> None:
    count = 1
    for dim in dims:
        if abs(dim) > MAX_DIM:
            raise FileRefused(f"{source}: {what} declares a dimension of {dim}; the file is corrupt: re-export it")
        count *= max(dim, 1)
    if count > MAX_ELEMENTS:
        raise FileRefused(f"{source}: {what} declares {count} elements; the file is corrupt: re-export it")


@dataclass
class GraphView:
    """Indexes over one ONNX graph; build it with ``GraphView.of(model)``."""

    model: onnx.ModelProto
    nodes: list[onnx.NodeProto]
    source: str = "the model"  # the file's path, for messages
    producer: dict[str, int] = field(default_factory=dict)  # tensor -> node index
    consumers: dict[str, list[int]] = field(default_factory=dict)
    initializers: dict[str, onnx.TensorProto] = field(default_factory=dict)
    constant: set[str] = field(default_factory=set)  # computed from constants only
    elem_type: dict[str, int] = field(default_factory=dict)
    shape: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    _values: dict[str, np.ndarray | None] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, model: onnx.ModelProto, source: str = "the model") -> GraphView:
        """Index ``model`` (refusing unreadable fields, see the module docstring) and infer its shapes once."""
        graph = model.graph
        view = cls(model=model, nodes=list(graph.node), source=source)
        view._refuse_unreadable()
        view.initializers = {t.name: t for t in graph.initializer}
        view.inputs = [i.name for i in graph.input if i.name not in view.initializers]
        view.outputs = [o.name for o in graph.output]
        for index, node in enumerate(view.nodes):
            for name in node.output:
                if name:
                    view.producer[name] = index
            for name in node.input:
                if name:
                    view.consumers.setdefault(name, []).append(index)
        for index, node in enumerate(view.nodes):  # every walk below relies on it (no cycles)
            late = next((n for n in node.input if n and view.producer.get(n, -1) >= index), None)
            if late is not None:
                raise FileRefused(f"{source}: node {node.name or node.op_type!r} reads {late!r} before it is "
                                  "produced (the graph is not topologically sorted, or a tensor has two "
                                  "producers); re-export it")
        view._infer_types(model)
        view.constant = set(view.initializers)
        for node in view.topological():
            ins = [n for n in node.input if n]
            if all(n in view.constant for n in ins):
                view.constant.update(n for n in node.output if n)
        return view

    def _refuse_unreadable(self) -> None:
        """Element types ONNX does not define and absurd dimensions, wherever the file declares them."""
        graph = self.model.graph
        for kind, values in (("input", graph.input), ("output", graph.output), ("value_info", graph.value_info)):
            for value in values:
                tensor_type = value.type.tensor_type
                _refuse_type(self.source, f"{kind} {value.name!r}", tensor_type.elem_type)
                _refuse_dims(self.source, f"{kind} {value.name!r}",
                             [d.dim_value for d in tensor_type.shape.dim if d.HasField("dim_value")])
        tensors = [(f"initializer {t.name!r}", t) for t in graph.initializer]
        tensors += [(f"the value of Constant {n.output[0] if n.output else n.name!r}", a.t)
                    for n in graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
        for what, tensor in tensors:
            _refuse_type(self.source, what, tensor.data_type)
            _refuse_dims(self.source, what, tensor.dims)

    def _infer_types(self, model: onnx.ModelProto) -> None:
        """Element types and static shapes, with unset input dimensions taken as 1."""
        probe = _shape_probe(model)
        for value in probe.graph.input:
            for dim in value.type.tensor_type.shape.dim:
                if not dim.HasField("dim_value") or dim.dim_value < 0:  # a negative dim is dynamic too
                    dim.dim_value = 1
        try:
            probe = onnx.shape_inference.infer_shapes(probe, strict_mode=False, data_prop=True)
        except Exception:  # inference is best effort: unknown shapes are reported, not fatal
            pass
        graph = probe.graph
        for value in [*graph.input, *graph.value_info, *graph.output]:
            tensor_type = value.type.tensor_type
            if tensor_type.elem_type:
                self.elem_type.setdefault(value.name, tensor_type.elem_type)
            if tensor_type.HasField("shape"):
                dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
                self.shape.setdefault(value.name, None if None in dims else tuple(dims))
        for name in list(self.elem_type):
            if self.elem_type[name] not in KNOWN_TYPES:  # inference copies what the file declares
                del self.elem_type[name]
        for name, shape in list(self.shape.items()):
            if shape is not None and any(d < 0 or d > MAX_DIM for d in shape):
                self.shape[name] = None
        for name, tensor in self.initializers.items():
            self.elem_type[name] = tensor.data_type
            self.shape[name] = tuple(tensor.dims)

    def topological(self) -> list[onnx.NodeProto]:
        """Nodes in the file's order (``onnx.checker`` has already required it to be topological)."""
        return self.nodes

    def node_of(self, tensor: str) -> onnx.NodeProto | None:
        index = self.producer.get(tensor)
        return None if index is None else self.nodes[index]

    def consumer_nodes(self, tensor: str) -> list[onnx.NodeProto]:
        return [self.nodes[i] for i in self.consumers.get(tensor, [])]

    def value(self, tensor: str) -> np.ndarray | None:
        """The value of an initializer or ``Constant`` output (None for anything computed).

        quantship's one constant reader: decoded once per view, refused as ``FileRefused`` when the
        stored data does not decode (wrong length for its dims, a type numpy cannot hold).
        """
        if tensor not in self._values:
            self._values[tensor] = self._decode(tensor)
        return self._values[tensor]

    def passing(self, tensor: str) -> np.ndarray | None:
        """``value(tensor)`` for one use: decoded (or the kept copy when ``value`` decoded it) but not kept, so
        reading every stored weight once (``quantization``'s integer extent of each) does not hold a decoded copy
        of all of them beside the model."""
        return self._values[tensor] if tensor in self._values else self._decode(tensor)

    def _decode(self, tensor: str) -> np.ndarray | None:
        proto = self.initializers.get(tensor)
        if proto is None:
            node = self.node_of(tensor)
            if node is None or node.op_type != "Constant":
                return None
            proto = next((a.t for a in node.attribute if a.name == "value"), None)
            if proto is None:
                return None
        try:
            return numpy_helper.to_array(proto)
        except Exception as exc:  # onnx/numpy raise ValueError, TypeError, KeyError... on corrupt data
            raise FileRefused(f"{self.source}: the data of tensor {tensor!r} cannot be read ({cause(exc)}); "
                              "the file is corrupt: re-export it") from None

    def constants(self) -> dict[str, np.ndarray]:
        """Every initializer and ``Constant`` output, by name (decoded by ``value``)."""
        names = [*self.initializers, *(n.output[0] for n in self.nodes if n.op_type == "Constant" and n.output)]
        return {name: value for name in names if (value := self.value(name)) is not None}

    def is_float(self, tensor: str) -> bool:
        return self.elem_type.get(tensor) in FLOAT_TYPES

    def through_shape_ops_up(self, tensor: str) -> str:
        """Follow shape-only producers back to the tensor that holds the values."""
        node = self.node_of(tensor)
        while node is not None and node.op_type in SHAPE_ONLY and node.input:
            tensor = node.input[0]
            node = self.node_of(tensor)
        return tensor

    def gathered_from_constant(self, tensor: str) -> bool:
        """Whether ``tensor`` is rows a table reader (Gather) took from a constant by indices: stored values moved,
        not computed (a quantized embedding's integer rows, dequantized after the Gather)."""
        node = self.node_of(tensor)
        return node is not None and node.op_type in TABLE_READERS and bool(node.input) and node.input[0] in self.constant

    def fused_into_producer(self, node: onnx.NodeProto) -> bool:
        """Whether ``node`` is an activation fused into the computing op that feeds only it."""
        if node.op_type not in FUSED_ACTIVATIONS or not node.input:
            return False
        source = self.node_of(node.input[0])
        return (source is not None and source.op_type not in (QUANTIZE, DEQUANTIZE)
                and len(self.consumers.get(node.input[0], [])) == 1)

    def through_shape_ops_down(self, tensor: str) -> list[tuple[str, onnx.NodeProto | None]]:
        """Every (tensor, consumer) the values reach, looking through shape-only consumers
        and through an activation fused into the op that produced ``tensor``.

        A graph output reached this way is reported with consumer ``None``.
        """
        found: list[tuple[str, onnx.NodeProto | None]] = []
        stack = [tensor]
        while stack:
            current = stack.pop()
            if current in self.outputs:
                found.append((current, None))
            for node in self.consumer_nodes(current):
                passes = node.op_type in SHAPE_ONLY or self.fused_into_producer(node)
                if passes and node.input and node.input[0] == current:
                    stack.extend(o for o in node.output if o)
                else:
                    found.append((current, node))
        return found
