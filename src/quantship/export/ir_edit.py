"""Small onnx_ir edits shared by the ONNX front-end's passes and the export's: a pass record, opset
reading and conversion, fresh initializers, Constant nodes lifted to initializers, the statistics of a
BatchNormalization.

No Constant node is left by an edit here (``lift_constants`` after a conversion or a fold): TiGrIS's compiler
fails on one (the PP-OCRv4 recognizer's tigris file: an IndexError), and the rules read initializers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

DEFAULT_DOMAINS = ("", "ai.onnx")
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib operators (MatMulNBits, GatherBlockQuantized)


@dataclass(frozen=True)
class Pass:
    """One rewrite of the float model: ``run(model) -> number of changes`` (0: nothing to do)."""

    name: str
    run: Callable[[ir.Model], int]
    proof: str  # "exact": byte-identical outputs; "float": within FLOAT_TOLERANCE
    why: str


def _constant_tensor(node: ir.Node) -> ir.TensorProtocol | None:
    """The value of a ``Constant`` node, whatever attribute holds it (None for sparse values)."""
    for name, attr in node.attributes.items():
        if name == "value":
            return attr.as_tensor()
        if name in ("value_float", "value_int"):
            dtype = np.float32 if name == "value_float" else np.int64
            return ir.tensor(np.array(attr.value, dtype=dtype))
        if name in ("value_floats", "value_ints"):
            dtype = np.float32 if name == "value_floats" else np.int64
            return ir.tensor(np.array(list(attr.value), dtype=dtype))
    return None


def lift_constants(model: ir.Model) -> int:
    """``Constant`` nodes become initializers under their output's name (Paddle keeps every weight in one)."""
    graph = model.graph
    n = 0
    for node in list(graph):
        if node.op_type != "Constant" or node.domain not in DEFAULT_DOMAINS:
            continue
        value = node.outputs[0]
        tensor = _constant_tensor(node)
        if tensor is None or value.is_graph_output() or not value.name or value.name in graph.initializers:
            continue
        fresh = ir.Value(name=value.name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                         const_value=tensor)
        value.name = None  # free the name for the initializer
        value.replace_all_uses_with(fresh)
        graph.remove(node, safe=True)
        graph.register_initializer(fresh)
        n += 1
    return n


def default_opset(model: ir.Model) -> int:
    return int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1)))


def drop_unused_initializers(graph: ir.Graph) -> None:
    for name in [n for n, v in graph.initializers.items() if not v.uses() and not v.is_graph_output()
                 and not v.is_graph_input()]:
        del graph.initializers[name]


def convert_opset(model: ir.Model, version: int) -> int:
    """A model below ``version`` of the default domain converted to it in place (``onnx.version_converter``);
    1 if it was converted, 0 if it was there already."""
    if default_opset(model) >= version:
        return 0
    replace_model(model, ir.from_proto(onnx.version_converter.convert_version(ir.to_proto(model), version)))
    lift_constants(model)  # the converter writes an attribute that became an input (Squeeze's axes at 13) as a Constant
    return 1


def fresh_initializer(graph: ir.Graph, base: str, array: float | np.ndarray, dtype: type = np.float32) -> ir.Value:
    """An initializer holding ``array`` (a scalar, or an array as given) as ``dtype`` (float32 by default) under
    ``base``, or ``base_1``, ``base_2``... when a tensor of the graph already has that name."""
    used = set(graph.initializers) | {o.name for n in graph for o in n.outputs} | {v.name for v in graph.inputs}
    name, k = base, 0
    while name in used:
        k += 1
        name = f"{base}_{k}"
    array = np.asarray(array, dtype=dtype)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def replace_model(model: ir.Model, new: ir.Model) -> None:
    """Move ``new``'s graph and opsets into ``model`` (passes mutate the model they were given)."""
    opsets = dict(new.opset_imports)
    model.graph = new.graph  # the model's opset imports are its graph's
    model.ir_version = new.ir_version
    model.opset_imports.clear()
    model.opset_imports.update(opsets)


def batch_norm_statistics(bn: ir.Node) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(factor, beta, mean) in float64 of an inference-form BatchNormalization, which computes
    ``factor * (x - mean) + beta`` with ``factor = gamma / sqrt(var + epsilon)``; None when a statistic
    is not a stored constant."""
    params = [v.const_value.numpy().astype(np.float64) if v is not None and v.const_value is not None else None
              for v in bn.inputs[1:5]]
    if len(params) != 4 or any(p is None for p in params):
        return None
    gamma, beta, mean, var = params
    eps_attr = bn.attributes.get("epsilon")
    eps = float(eps_attr.value) if eps_attr is not None else 1e-5
    return gamma / np.sqrt(var + eps), beta, mean
