"""16-bit activations for chosen nodes (``quantize_onnx_file(int16=...)``, ``quantize-onnx --int16``).

The premise is built and measured, not assumed: ``outlier.model``'s hidden tensor ``h`` has one channel
400x wider than the rest, so min/max int8 rounds every other channel away and top-1 collapses; 16-bit
activations on its reader ``fc2`` keep them. Every figure below is measured on the written file."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from quantship.errors import ExportRefused, SpecRefused
from quantship.export.postconditions import check_spec_held
from quantship.inspect.judge.check import check_file
from quantship.inspect.read.facts import read_file
from quantship.inspect.read.stats import quant_spec_of_file
from quantship.inspect.run.consumers import ort_optimized_ops
from quantship.quantize_onnx import int16 as sixteen
from quantship.quantize_onnx.calibrate import TensorObserver
from quantship.quantize_onnx.quantizer import quantize_onnx_file
from quantship.quantize_onnx.search import search_onnx
from tests.quantize_onnx import graphs, outlier

BUDGET = 3.0  # points of top-1


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return outlier.files(tmp_path_factory.mktemp("int16"))


@pytest.fixture(scope="module")
def made(files, tmp_path_factory):
    """The plain int8 file and the one with fc2's activations in 16 bits, from the same calibration."""
    folder = tmp_path_factory.mktemp("made")
    x = np.load(files["calib"])
    plain = quantize_onnx_file(files["float"], folder / "plain.onnx", x, target="onnxruntime-cpu", observer="minmax")
    wide = quantize_onnx_file(files["float"], folder / "wide.onnx", x, target="onnxruntime-cpu", observer="minmax",
                              int16=["fc2"])
    return plain, wide


def _top1(path, ev, level) -> int:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return int((session.run(None, {"x": ev["x"]})[0].argmax(-1) == ev["y"]).sum())


def test_16_bit_on_the_wide_tensor_recovers_top1_over_int8_in_both_ort_readings(files, made):
    ev = np.load(files["eval"])
    n = len(ev["y"])  # y is the float file's own argmax: float top-1 is n/n
    plain, wide = made
    level = ort.GraphOptimizationLevel
    plain_default = _top1(plain.path, ev, level.ORT_ENABLE_ALL)
    for reading in (level.ORT_DISABLE_ALL, level.ORT_ENABLE_ALL):  # literal, and what InferenceSession(path) runs
        got = _top1(wide.path, ev, reading)
        assert got >= n - n * BUDGET / 100, f"16-bit file top-1 {got}/{n} at {reading}"
    assert plain_default < n / 2  # the premise, measured: int8 collapses on this tensor
    assert _top1(wide.path, ev, level.ORT_ENABLE_ALL) - plain_default > n / 2


def test_the_file_is_opset_21_with_16_bit_pairs_on_the_named_tensors_only(made):
    _, wide = made
    model = onnx.load(str(wide.path))
    assert {o.domain: o.version for o in model.opset_import}[""] == sixteen.INT16_OPSET
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta[sixteen.INT16_KEY] == "h" and wide.int16 == ["h"] and wide.as_dict()["int16"] == ["h"]
    facts = read_file(wide.path)
    by_dtype = {q.tensor: q.dtype for q in facts.quant.of_role("activation") if q.op_type == "QuantizeLinear"}
    assert by_dtype == {"x": "uint8", "h": "uint16"}
    assert {q.dtype for q in facts.quant.of_role("weight")} == {"int8"}  # fc1's weight
    # fc2 reads the 16-bit tensor: its weight stays float, else ORT fuses DQ(int8) -> MatMul into MatMulNBits,
    # which re-quantizes h to int8 at run time (the default reading fell to 61/128 before this rule)
    assert "MatMulNBits" not in ort_optimized_ops(wide.path)
    assert wide.counts["float_weights_of_int16_readers"] == 1 and wide.counts["int16_pairs"] == 1
    assert wide.verdict.ok  # check onnxruntime-cpu --run: both readings


def test_the_post_condition_holds_the_file_to_the_tensors_it_names(made):
    _, wide = made
    facts = read_file(wide.path)
    spec = quant_spec_of_file(facts)
    check_spec_held(facts, spec, activation_dtype="uint8", opset_version=21, int16_tensors=["h"])
    with pytest.raises(ExportRefused, match="16-bit activations"):
        check_spec_held(facts, spec, activation_dtype="uint8", opset_version=21)


