"""Speed against FP32 on every quantize (``inspect.run.speed``, ``export.speed_gate``): the record, the
warning and ``--require-faster`` on a file slower than FP32, the refusals, and the census of recurrent layers.

No assertion compares two timings closely: the slower case is a 1 -> 4 -> 8 channel CNN at 12 px, which ONNX
Runtime's integer kernels run at about 0.5-0.65x FP32 (FIELD-NOTES, "Speed, fidelity and scale"), far from 1.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from quantship.cli.main import main
from quantship.errors import SpecRefused, SpeedMissed
from quantship.export.speed_gate import SPEED_KEY
from quantship.inspect.run.speed import SpeedReading, measure_speed, sources
from quantship.inspect.run.timing import INT8_FLAGS
from quantship.quantize_onnx.repair import quantize_onnx
from tests.quantize_onnx import graphs


def small_cnn() -> onnx.ModelProto:
    """1 -> 4 -> 8 channels at 12 px: slower as INT8 than as FP32 in ONNX Runtime on the CPUs measured."""
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu_a"),
             helper.make_node("Conv", ["r0", "w1"], ["y"], name="conv_b", pads=[1, 1, 1, 1])]
    return graphs.model(nodes, [graphs.value("x", ["n", 1, 12, 12])], [graphs.value("y", ["n", 8, 12, 12])],
                        [graphs.weight(4, 1, 3, 3, name="w0"), graphs.weight(8, 4, 3, 3, name="w1")])


@pytest.fixture(scope="module")
def slow_case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("speed_vs_fp32")
    path = graphs.save(small_cnn(), folder / "small.onnx")
    calib = folder / "cal.npy"
    np.save(calib, np.random.default_rng(0).random((16, 1, 12, 12)).astype(np.float32))
    return path, calib


def test_the_reading_records_both_batches_the_cpu_and_the_slowest_nodes(slow_case, tmp_path):
    path, calib = slow_case
    x = np.load(calib)
    result, _ = quantize_onnx(path, tmp_path / "q.onnx", x, target="onnxruntime-cpu", budget=None)
    reading = result.speed
    assert isinstance(reading, SpeedReading) and reading.not_measured is None
    assert reading.batches == (1, 16)  # batch 1 and the calibration batch
    assert set(reading.fp32_ms) == set(reading.int8_ms) == set(reading.rounds) == {1, 16}
    assert all(v > 0 for v in (*reading.fp32_ms.values(), *reading.int8_ms.values()))
    assert reading.speedup == {b: reading.fp32_ms[b] / reading.int8_ms[b] for b in (1, 16)}
    assert set(reading.flags) <= set(INT8_FLAGS)
    assert reading.slower, reading.describe()
    assert reading.profiled_batch in reading.slower_at and reading.slowest
    # the top five of six nodes (Q, two Transposes, the two QLinearConvs, DQ): the 1 -> 4 conv may fall out under load
    convs = {n.source for n in reading.slowest if n.op_type == "QLinearConv"}
    assert convs and convs <= {"conv_a", "conv_b"}, reading.describe()
    assert set(reading.keep_float_names()) <= {"conv_a", "conv_b"} and "--exclude" in reading.hint
    report = result.as_dict()["speed"]
    assert report["speedup"].keys() == {"1", "16"} and report["slowest_nodes"][0]["node"]
    recorded = json.loads({p.key: p.value for p in onnx.load(str(tmp_path / "q.onnx")).metadata_props}[SPEED_KEY])
    assert recorded["batches"] == [1, 16] and recorded["flags"] == list(reading.flags) and recorded["slower"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx"]


def test_a_fixed_batch_file_is_timed_at_its_own_batch(tmp_path):
    m = graphs.conv_relu_conv()
    for v in (m.graph.input[0], m.graph.output[0]):
        v.type.tensor_type.shape.dim[0].dim_value = 2
    path = graphs.save(m, tmp_path / "fixed.onnx")
    reading = measure_speed(path, path, {"x": graphs.images(4)}, (1, 4), budget=0.2)
    assert reading.batches == (2,) and set(reading.fp32_ms) == {2}


def test_profiled_names_lead_back_to_the_file_s_nodes(slow_case):
    names = sources(onnx.load(str(slow_case[0])))
    assert names["conv_a"] == "conv_a" and names["r0"] == "conv_a"  # ORT's fused Conv + Relu: OUTPUT_nchwc
    assert names["relu_a"] == "conv_a" and names["y"] == "conv_b"


def test_the_cli_warns_first_and_reports_the_speed(slow_case, tmp_path, capsys):
    path, calib = slow_case
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(path), "--calib", str(calib), "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    first = captured.err.splitlines()[0]
    assert first.startswith("quantship quantize-onnx: warning: the INT8 file runs slower than FP32"), captured.err
    assert "conv_a" in first and "--exclude" in first and "--speed-search" in first
    report = json.loads(captured.out)
    assert report["speed"]["slower"] and report["speed"]["batches"] == [1, 8] and out.is_file()


def test_require_faster_exits_1_and_writes_nothing(slow_case, tmp_path, capsys):
    path, calib = slow_case
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(path), "--calib", str(calib), "--out", str(out), "--require-faster",
                 "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("quantship quantize-onnx: --require-faster: the INT8 file runs slower")
    report = json.loads(captured.out)
    assert report["path"] is None and report["verdict"] == "slower_than_fp32" and report["speed"]["slower"]
    assert list(tmp_path.iterdir()) == []  # no file, no scratch folder


def test_require_faster_in_the_library_raises_before_the_move(slow_case, tmp_path):
    path, calib = slow_case
    with pytest.raises(SpeedMissed) as caught:
        quantize_onnx(path, tmp_path / "q.onnx", np.load(calib), target="onnxruntime-cpu", require_faster=True)
    assert caught.value.reading.slower and list(tmp_path.iterdir()) == []
    with pytest.raises(SpecRefused, match="--no-speed"):
        quantize_onnx(path, tmp_path / "q.onnx", np.load(calib), target="onnxruntime-cpu", require_faster=True,
                      speed=False)


@pytest.mark.parametrize("extra, said", [
    (["--no-speed"], "--no-speed"),
    (["--target", "tensorrt"], "tensorrt"),
    (["--target", "tigris"], "tigris"),
    (["--engine", "ort"], "--engine ort"),
    (["--activations", "dynamic"], "--activations dynamic"),
])
def test_require_faster_without_a_reading_is_refused_before_any_work(tmp_path, capsys, extra, said):
    out = tmp_path / "q.onnx"
    for name in ("float.onnx", "cal.npy"):  # they exist (paths are checked first) but are never read
        (tmp_path / name).touch()
    code = main(["quantize-onnx", str(tmp_path / "float.onnx"), "--calib", str(tmp_path / "cal.npy"),
                 "--out", str(out), "--require-faster", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--require-faster" in err[0] and said in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.npy", "float.onnx"]


def test_no_speed_skips_the_reading(slow_case, tmp_path, capsys):
    path, calib = slow_case
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(path), "--calib", str(calib), "--out", str(out), "--no-speed", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["speed"] is None and "slower" not in captured.err
    assert SPEED_KEY not in {p.key for p in onnx.load(str(out)).metadata_props}


def lstm_then_matmul(hidden: int = 8) -> onnx.ModelProto:
    """x [n, 5, 4] -> Transpose -> LSTM (ONNX Runtime's integer kernel is dynamic) -> Squeeze -> Transpose -> MatMul."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("W", TensorProto.FLOAT, [1, 4 * hidden, 4], (rng.standard_normal(4 * hidden * 4) * .3).tolist())
    r = helper.make_tensor("R", TensorProto.FLOAT, [1, 4 * hidden, hidden],
                           (rng.standard_normal(4 * hidden * hidden) * .3).tolist())
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], name="to_time", perm=[1, 0, 2]),
             helper.make_node("LSTM", ["xt", "W", "R"], ["h"], name="lstm", hidden_size=hidden),
             helper.make_node("Squeeze", ["h", "axes"], ["hs"], name="squeeze"),
             helper.make_node("Transpose", ["hs"], ["hb"], name="to_batch", perm=[1, 0, 2]),
             helper.make_node("MatMul", ["hb", "w_out"], ["y"], name="fc")]
    return graphs.model(nodes, [graphs.value("x", ["n", 5, 4])], [graphs.value("y", ["n", 5, 3])],
                        [w, r, axes, graphs.weight(hidden, 3, name="w_out")])


