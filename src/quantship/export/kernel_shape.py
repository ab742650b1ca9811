"""Write ``kernel_shape`` on every Conv, read from its weight through the Q/DQ chain.

The attribute is optional in ONNX and the dynamo exporter may omit it; parsers that only read
initializer shapes (TensorRT's) reject a QDQ Conv without it, because its weight is the output of
a DequantizeLinear. Nothing else changes.
"""

from __future__ import annotations

import onnx_ir as ir

from quantship.errors import KernelShapeRefused

# ops a Conv weight may pass through on its way from the stored integer tensor
_WEIGHT_CHAIN = frozenset({"DequantizeLinear", "QuantizeLinear", "Identity", "Cast"})


def _weight_shape(value: ir.Value) -> tuple[int, ...] | None:
    seen = 0
    while value is not None and seen < 8:
        if value.const_value is not None:
            return tuple(int(d) for d in value.const_value.shape)
        if value.shape is not None and value.shape.is_static():
            return tuple(int(d) for d in value.shape)
        producer = value.producer()
        if producer is None or producer.op_type not in _WEIGHT_CHAIN or not producer.inputs:
            return None
        value, seen = producer.inputs[0], seen + 1
    return None


def write_kernel_shapes(model: ir.Model) -> int:
    """Set ``kernel_shape`` on each Conv from its weight; returns how many were missing and written."""
    n_written = 0
    for node in model.graph:
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx"):
            continue
        shape = _weight_shape(node.inputs[1]) if len(node.inputs) > 1 else None
        if shape is None or len(shape) < 3:
            raise KernelShapeRefused(f"Conv {node.name!r}: its weight shape cannot be read from the file "
                                     "through the Q/DQ chain, so kernel_shape cannot be written")
        kernel = list(shape[2:])
        existing = node.attributes.get("kernel_shape")
        if existing is not None:
            if list(existing.as_ints()) != kernel:
                raise KernelShapeRefused(f"Conv {node.name!r}: kernel_shape {list(existing.as_ints())} "
                                         f"contradicts its weight shape {list(shape)}")
            continue
        node.attributes["kernel_shape"] = ir.AttrInt64s("kernel_shape", kernel)
        n_written += 1
    return n_written
