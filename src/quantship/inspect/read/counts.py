"""What a QDQ graph contains, counted on the graph: Q/DQ nodes, axes, zero-points, bare conv->add edges.

Every figure comes from reading the ONNX graph back; nothing is taken from the request that
produced it. The counting core: ``facts`` counts a file once with it, and ``stats`` gives the
public ``qdq_stats(path)`` on top of that one read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx

from quantship.inspect.read.quantization import one_pair
from quantship.inspect.read.view import DEQUANTIZE, FLOAT_TYPES, FUSED_ACTIVATIONS, QUANTIZE, SHAPE_ONLY, GraphView
from quantship.inspect.read.weight_only import float_weights_of

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
# element-wise activations a conv result may pass through on its way to an Add (one consumer each)
PASSTHROUGH_ACTIVATIONS = frozenset({
    "Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu",
    "Gelu", "Mish", "Softplus", "PRelu",
})
# the operators that carry a model's arithmetic: left in float, they run in float
COMPUTE_OPS = frozenset({
    "Conv", "ConvTranspose", "Gemm", "MatMul", "Einsum", "Attention", "MultiHeadAttention", "LSTM", "GRU", "RNN",
})


@dataclass(frozen=True)
class QDQStats:
    """Quantization nodes found in an ONNX graph, and the conv->add edges that carry no Q/DQ pair.

    ``n_per_channel``: Q/DQ nodes whose scale has more than one element. ``n_nonzero_zero_point``:
    Q/DQ nodes with any non-zero zero-point element. ``n_uint8``: Q/DQ nodes whose zero-point is
    uint8. ``n_unquantized_conv_add``: inputs of residual Adds (no constant operand) that come straight from
    a Conv (through single-consumer activations) with no Q/DQ pair in between. ``n_float_compute``: compute
    operators (Conv, Gemm, MatMul, ...) that run in float: reading a float activation that no
    DequantizeLinear produced, reading a stored float weight, or writing a result that no QuantizeLinear
    requantizes (``float_compute_nodes``).
    """

    n_quantize: int
    n_dequantize: int
    n_per_channel: int
    n_nonzero_zero_point: int
    n_unquantized_conv_add: int
    n_uint8: int = 0
    n_float_compute: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def constant_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Every initializer and ``Constant`` output of the main graph, by name (``GraphView.value`` decodes them)."""
    graph = model.graph
    view = GraphView(model=model, nodes=list(graph.node))
    view.initializers = {t.name: t for t in graph.initializer}
    view.producer = {out: index for index, node in enumerate(view.nodes) for out in node.output if out}
    return view.constants()


def _is_unquantized_conv_edge(view: GraphView, value: str, n_consumers: dict[str, int]) -> bool:
    """Does ``value`` come from a Conv through single-consumer activations only (no Q/DQ)?"""
    node = view.node_of(value)
    while node is not None and node.op_type in PASSTHROUGH_ACTIVATIONS:
        if not node.output or n_consumers.get(node.output[0], 0) != 1 or not node.input:
            return False
        node = view.node_of(node.input[0])
    return node is not None and node.op_type == "Conv"


def _reads_float_activation(view: GraphView, node: onnx.NodeProto) -> bool:
    for name in node.input:
        if not name or name in view.constant or view.elem_type.get(name, onnx.TensorProto.FLOAT) not in FLOAT_TYPES:
            continue
        source = view.node_of(view.through_shape_ops_up(name))
        if source is None or source.op_type != DEQUANTIZE:
            return True
    return False


# what a compute op's result may pass through and still be quantized "at its output": activations a
# runtime fuses into it and shape-only ops; an Add only when it adds a constant (a bias). A residual Add
# is not looked through: ONNX Runtime runs a conv whose result meets a float Add in float.
_FUSED_AFTER_COMPUTE = FUSED_ACTIVATIONS | SHAPE_ONLY


def _writes_float_activation(view: GraphView, node: onnx.NodeProto) -> bool:
    """Does the op's float result reach a graph output or an op other than QuantizeLinear (looking through
    ``_FUSED_AFTER_COMPUTE``)? Then a QDQ runtime cannot run the op in INT8: nothing requantizes it."""
    frontier = [name for name in node.output[:1] if name and view.is_float(name)]
    seen: set[str] = set()
    outputs = set(view.outputs)
    while frontier:
        name = frontier.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in outputs:
            return True
        for user in view.consumer_nodes(name):
            if user.op_type == QUANTIZE:
                continue
            bias_add = user.op_type == "Add" and any(i in view.constant for i in user.input if i != name)
            if (user.op_type in _FUSED_AFTER_COMPUTE or bias_add) and user.output:
                frontier.append(user.output[0])
                continue
            return True
    return False


FLOAT_INPUT, FLOAT_WEIGHT, FLOAT_OUTPUT = "input", "weight", "output"  # what shows a compute op is float


def float_compute_nodes(view: GraphView) -> list[tuple[int, onnx.NodeProto, str]]:
    """The compute operators (``COMPUTE_OPS``) that run in float in the file, in graph order, as (index,
    node, what shows it): those reading a float activation that no DequantizeLinear produced (``FLOAT_INPUT``),
    those reading a stored float weight (``FLOAT_WEIGHT``: a conv kept float between quantized neighbours), and
    those whose float result nothing requantizes (``FLOAT_OUTPUT``: it reaches an output or another op before
    any QuantizeLinear)."""
    found = []
    for i, node in enumerate(view.nodes):
        if node.op_type not in COMPUTE_OPS:
            continue
        if _reads_float_activation(view, node):
            found.append((i, node, FLOAT_INPUT))
        elif float_weights_of(view, node):
            found.append((i, node, FLOAT_WEIGHT))
        elif _writes_float_activation(view, node):
            found.append((i, node, FLOAT_OUTPUT))
    return found


def count_qdq(view: GraphView, n_float_compute: int | None = None) -> QDQStats:
    """The counts of ``QDQStats``, read off one view (``qdq_stats`` gets them from ``FileFacts``, which
    passes the float compute ops it already found)."""
    counts = dict.fromkeys(QDQ_OPS, 0)
    n_per_channel = n_nonzero = n_uint8 = 0
    for node in view.nodes:
        if node.op_type not in QDQ_OPS:
            continue
        counts[node.op_type] += 1
        scale = view.value(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        zero_point = view.value(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if scale is not None and scale.size > 1 and not one_pair(scale, zero_point):
            n_per_channel += 1
        if zero_point is not None:
            if zero_point.dtype.kind in "iufb" and np.any(zero_point != 0):
                n_nonzero += 1
            if zero_point.dtype == np.uint8:
                n_uint8 += 1
    n_consumers = {name: len(users) for name, users in view.consumers.items()}
    for name in view.outputs:
        n_consumers[name] = n_consumers.get(name, 0) + 1
    n_bare = sum(  # residual adds: an Add of a constant (a hard swish's x + 3) is an activation's arithmetic
        _is_unquantized_conv_edge(view, inp, n_consumers)
        for node in view.nodes if node.op_type == "Add" and all(view.value(i) is None for i in node.input if i)
        for inp in node.input
    )
    return QDQStats(
        n_quantize=counts["QuantizeLinear"], n_dequantize=counts["DequantizeLinear"],
        n_per_channel=n_per_channel, n_nonzero_zero_point=n_nonzero,
        n_unquantized_conv_add=n_bare, n_uint8=n_uint8,
        n_float_compute=len(float_compute_nodes(view)) if n_float_compute is None else n_float_compute,
    )