def test_the_census_counts_the_lstm_as_an_integer_kernel(tmp_path, capsys):
    path = graphs.save(lstm_then_matmul(hidden=64), tmp_path / "lstm.onnx")  # 64: not kept float for speed
    np.save(tmp_path / "cal.npy", np.random.default_rng(1).standard_normal((8, 5, 4)).astype(np.float32))
    code = main(["quantize-onnx", str(path), "--calib", str(tmp_path / "cal.npy"), "--out", str(tmp_path / "q.onnx"),
                 "--no-speed", "--no-fidelity", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    # ONNX Runtime's DynamicQuantizeLSTM by default (a float LSTM: tests/quantize_onnx/test_recurrent.py)
    assert report["census"]["integer"].get("DynamicQuantizeLSTM") == 1 and "LSTM" not in report["census"]["float"]


def _reading(**kw) -> SpeedReading:
    return SpeedReading("cpu", ("avx2",), (1, 8), {1: 1.0, 8: 8.0}, kw.pop("int8", {1: 0.5, 8: 4.0}), {1: 5, 8: 5},
                        **kw)


def test_a_faster_file_is_not_slower_and_gets_no_warning_row():
    from quantship.cli import speed as speed_cli

    fast = _reading()
    assert not fast.slower and fast.speedup == {1: 2.0, 8: 2.0}
    assert [label for label, _ in speed_cli.rows(fast)] == [speed_cli.ROW]
    slow = _reading(int8={1: 0.5, 8: 9.0})
    assert slow.slower_at == (8,)
    assert [label for label, _ in speed_cli.rows(slow)][0] == "SLOWER than FP32"
    assert speed_cli.rows(None) == []
