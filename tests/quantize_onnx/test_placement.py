"""One small graph per role: the exact Q/DQ layout the quantizer writes, and what ONNX Runtime then runs."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from quantship.errors import SpecRefused
from quantship.quantize_onnx import quantize_onnx_file
from tests.quantize_onnx import graphs


def _quantize(tmp_path, m, data, target="onnxruntime-cpu", **kwargs):
    src = graphs.save(m, tmp_path / "float.onnx")
    result = quantize_onnx_file(src, tmp_path / f"int8_{target}.onnx", data, target=target, **kwargs)
    return result, onnx.load(str(result.path))


def _ops(m: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in m.graph.node)


def _consumers(m: onnx.ModelProto, tensor: str) -> list[str]:
    return [n.op_type for n in m.graph.node if tensor in n.input]


def _init(m: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == name))


def test_conv_relu_conv_quantizes_after_the_relu_and_runs_two_integer_convs(tmp_path):
    result, q = _quantize(tmp_path, graphs.conv_relu_conv(), [graphs.images(8), graphs.images(8, seed=1)])
    ops = _ops(q)
    # activations: the input, the Relu's output (not the Conv's), the last Conv's output
    assert ops["QuantizeLinear"] == 3 and ops["DequantizeLinear"] == 3 + 2  # + two weights
    assert _consumers(q, "c1") == ["Relu"] and "r1_QuantizeLinear" in [n.name for n in q.graph.node]
    assert result.census["integer"] == {"QLinearConv": 2} and result.census["n_float"] == 0
    assert result.qdq_stats.n_per_channel == 2 and result.qdq_stats.n_uint8 > 0
    w = _init(q, "w1_quantized")
    assert w.dtype == np.int8 and np.abs(w).max() == 63  # onnxruntime-cpu: reduce_range, 7-bit weights
    assert [o.name for o in q.graph.output] == ["y"] and result.verdict.ok


def test_tensorrt_preset_writes_int8_symmetric_full_range(tmp_path):
    result, q = _quantize(tmp_path, graphs.conv_relu_conv(), [graphs.images(8)], target="tensorrt")
    assert result.qdq_stats.n_uint8 == 0 and result.qdq_stats.n_nonzero_zero_point == 0
    assert np.abs(_init(q, "w1_quantized")).max() == 127
    assert all(any(a.name == "kernel_shape" for a in n.attribute) for n in q.graph.node if n.op_type == "Conv")
    assert result.verdict.verdict == "not run" and result.verdict.ok  # TensorRT does not run here: never "accepted"


def test_reshape_shares_its_input_scale(tmp_path):
    result, q = _quantize(tmp_path, graphs.conv_reshape_matmul(), [graphs.images(8, (3, 4, 4))])
    assert _ops(q)["QuantizeLinear"] == 3  # input, conv output, reshape output (tied); fc writes float
    assert _init(q, "c1_scale") == _init(q, "flat_scale") and _init(q, "c1_zero_point") == _init(q, "flat_zero_point")
    assert result.census["integer"] == {"MatMulIntegerToFloat": 1, "QLinearConv": 1}
    assert result.plan["roles"]["shared"] == 1


def test_activation_times_activation_matmul_quantizes_both_inputs(tmp_path):
    data = [np.random.default_rng(0).standard_normal((4, 6, 8)).astype(np.float32)]
    result, q = _quantize(tmp_path, graphs.attention_matmul(), data)
    assert result.plan["roles"] == {"weighted:MatMul": 2, "matmul": 1, "shared": 1}
    scores = next(n for n in q.graph.node if n.name == "scores")
    producers = {o: n.op_type for n in q.graph.node for o in n.output}
    assert [producers[i] for i in scores.input] == ["DequantizeLinear", "DequantizeLinear"]
    assert result.census["n_float"] == 0 and result.census["n_integer"] == 3


def test_concat_ties_close_ranges_to_one_scale(tmp_path):
    result, q = _quantize(tmp_path, graphs.concat_convs(), [graphs.images(8, (3, 4, 4))])
    assert _init(q, "a_scale") == _init(q, "b_scale") == _init(q, "cat_scale")
    assert result.census["integer"] == {"QLinearConv": 3}


def test_written_out_layernorm_stays_float_for_onnxruntime_and_its_statistics_stay_float_for_tigris(tmp_path):
    data = [np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)]
    result, q = _quantize(tmp_path, graphs.written_layernorm(), data)
    quantized = {n.input[0] for n in q.graph.node if n.op_type == "QuantizeLinear"}
    # none of the normalisation's arithmetic gets a pair, only its result (fc2 reads it); fc1 and fc2
    # write float results (MatMulIntegerToFloat): the normalisation reads fc1's exact output
    assert quantized == {"x", "n1"}
    assert result.census["integer"] == {"MatMulIntegerToFloat": 2}
    assert result.placement.mode == "integer"
    tokens = [np.random.default_rng(0).standard_normal((16, 4, 8)).astype(np.float32)]
    full, qt = _quantize(tmp_path, graphs.written_layernorm(tokens=4), tokens, target="tigris")
    assert full.placement.mode == "full" and full.verdict.verdict in ("accepted", "failed")  # tigris may not compile
    assert not [f for f in full.verdict.findings if f.rule == "fully_quantized"]
    # full placement: every activation has a pair but the normalisation's statistics (float islands, named)
    assert set(full.plan["float_islands"]["normalisation_statistics"]["tensors"]) == {"mu", "d2", "var", "ve", "sd"}
    assert {n.input[0] for n in qt.graph.node if n.op_type == "QuantizeLinear"} == {"x", "h", "d", "n1", "y_float"}
    assert full.qdq_stats.n_nonzero_zero_point == 0


def test_integer_ids_stay_integer_and_the_rows_read_are_quantized(tmp_path):
    ids = np.random.default_rng(0).integers(0, 257, (8, 5)).astype(np.int32)
    result, q = _quantize(tmp_path, graphs.integer_ids(), [ids])
    assert _consumers(q, "ids") == ["Gather"]  # no QuantizeLinear on the int32 input
    assert "emb_QuantizeLinear" in [n.name for n in q.graph.node]
    assert result.census["integer"] == {"MatMulIntegerToFloat": 1}  # its result is the float output


def test_float_data_with_fractions_for_an_integer_input_is_refused(tmp_path):
    from quantship.errors import DataRefused

    with pytest.raises(DataRefused, match="'ids' is declared int32.*40 value.s. with a fraction"):
        _quantize(tmp_path, graphs.integer_ids(), [np.full((8, 5), 0.5, np.float32)])
    whole = np.random.default_rng(0).integers(0, 257, (8, 5)).astype(np.float32)  # cast exactly to int32
    result, _ = _quantize(tmp_path, graphs.integer_ids(), [whole])
    assert result.verdict.verdict == "accepted"


def test_a_shared_weight_is_stored_once_and_dequantized_per_conv(tmp_path):
    result, q = _quantize(tmp_path, graphs.shared_weight(), [graphs.images(3, (3, 4, 4))])
    stored = [t.name for t in q.graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 4]
    assert stored == ["w_quantized"]
    dqs = [n for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "w_quantized"]
    assert len(dqs) == 2
    add = next(n for n in q.graph.node if n.name == "add_w")
    assert "w" in add.input  # the Add keeps the float weight
    assert result.census["integer"] == {"QLinearConv": 2}


def test_depthwise_5x5_stays_float_for_onnxruntime_and_says_why(tmp_path):
    result, q = _quantize(tmp_path, graphs.depthwise_5x5(), [graphs.images(8)])
    assert list(result.plan["kept_float"]) == ["dw"] and "depthwise" in result.plan["kept_float"]["dw"]
    assert result.census["integer"] == {"QLinearConv": 2} and result.census["float"]
    ov, _ = _quantize(tmp_path, graphs.depthwise_5x5(), [graphs.images(8)], target="openvino")
    assert ov.plan["kept_float"] == {} and ov.plan["n_weighted"] == 3


@pytest.mark.parametrize("pattern, kept", [("conv2", ["conv2"]), ("*2", ["conv2"]), ("Relu", ["relu1"])])
def test_exclude_by_name_glob_or_op_type(tmp_path, pattern, kept):
    result, q = _quantize(tmp_path, graphs.conv_relu_conv(), [graphs.images(8)], exclude=[pattern])
    assert result.excluded == kept and result.spec.skip_activations is not None
    if "conv2" in kept:
        conv2 = next(n for n in q.graph.node if n.name == "conv2")
        assert conv2.input[1] == "w2"  # its weight stays float


def test_an_exclude_that_matches_nothing_is_refused(tmp_path):
    with pytest.raises(SpecRefused, match="matches no node"):
        _quantize(tmp_path, graphs.conv_relu_conv(), [graphs.images(8)], exclude=["conv9"])


def test_every_observer_writes_a_file(tmp_path):
    scales = {}
    for observer in ("minmax", "histogram", "percentile", "mse"):
        result, q = _quantize(tmp_path, graphs.conv_relu_conv(), [graphs.images(16)], observer=observer)
        assert result.spec.act_observer == observer
        scales[observer] = float(_init(q, "r1_scale"))
    assert scales["minmax"] >= max(scales["percentile"], scales["mse"])  # the clipping rules never widen min/max


def test_a_projection_with_a_bias_add_on_a_static_3d_input_runs_as_an_integer_kernel(tmp_path):
    """A BERT projection at batch 1: MatMul(x, W) + b on a static [1, S, H] tensor. ONNX Runtime folds a
    MatMul and its bias Add into a Gemm before its QDQ fusions run; with a float result that Gemm stays
    float, on dequantized weights. The MatMul's result is quantized instead, and nothing runs float."""
    from onnx import helper

    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="proj"),
             helper.make_node("Add", ["m", "b"], ["a"], name="bias"),
             helper.make_node("Softmax", ["a"], ["y"], axis=-1, name="softmax")]
    m = graphs.model(nodes, [graphs.value("x", [1, 16, 8])], [graphs.value("y", [1, 16, 8])],
                     [graphs.weight(8, 8, name="w"), graphs.weight(8, name="b")])
    data = [np.random.default_rng(0).standard_normal((1, 16, 8)).astype(np.float32) for _ in range(4)]
    result, q = _quantize(tmp_path, m, data)
    assert "m_QuantizeLinear" in [n.name for n in q.graph.node]
    assert result.census["n_float"] == 0 and result.census["n_integer"] == 1, result.census
