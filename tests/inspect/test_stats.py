"""qdq_stats counts what a file holds; quant_spec_of_file reads its spec back. Graphs built by hand."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantship.inspect.read.stats import QDQStats, qdq_stats, quant_spec_of_file
from quantship.precision import METADATA_KEY, resolve_spec


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _graph(*, quantize_residual: bool, relu_consumers: int = 1, zero_point=0, zp_dtype=np.int8) -> onnx.ModelProto:
    """x -> Q/DQ -> Conv(w: per-channel DQ) -> Relu -> Add(., x_dq) -> y, optionally Q/DQ before the Add."""
    inits = [
        _init("s", np.float32(0.1)), _init("zp", np.array(zero_point, dtype=zp_dtype)),
        _init("w_q", np.ones((2, 2, 1, 1), dtype=np.int8)), _init("w_s", np.array([0.1, 0.2], dtype=np.float32)),
        _init("w_zp", np.zeros(2, dtype=np.int8)),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "s", "zp"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_zp"], ["w"], axis=0),
        helper.make_node("Conv", ["x_dq", "w"], ["c"]),
        helper.make_node("Relu", ["c"], ["r"]),
    ]
    addend = "r"
    if quantize_residual:
        nodes += [helper.make_node("QuantizeLinear", ["r", "s", "zp"], ["r_q"]),
                  helper.make_node("DequantizeLinear", ["r_q", "s", "zp"], ["r_dq"])]
        addend = "r_dq"
    nodes.append(helper.make_node("Add", [addend, "x_dq"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])]
    if relu_consumers > 1:
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 2, 4, 4]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_counts_on_a_fully_quantized_graph():
    stats = qdq_stats(_graph(quantize_residual=True))
    assert stats == QDQStats(n_quantize=2, n_dequantize=3, n_per_channel=1, n_nonzero_zero_point=0,
                             n_unquantized_conv_add=0, n_uint8=0)
    assert list(stats.as_dict()) == ["n_quantize", "n_dequantize", "n_per_channel", "n_nonzero_zero_point",
                                     "n_unquantized_conv_add", "n_uint8", "n_float_compute"]


def test_a_conv_reaching_an_add_through_an_activation_is_counted():
    assert qdq_stats(_graph(quantize_residual=False)).n_unquantized_conv_add == 1


def test_an_activation_with_two_consumers_breaks_the_edge():
    assert qdq_stats(_graph(quantize_residual=False, relu_consumers=2)).n_unquantized_conv_add == 0


def test_uint8_and_nonzero_zero_points_are_counted_per_node():
    stats = qdq_stats(_graph(quantize_residual=True, zero_point=128, zp_dtype=np.uint8))
    assert stats.n_uint8 == 4 and stats.n_nonzero_zero_point == 4  # every activation Q/DQ; not the weight


def test_reads_a_file_and_its_spec(tmp_path):
    model = _graph(quantize_residual=True)
    path = tmp_path / "g.onnx"
    onnx.save(model, str(path))
    assert quant_spec_of_file(path) is None
    spec = resolve_spec("pt2e", qdq_placement="skip_conv_add")
    helper.set_model_props(model, {METADATA_KEY: spec.to_json()})
    onnx.save(model, str(path))
    assert quant_spec_of_file(path) == spec
    assert qdq_stats(path) == qdq_stats(model)


def test_a_conv_reading_a_float_activation_is_float_compute():
    model = _graph(quantize_residual=True)
    assert qdq_stats(model).n_float_compute == 0
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    conv.input[0] = "x"  # the raw float input, no DequantizeLinear in between
    assert qdq_stats(model).n_float_compute == 1


def test_a_conv_whose_result_nothing_requantizes_is_float_compute():
    """An op reading INT8 but writing a float result that reaches another op (or an output) before any
    QuantizeLinear runs in float too; a fused ReLU on the way is looked through."""
    model = _graph(quantize_residual=True)  # Conv -> Relu -> Q: the fused ReLU is looked through
    assert qdq_stats(model).n_float_compute == 0
    model.graph.output.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 2, 4, 4]))
    assert qdq_stats(model).n_float_compute == 1  # the raw conv result is also a float output
    # Conv -> Relu -> Add (a residual, not a bias: ONNX Runtime runs the conv in float) -> output
    assert qdq_stats(_graph(quantize_residual=False)).n_float_compute == 1


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        qdq_stats(tmp_path / "nothing.onnx")
