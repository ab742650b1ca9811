"""``quantship quantize-onnx FLOAT.onnx --method int4_weight_only|int8_weight_only``: weight-only MatMulNBits from a
float ONNX file (no calibration), its speed and fidelity report, OpenVINO running the file, and the bad input."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from quantship.cli.main import main
from quantship.export.speed_gate import SPEED_KEY
from tests.quantize_onnx import graphs

WIDTH, TOKENS = 64, 6


@pytest.fixture(scope="module")
def float_file(tmp_path_factory):
    return graphs.save(graphs.encoder_block(WIDTH, TOKENS), tmp_path_factory.mktemp("encoder") / "encoder.onnx")


def _levels(path) -> list[int | None]:
    return [{a.name: a.i for a in n.attribute}.get("accuracy_level")
            for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits"]


def test_int4_file_with_speed_that_openvino_runs(float_file, tmp_path, capsys):
    out = tmp_path / "w4.onnx"
    code = main(["quantize-onnx", str(float_file), "--method", "int4_weight_only", "--out", str(out), "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    # six weighted MatMuls (q, k, v, o, the feed-forward's two), K = 64 everywhere: groups of 64
    assert code == 0 and report["n_matmul_nbits"] == 6 and report["group"] == 64 and report["bits"] == 4
    # INT4: accuracy_level 0 by default (float activations): one reading, the exact one
    assert report["accuracy_level"] == 0 and _levels(out) == [0] * 6 and report["data"] == "generated"
    assert report["fidelity_fp32"]["sqnr_db"] > 5 and report["fidelity_fp32_accuracy_level_0"] is None
    speed = report["speed"]
    assert speed["batches"] == [1, 8] and speed["not_measured"] is None and set(speed["speedup"]) == {"1", "8"}
    assert json.loads({p.key: p.value for p in onnx.load(str(out)).metadata_props}[SPEED_KEY])["batches"] == [1, 8]
    if speed["slower"]:  # said on stderr before the report, with what would help
        assert captured.err.splitlines()[0].startswith("quantship quantize-onnx: warning: the INT8 file runs slower")
        assert "--accuracy-level 4" in speed["hint"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w4.onnx"]

    # --require-faster decides on the reading it makes (timings not compared here: the verdict follows them)
    again = tmp_path / "again.onnx"
    code = main(["quantize-onnx", str(float_file), "--method", "int4_weight_only", "--out", str(again), "--json",
                 "--require-faster"])
    verdict = json.loads(capsys.readouterr().out)
    if code == 1:
        assert verdict["verdict"] == "slower_than_fp32" and not again.exists() and verdict["speed"]["slower"]
    else:
        assert code == 0 and again.is_file() and not verdict["speed"]["slower"]

    # OpenVINO runs com.microsoft MatMulNBits: check accepts the file (no op_domains finding), run and measured
    pytest.importorskip("openvino")
    assert main(["check", str(out), "--target", "openvino", "--run", "--n", "4", "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert checked["verdict"] == "accepted" and checked["findings"] == []
    (run,) = checked["runs"]
    assert run["status"] == "passed" and run["readings"]["exact"] < 2e-5  # measured 3.6e-07


def test_int8_at_level_4_with_given_data_that_openvino_runs(float_file, tmp_path, capsys):
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((4, TOKENS, WIDTH)).astype(np.float32))
    out = tmp_path / "w8.onnx"
    code = main(["quantize-onnx", str(float_file), "--method", "int8_weight_only", "--group-size", "32",
                 "--calib", str(x), "--no-speed", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["bits"] == 8 and report["group"] == 32 and report["data"] == "given"
    # INT8: accuracy_level 4 by default (int8 activations), the level-0 reading measured beside it
    assert report["accuracy_level"] == 4 and _levels(out) == [4] * 6 and report["speed"] is None
    written, exact = report["fidelity_fp32"], report["fidelity_fp32_accuracy_level_0"]
    assert exact["sqnr_db"] > 30 and written["sqnr_db"] > 15 and exact["sqnr_db"] > written["sqnr_db"]

    # OpenVINO ignores ONNX Runtime's accuracy_level: its exact reading is held to the file read at level 0
    pytest.importorskip("openvino")
    assert main(["check", str(out), "--target", "openvino", "--run", "--n", "4", "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["status"] == "passed" and run["readings"]["exact"] < 2e-5
    assert "held to the file read at level 0" in run["detail"]


@pytest.mark.parametrize("extra, words", [
    (["--int16", "proj_q"], "--int16 acts on the static INT8 form"),
    (["--activations", "dynamic"], "drop --activations dynamic"),
    (["--group-size", "48"], "--group-size 48: MatMulNBits needs a power of two"),
    (["--target", "tensorrt"], "--target tensorrt has no weight-only operator"),
    (["--require-faster", "--no-speed"], "--require-faster needs the speed reading"),
])
def test_bad_input_is_one_line_and_writes_nothing(float_file, tmp_path, capsys, extra, words):
    out = tmp_path / "no.onnx"
    code = main(["quantize-onnx", str(float_file), "--method", "int4_weight_only", *extra, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_weight_only_options_refused_with_the_static_method(float_file, tmp_path, capsys):
    code = main(["quantize-onnx", str(float_file), "--accuracy-level", "4", "--out", str(tmp_path / "no.onnx")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--accuracy-level applies to --method int8_weight_only" in err[0]
