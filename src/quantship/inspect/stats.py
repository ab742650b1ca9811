"""What a QDQ file contains, counted on the file: Q/DQ nodes, axes, zero-points, bare conv->add edges.

Every figure comes from reading the ONNX graph back; nothing is taken from the request that
produced it. Also reads the ``QuantSpec`` a quantship export wrote into ``metadata_props``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from quantship.precision import METADATA_KEY, QuantSpec

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
# element-wise activations a conv result may pass through on its way to an Add (one consumer each)
PASSTHROUGH_ACTIVATIONS = frozenset({
    "Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu",
    "Gelu", "Mish", "Softplus", "PRelu",
})


@dataclass(frozen=True)
class QDQStats:
    """Quantization nodes found in an ONNX graph, and the conv->add edges that carry no Q/DQ pair.

    ``n_per_channel``: Q/DQ nodes whose scale has more than one element. ``n_nonzero_zero_point``:
    Q/DQ nodes with any non-zero zero-point element. ``n_uint8``: Q/DQ nodes whose zero-point is
    uint8. ``n_unquantized_conv_add``: Add inputs that come straight from a Conv (through
    single-consumer activations) with no Q/DQ pair in between.
    """

    n_quantize: int
    n_dequantize: int
    n_per_channel: int
    n_nonzero_zero_point: int
    n_unquantized_conv_add: int
    n_uint8: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _load(path: str | Path | onnx.ModelProto, external: bool = True) -> onnx.ModelProto:
    if isinstance(path, onnx.ModelProto):
        return path
    return onnx.load(str(path), load_external_data=external)


def constant_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Every initializer and ``Constant`` output of the main graph, by name."""
    values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
    return values


def _is_unquantized_conv_edge(value: str, producer: dict[str, onnx.NodeProto], n_consumers: dict[str, int]) -> bool:
    """Does ``value`` come from a Conv through single-consumer activations only (no Q/DQ)?"""
    node = producer.get(value)
    while node is not None and node.op_type in PASSTHROUGH_ACTIVATIONS:
        if n_consumers.get(node.output[0], 0) != 1 or not node.input:
            return False
        node = producer.get(node.input[0])
    return node is not None and node.op_type == "Conv"


def qdq_stats(path: str | Path | onnx.ModelProto) -> QDQStats:
    """Count the Q/DQ nodes of an ONNX file (or in-memory model) and audit their zero-points."""
    model = _load(path)
    consts = constant_values(model)
    counts = {"QuantizeLinear": 0, "DequantizeLinear": 0}
    n_per_channel = n_nonzero = n_uint8 = 0
    producer: dict[str, onnx.NodeProto] = {}
    n_consumers: dict[str, int] = {}
    for node in model.graph.node:
        for out in node.output:
            producer[out] = node
        for inp in node.input:
            n_consumers[inp] = n_consumers.get(inp, 0) + 1
        if node.op_type not in QDQ_OPS:
            continue
        counts[node.op_type] += 1
        scale = consts.get(node.input[1]) if len(node.input) > 1 else None
        if scale is not None and scale.size > 1:
            n_per_channel += 1
        zero_point = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if zero_point is not None:
            if np.any(zero_point != 0):
                n_nonzero += 1
            if zero_point.dtype == np.uint8:
                n_uint8 += 1
    for out in model.graph.output:
        n_consumers[out.name] = n_consumers.get(out.name, 0) + 1
    n_bare = sum(
        _is_unquantized_conv_edge(inp, producer, n_consumers)
        for node in model.graph.node if node.op_type == "Add" for inp in node.input
    )
    return QDQStats(
        n_quantize=counts["QuantizeLinear"], n_dequantize=counts["DequantizeLinear"],
        n_per_channel=n_per_channel, n_nonzero_zero_point=n_nonzero,
        n_unquantized_conv_add=n_bare, n_uint8=n_uint8,
    )


def quant_spec_of_file(path: str | Path | onnx.ModelProto) -> QuantSpec | None:
    """The ``QuantSpec`` written into the file's ``metadata_props``; ``None`` if the file carries none."""
    model = _load(path, external=False)
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            return QuantSpec.from_json(prop.value)
    return None
