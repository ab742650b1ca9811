"""A stored table read by computed indices (an embedding's word table) is stored in 8 bits, under the
scale its Gather's output is quantized at, and ONNX Runtime gathers the 8-bit rows (``tables``)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from quantship.inspect.read.facts import read_file
from quantship.quantize_onnx import quantize_onnx_file
from quantship.quantize_onnx.tables import TABLE_BOUND, table_scale
from tests.quantize_onnx import graphs

VOCAB = 1000


def _ids(n: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (n, 6)).astype(np.int64)


def _quantize(tmp_path, target="onnxruntime-cpu", **kwargs):
    src = graphs.save(graphs.embedding_matmul(VOCAB), tmp_path / "float.onnx")
    data = [_ids(16, 0), _ids(16, 1)] if target != "tigris" else [_ids(1, k) for k in range(8)]
    result = quantize_onnx_file(src, tmp_path / f"int8_{target}.onnx", data, target=target, **kwargs)
    return src, result, onnx.load(str(result.path))


def _init(m: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == name))


def _node(m: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in m.graph.node if n.name == name)


@pytest.mark.parametrize("target, stored", [("onnxruntime-cpu", np.uint8), ("tensorrt", np.int8),
                                            ("openvino", np.uint8), ("tigris", np.int8)])
def test_the_word_table_is_stored_in_8_bits_under_its_output_scale(tmp_path, target, stored):
    src, result, q = _quantize(tmp_path, target)
    assert result.plan["n_tables"] == 1 and result.counts["tables"] == 1
    assert result.plan["roles"]["table:Gather"] == 1
    assert "words" not in {t.name for t in q.graph.initializer}  # no float copy left
    table = _init(q, "words_quantized")
    assert table.dtype == stored and table.shape == (VOCAB, 16)
    zero = int(_init(q, "words_zero_point"))
    assert zero == (128 if stored == np.uint8 else 0)  # symmetric: int8 zero-point 0, uint8 128
    bound = TABLE_BOUND  # 127 even with reduce_range (onnxruntime-cpu, openvino): no kernel multiplies it
    assert int(np.abs(table.astype(np.int64) - zero).max()) == bound  # the table's absmax on `bound` steps
    if result.placement.weight_bound == 63:  # the weights a u8s8 kernel reads keep 7 bits
        assert int(np.abs(_init(q, "w_quantized")).max()) == 63
        assert read_file(result.path).widest_stored_weight() == 63  # the reduce_range post-condition's figure
    words = numpy_helper.to_array(next(t for t in onnx.load(str(src)).graph.initializer if t.name == "words"))
    scale = float(_init(q, "words_scale"))
    assert scale == pytest.approx(table_scale(words, bound), rel=1e-6)
    # the Gather's output is quantized at the table's own scale and zero-point: DQ -> Gather -> Q is exact
    gather = _node(q, "embed")
    assert gather.input[1] == "ids"  # the indices stay integer, straight from the input
    out_q = next(n for n in q.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "emb")
    assert float(_init(q, out_q.input[1])) == scale and int(_init(q, out_q.input[2])) == zero
    # the position rows are read by constant indices: a constant (folded by the tigris forms), not a table read
    assert "position_table_quantized" not in {t.name for t in q.graph.initializer}


def test_onnx_runtime_gathers_the_8bit_rows_without_dequantizing_the_table(tmp_path):
    src, result, q = _quantize(tmp_path)
    assert result.census["integer"] == {"MatMulIntegerToFloat": 1}
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(result.path), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx")).graph.node
    # the DQ -> Gather -> Q pair was dropped: ORT gathers the stored 8-bit rows and dequantizes only those
    gather = next(n for n in optimized if n.op_type == "Gather" and n.input[1] == "ids")
    assert gather.input[0] == "words_quantized"
    assert [n.input[0] for n in optimized if n.op_type == "DequantizeLinear"] == [gather.output[0]]
    # the file is a quarter of the float one (the table was 1000 x 16 float32)
    assert result.path.stat().st_size < 0.4 * src.stat().st_size
    # the rows read are the stored rows, exactly: the literal reading of emb is words_quantized's rows
    exposed = onnx.load(str(result.path))
    dq = next(n for n in exposed.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "emb_quantized")
    exposed.graph.output.append(onnx.ValueInfoProto(name=dq.output[0]))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(exposed.SerializeToString(), options, providers=["CPUExecutionProvider"])
    ids = _ids(4, 7)
    rows = session.run([dq.output[0]], {"ids": ids})[0]
    table = _init(q, "words_quantized").astype(np.float32) - float(_init(q, "words_zero_point"))
    np.testing.assert_array_equal(rows, table[ids] * np.float32(_init(q, "words_scale")))
    assert result.verdict.verdict == "accepted"


def test_an_excluded_gather_keeps_its_float_table(tmp_path):
    _, result, q = _quantize(tmp_path, exclude=["embed"])
    assert result.plan["n_tables"] == 0
    assert "words" in _node(q, "embed").input


def test_a_small_lookup_stays_float(tmp_path):
    # 100 x 16 values, under MIN_TABLE_VALUES: a lookup of scales or anchors may need float's range
    src = graphs.save(graphs.embedding_matmul(100), tmp_path / "float.onnx")
    ids = np.random.default_rng(0).integers(0, 100, (16, 6)).astype(np.int64)
    result = quantize_onnx_file(src, tmp_path / "int8.onnx", [ids], target="onnxruntime-cpu")
    assert result.plan["n_tables"] == 0
    assert "words" in _node(onnx.load(str(result.path)), "embed").input


def test_the_report_says_the_table_is_8bit(tmp_path, capsys):
    from quantship.cli.main import main

    src = graphs.save(graphs.embedding_matmul(VOCAB), tmp_path / "float.onnx")
    np.save(tmp_path / "ids.npy", _ids(16, 0))
    assert main(["quantize-onnx", str(src), "--calib", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "q.onnx")]) == 0
    text = "".join(capsys.readouterr().out.replace("│", " ").split())  # the table's cells wrap
    assert "1storedtable(s)readbyGatherin8bits" in text