def test_tigris_and_tensorrt_refuse_16_bit_activations_in_one_line(files, made, tmp_path):
    x = np.load(files["calib"])
    for target, consumer in (("tigris", "TiGrIS"), ("tensorrt", "TensorRT")):
        with pytest.raises(SpecRefused) as refused:
            quantize_onnx_file(files["float"], tmp_path / "t.onnx", x, target=target, int16=["fc2"])
        message = str(refused.value)
        assert "\n" not in message and consumer in message and "int16" in message
    assert not list(tmp_path.iterdir())
    _, wide = made  # and their rules refuse the onnxruntime-cpu file, naming the 16-bit pair
    report = check_file(wide.path, "tigris")
    assert not report.ok and any(f.rule == "activation_dtype" and "uint16" in f.message for f in report.errors)
    assert check_file(wide.path, "onnxruntime-cpu").ok
    openvino = check_file(wide.path, "openvino")  # it runs such a file, not as its Q/DQ arithmetic: a remark
    assert openvino.ok and any(f.rule == "activation_dtype" and f.severity == "warning" for f in openvino.findings)


def test_a_tie_widens_together_and_conv_weights_stay_int8(tmp_path):
    path = graphs.save(graphs.conv_reshape_matmul(), tmp_path / "crm.onnx")
    x = graphs.images(32, (3, 4, 4))
    done = quantize_onnx_file(path, tmp_path / "q.onnx", x, target="onnxruntime-cpu", int16=["fc"])
    assert done.int16 == ["c1", "flat"]  # the Reshape shares its input's scale: both in 16 bits, one scale
    facts = read_file(done.path)
    pairs = {q.tensor: (q.dtype, q.scale) for q in facts.quant.of_role("activation") if q.op_type == "QuantizeLinear"}
    assert pairs["c1"][0] == pairs["flat"][0] == "uint16" and pairs["c1"][1] == pairs["flat"][1]
    assert [q.dtype for q in facts.quant.of_role("weight")] == ["int8"]  # the Conv's
    float_out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    plain = quantize_onnx_file(path, tmp_path / "p.onnx", x, target="onnxruntime-cpu")
    errors = [np.abs(ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                     - float_out).max() for p in (done.path, plain.path)]
    assert errors[0] < errors[1]  # measured: the 16-bit file is the closer of the two


