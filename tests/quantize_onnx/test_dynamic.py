"""``quantize-onnx --activations dynamic``: int8 per-column weights, activations quantized at run time.

On a small transformer block (``graphs.encoder_block``: seven weighted MatMul/Gemm, two activation x
activation MatMuls): what ONNX Runtime's optimized graph runs, the output against the float file, the
stored weights against their float originals, the provenance, and the refusals (one line, exit 2, no file).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from quantship.cli.main import main
from quantship.inspect.read.feeds import generated
from quantship.inspect.run.consumers import ort_optimized_ops, ort_session
from quantship.quantize_onnx.dynamic import ACTIVATIONS_KEY, WEIGHTS_KEY
from quantship.quantize_onnx.dynamic_file import quantize_dynamic_file
from tests.quantize_onnx import graphs

WEIGHTED = ("proj_q", "proj_k", "proj_v", "proj_o", "ffn_in", "ffn_out", "head")
BOUND = 63  # the onnxruntime-cpu preset's reduce_range weights


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("dynamic")
    float_path = graphs.save(graphs.encoder_block(), d / "float.onnx")
    result = quantize_dynamic_file(float_path, d / "dynamic.onnx")
    return float_path, result


def test_every_weight_matmul_runs_as_a_fused_integer_kernel_and_nothing_else_is_quantized(written):
    _, result = written
    ops = ort_optimized_ops(result.path)
    fused = ops["DynamicQuantizeMatMul"] + ops["MatMulIntegerToFloat"]
    assert fused == len(WEIGHTED) and sorted(layer.node for layer in result.plan.layers) == sorted(WEIGHTED)
    assert ops["MatMulInteger"] == 0 and ops["QuantizeLinear"] == ops["DequantizeLinear"] == 0
    # Q, K and V read one activation: one DynamicQuantizeLinear is left for their three MatMulIntegerToFloat
    assert ops["MatMulIntegerToFloat"] == 3 and ops["DynamicQuantizeLinear"] == 1
    assert ops["MatMul"] + ops["FusedMatMul"] == 2  # q @ k^T and p @ v stay float
    assert result.census["n_integer"] == len(WEIGHTED) and result.n_matmul_gemm == len(WEIGHTED) + 2
    assert set(result.plan.kept_float) == {"scores", "context"}
    assert result.verdict.verdict == "accepted" and result.inputs == "generated"


def test_the_file_is_close_to_the_float_file_in_both_readings(written):
    float_path, result = written
    x = np.random.default_rng(5).standard_normal((16, 6, 16)).astype(np.float32)
    ref = ort_session(float_path).run(None, {"x": x})[0].astype(np.float64)
    literal = ort_session(result.path).run(None, {"x": x})[0]
    fused = ort_session(result.path, optimized=True).run(None, {"x": x})[0]
    for out in (literal, fused):
        sqnr = 10 * np.log10((ref ** 2).sum() / ((out - ref) ** 2).sum())
        assert sqnr > 28.0, sqnr  # 7-bit weights and 8-bit activations on random weights measure ~34 dB here
    assert np.abs(fused - literal).max() <= 1e-4 * np.abs(ref).max()  # the fused kernels run the written arithmetic
    assert result.sqnr_db["y"]["fused"] > 28.0 and result.readings.literal_lsb is None  # no invented LSB


def test_stored_weights_are_int8_per_output_column_with_scales_recomputed_from_the_float_weight(written):
    float_path, result = written
    floats = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(float_path)).graph.initializer}
    model = onnx.load(str(result.path))
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    checked = 0
    for node in (n for n in model.graph.node if n.op_type == "MatMulInteger"):
        layer = next(la for la in result.plan.layers if node.name.startswith(la.node + "_"))
        w = floats[layer.weight]
        if layer.op_type == "Gemm":
            w = w.T * np.float32(0.5)  # transB=1, alpha=0.5 folded in
        scale_name = next(n.input[1] for n in model.graph.node  # Mul(x_scale, w_scale), the order ORT fuses
                          if n.op_type == "Mul" and n.name == f"{layer.node}_scales")
        q, scale = stored[node.input[1]], stored[scale_name]
        expected = np.maximum(np.abs(w).max(axis=0).astype(np.float32) / np.float32(BOUND),
                              np.finfo(np.float32).eps)
        assert q.dtype == np.int8 and scale.shape == (w.shape[1],)
        assert np.array_equal(scale, expected)
        assert np.array_equal(q, np.clip(np.rint(w / scale), -BOUND, BOUND).astype(np.int8))
        checked += 1
    assert checked == len(WEIGHTED)


def test_the_form_is_recorded_in_the_file(written):
    _, result = written
    meta = {p.key: p.value for p in onnx.load(str(result.path)).metadata_props}
    assert meta[ACTIVATIONS_KEY] == "dynamic" and meta["quantship.engine"] == "quantize_onnx"
    assert meta["quantship.target"] == "onnxruntime-cpu" and meta["quantship.activation_dtype"] == "uint8"
    assert json.loads(meta[WEIGHTS_KEY]) == {"dtype": "int8", "symmetric": True, "bound": BOUND,
                                             "qscheme": "per_channel", "reduce_range": True}


def test_an_excluded_projection_stays_float(written, tmp_path):
    float_path, _ = written
    result = quantize_dynamic_file(float_path, tmp_path / "q.onnx", exclude=["ffn_*"], run_check=False)
    assert result.census["n_integer"] == len(WEIGHTED) - 2 and result.excluded == ["ffn_in", "ffn_out"]
    assert result.plan.kept_float["ffn_in"] == "excluded (--exclude)"


def test_the_command_writes_it_without_calibration_data(written, tmp_path, capsys):
    float_path, _ = written
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(float_path), "--out", str(out), "--activations", "dynamic", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["activations"] == "dynamic" and report["census"]["n_integer"] == len(WEIGHTED)
    assert report["verdict"] == "accepted" and report["inputs"] == "generated" and out.is_file()


def test_given_data_is_what_the_file_is_read_on(written, tmp_path, capsys):
    float_path, _ = written
    np.save(tmp_path / "x.npy", np.random.default_rng(1).standard_normal((4, 6, 16)).astype(np.float32))
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(float_path), "--out", str(out), "--activations", "dynamic",
                 "--calib", str(tmp_path / "x.npy"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["inputs"] == "given" and report["fidelity"]["n_values"] == 4 * 3


@pytest.mark.parametrize("extra, message", [
    (["--int16", "proj_q"], "--int16 acts on calibrated static activations"),
    (["--bias-correction"], "--bias-correction acts on calibrated static activations"),
    (["--smooth-quant", "0.5"], "--smooth-quant acts on calibrated static activations"),
    (["--target", "tensorrt"], "target tensorrt needs static scales"),
    (["--target", "openvino"], "target openvino needs static scales"),
    (["--target", "tigris"], "target tigris needs static scales"),
    (["--engine", "ort"], "drop --engine ort"),
], ids=["int16", "bias-correction", "smooth-quant", "tensorrt", "openvino", "tigris", "engine ort"])
def test_a_combination_the_form_cannot_honour_exits_2_with_one_line_and_no_file(extra, message, written, tmp_path,
                                                                                 capsys):
    float_path, _ = written
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(float_path), "--out", str(out), "--activations", "dynamic", *extra]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], lines
    assert not list(tmp_path.iterdir())


def test_static_activations_still_need_calibration_data(written, tmp_path, capsys):
    float_path, _ = written
    assert main(["quantize-onnx", str(float_path), "--out", str(tmp_path / "q.onnx")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--calib DATA is required" in lines[0] and not list(tmp_path.iterdir())


def test_a_file_with_no_weight_matmul_is_refused_with_nothing_written(tmp_path, capsys):
    float_path = graphs.save(graphs.conv_relu_conv(), tmp_path / "convs.onnx")
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(float_path), "--out", str(out), "--activations", "dynamic"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Convs stay float" in lines[0] and not out.exists()


def test_an_embedding_table_is_stored_int8_and_its_gathered_rows_dequantized(tmp_path):
    from quantship.quantize_onnx.tables import TABLE_BOUND

    float_path = graphs.save(graphs.embedding_matmul(), tmp_path / "embed.onnx")
    ids = np.random.default_rng(2).integers(0, 1000, (8, 6)).astype(np.int64)
    result = quantize_dynamic_file(float_path, tmp_path / "q.onnx", ids)
    model = onnx.load(str(result.path))
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    gather = next(n for n in model.graph.node if n.name == "embed")
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    words = numpy_helper.to_array(graphs.weight(1000, 16, name="words"))
    scale = np.float32(float(np.abs(words).max()) / TABLE_BOUND)
    assert result.plan.tables == ["embed"] and dq.input[0] == gather.output[0]
    assert stored[dq.input[1]] == scale and "words" not in stored  # the float table is gone
    assert np.array_equal(stored[gather.input[0]], np.clip(np.rint(words / scale), -TABLE_BOUND, TABLE_BOUND))
    ref = ort_session(float_path).run(None, {"ids": ids})[0]
    got = ort_session(result.path, optimized=True).run(None, {"ids": ids})[0]
    assert np.abs(got - ref).max() < 0.02 * np.abs(ref).max() and result.census["n_integer"] == 1
    assert result.inputs == "given"
    seeded = generated(onnx.load(str(float_path))).batches  # without data: ids drawn below the table's row count
    drawn = np.concatenate([f["ids"] for f in seeded])
    assert drawn.dtype == np.int64 and 0 <= drawn.min() and drawn.max() < 1000 and len(np.unique(drawn)) > 1
