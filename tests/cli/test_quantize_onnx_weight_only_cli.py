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


def test_int4_file_with_speed_and_both_readings_that_openvino_runs(float_file, tmp_path, capsys):
    out = tmp_path / "w4.onnx"
    code = main(["quantize-onnx", str(float_file), "--method", "int4_weight_only", "--out", str(out), "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    # six weighted MatMuls (q, k, v, o, the feed-forward's two), K = 64 everywhere: groups of 64
    assert code == 0 and report["n_matmul_nbits"] == 6 and report["group"] == 64 and report["bits"] == 4
    assert report["accuracy_level"] == 4 and _levels(out) == [4] * 6 and report["data"] == "generated"
    # fidelity to the float file as written (int8 activations) and at level 0 (the stored arithmetic)
    written, exact = report["fidelity_fp32"], report["fidelity_fp32_accuracy_level_0"]
    assert written["sqnr_db"] > 5 and exact["sqnr_db"] > 5 and written["sqnr_db"] != exact["sqnr_db"]
    speed = report["speed"]
    assert speed["batches"] == [1, 8] and speed["not_measured"] is None and set(speed["speedup"]) == {"1", "8"}
    assert json.loads({p.key: p.value for p in onnx.load(str(out)).metadata_props}[SPEED_KEY])["batches"] == [1, 8]
    if speed["slower"]:
        assert captured.err.splitlines()[0].startswith("quantship quantize-onnx: warning: the INT8 file runs slower")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w4.onnx"]

    # OpenVINO runs com.microsoft MatMulNBits: check accepts the file, its exact reading held to the file's
    # arithmetic (level 0), whatever level ONNX Runtime's int8 activations were written at
    pytest.importorskip("openvino")
    assert main(["check", str(out), "--target", "openvino", "--run", "--n", "4", "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert checked["verdict"] == "accepted" and checked["findings"] == []  # op_domains: MatMulNBits is OpenVINO's
    (run,) = checked["runs"]
    assert run["status"] == "passed" and run["readings"]["exact"] < 2e-5  # measured 3.6e-07


def test_int8_at_level_0_and_given_data(float_file, tmp_path, capsys):
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((4, TOKENS, WIDTH)).astype(np.float32))
    out = tmp_path / "w8.onnx"
    code = main(["quantize-onnx", str(float_file), "--method", "int8_weight_only", "--accuracy-level", "0",
                 "--group-size", "32", "--calib", str(x), "--no-speed", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["bits"] == 8 and report["group"] == 32 and report["data"] == "given"
    assert report["accuracy_level"] == 0 and _levels(out) == [0] * 6 and report["speed"] is None
    assert report["fidelity_fp32_accuracy_level_0"] is None  # written at 0: one reading
    assert report["fidelity_fp32"]["sqnr_db"] > 30  # 8 bits, float activations: close to the float file


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