def test_a_gemm_reading_16_bits_keeps_its_int8_weight_and_runs_as_written(tmp_path):
    """A float Gemm weight between a 16-bit pair is quantized by ONNX Runtime itself, per tensor, at its default
    optimizations: on channel gains spanning 60 dB that took this file from 30.5 dB (read literally) to 6.6 dB
    (as users run it). The int8 per-channel weight is run as written: both readings agree."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((32, 16)) * np.logspace(0, -3, 32)[:, None]).astype(np.float32)
    w2 = rng.standard_normal((8, 32)).astype(np.float32)
    nodes = [onnx.helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="g1", transB=1),
             onnx.helper.make_node("Gemm", ["h", "w2", "b2"], ["y"], name="g2", transB=1)]
    inits = [onnx.numpy_helper.from_array(a, n) for a, n in
             ((w1, "w1"), (np.zeros(32, np.float32), "b1"), (w2, "w2"), (np.zeros(8, np.float32), "b2"))]
    path = graphs.save(graphs.model(nodes, [graphs.value("x", ["n", 16])], [graphs.value("y", ["n", 8])], inits),
                       tmp_path / "gemm.onnx")
    x = rng.standard_normal((256, 16)).astype(np.float32)
    done = quantize_onnx_file(path, tmp_path / "q.onnx", x[:128], target="onnxruntime-cpu", int16=["g2"])
    assert [q.dtype for q in read_file(done.path).quant.of_role("weight")] == ["int8", "int8"]
    level = ort.GraphOptimizationLevel
    readings = []
    for lvl in (level.ORT_DISABLE_ALL, level.ORT_ENABLE_ALL):
        options = ort.SessionOptions()
        options.graph_optimization_level = lvl
        readings.append(ort.InferenceSession(str(done.path), options).run(None, {"x": x[128:]})[0])
    assert np.array_equal(readings[0], readings[1])


def test_a_graph_output_widens_under_the_name_the_file_gives_its_float_value(tmp_path):
    path = graphs.save(graphs.conv_relu_conv(), tmp_path / "crc.onnx")
    x = graphs.images(32)
    done = quantize_onnx_file(path, tmp_path / "q.onnx", x, target="onnxruntime-cpu", int16=["conv2"])
    assert done.int16 == ["r1", "y_float"]  # conv2 reads r1 and writes y, a graph output read through its pair
    model = onnx.load(str(done.path))
    assert [o.name for o in model.graph.output] == ["y"] and done.verdict.ok
    assert {p.key: p.value for p in model.metadata_props}[sixteen.INT16_KEY] == "r1, y_float"


def test_the_16_bit_grid_covers_the_exact_range_seen():
    obs = TensorObserver.__new__(TensorObserver)
    obs.low, obs.high, obs.integral = -3.0, 1000.0, False
    scale, zero = sixteen.qparams_16([obs], "uint16", symmetric=False)
    assert (0 - zero) * scale == pytest.approx(-3.0, abs=scale) and (65535 - zero) * scale == pytest.approx(1000.0,
                                                                                                          abs=scale)
    scale, zero = sixteen.qparams_16([obs], "int16", symmetric=True)
    assert zero == 0 and 32767 * scale == pytest.approx(1000.0)


def test_the_search_tries_16_bit_before_float(files, tmp_path):
    ev = np.load(files["eval"])
    x = np.load(files["calib"])
    result, search = search_onnx(files["float"], tmp_path / "q.onnx", x, target="onnxruntime-cpu",
                                 observer="minmax", max_drop=BUDGET, labelled=(ev["x"], ev["y"]))
    assert search.drop(search.steps[0]) > BUDGET  # the premise
    assert search.steps[1].int16 == (search.order[0],) == ("fc2",) and search.steps[1].excluded == ()
    assert search.within(search.steps[1]) and len(search.steps) == 2
    assert result.int16 == ["h"] and result.excluded == [] and (tmp_path / "q.onnx").is_file()
    assert "16-bit: fc2" in search.chosen.forms() and search.as_dict()["chosen_int16"] == ["fc2"]
    # where the target runs no 16-bit activations, the same search keeps fc2 in float
    _, floated = search_onnx(files["float"], tmp_path / "f.onnx", x, target="onnxruntime-cpu", observer="minmax",
                             max_drop=BUDGET, labelled=(ev["x"], ev["y"]), try_int16=False)
    assert [s.int16 for s in floated.steps] == [(), ()] and floated.steps[1].excluded == ("fc2",)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantship", "quantize-onnx", *args], capture_output=True, text=True,
                          timeout=600)


def test_cli_int16_end_to_end(files, tmp_path):
    out = tmp_path / "q.onnx"
    done = _cli(str(files["float"]), "--calib", str(files["calib"]), "--out", str(out), "--observer", "minmax",
                "--int16", "fc2", "--eval", str(files["eval"]), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["int16"] == ["h"] and doc["verdict"] == "accepted" and out.is_file()
    assert doc["accuracy"]["int8_file_ort"]["correct"] >= len(np.load(files["eval"])["y"]) * (1 - BUDGET / 100)
    refused = _cli(str(files["float"]), "--calib", str(files["calib"]), "--out", str(tmp_path / "t.onnx"),
                   "--int16", "fc2", "--target", "tigris")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "TiGrIS" in lines[0] and "Traceback" not in refused.stderr
    typo = _cli(str(files["float"]), "--calib", str(files["calib"]), "--out", str(tmp_path / "u.onnx"),
                "--int16", "fc9")
    assert typo.returncode == 2 and "--int16 'fc9' matches no node" in typo.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx"]


def test_a_file_below_opset_21_whose_kernels_round_otherwise_there_still_gets_16_bits(tmp_path):
    """16-bit zero-points need opset 21. ONNX Runtime runs AveragePool's opset-19+ kernel, which rounds in
    another order than the opset-13 one (measured below: the same file converted gives other bytes). The
    conversion keeps the model; it used to be held to the same bytes and refused ("changed the outputs"), so a
    file below opset 21 with such an op got no 16-bit node (the PP-OCRv4 recognizer's repair: every 16-bit
    step "gives no file"). It is held to the float passes' tolerance now."""
    from onnx import version_converter

    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="c1", pads=[1, 1, 1, 1]),
             helper.make_node("AveragePool", ["c1"], ["pool"], name="pool", kernel_shape=[3, 2], strides=[3, 2]),
             helper.make_node("Conv", ["pool", "w2"], ["y"], name="c2")]
    m = graphs.model(nodes, [graphs.value("x", ["n", 3, 12, 40])], [graphs.value("y", ["n", 4, 4, 20])],
                     [graphs.weight(8, 3, 3, 3, name="w1"), graphs.weight(4, 8, 1, 1, name="w2")], opset=13)
    path = graphs.save(m, tmp_path / "pool13.onnx")
    x = (np.random.default_rng(0).standard_normal((16, 3, 12, 40)) * 20).astype(np.float32)
    literal = ort.SessionOptions()
    literal.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    before, after = (ort.InferenceSession(mm.SerializeToString(), literal, providers=["CPUExecutionProvider"])
                     .run(None, {"x": x})[0] for mm in (m, version_converter.convert_version(m, 21)))
    assert not np.array_equal(before, after)  # the premise: the kernels round otherwise
    assert np.abs(before - after).max() < 1e-5 * np.abs(before).max()
    done = quantize_onnx_file(path, tmp_path / "q.onnx", x, target="onnxruntime-cpu", int16=["c2"])
    assert done.int16  # written, with its 16-bit node(s)
    assert onnx.load(str(done.path)).opset_import[0].version == 21
