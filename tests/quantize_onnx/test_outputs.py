"""Every output of a file is named, read in its own LSB and judged: a detector's box head is checked as
its score head is (the readings, the fidelity, the check --run verdict, the report and its JSON)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from quantship.cli.main import main
from quantship.quantize_onnx import quantize_onnx_file
from tests.quantize_onnx import graphs


def _calibration() -> list[np.ndarray]:
    x = graphs.heavy_tailed_feature(256)
    return [x[:128], x[128:]]


@pytest.fixture(scope="module")
def two_heads(tmp_path_factory):
    d = tmp_path_factory.mktemp("two_heads")
    src = graphs.save(graphs.two_heads(), d / "float.onnx")
    return src, quantize_onnx_file(src, d / "int8.onnx", _calibration(), target="onnxruntime-cpu")


def test_the_second_output_is_read_in_its_own_lsb_and_its_error_is_the_reported_one(two_heads):
    _, r = two_heads
    # feature 7's rare spikes set the input's scale; the box head does not read feature 7, so its small
    # values lose the most steps of their own (finer) scale: the first output alone would hide it
    each = r.readings.per_output
    assert list(each) == ["score", "box"]
    assert each["box"].literal_lsb > 3 * each["score"].literal_lsb  # measured: 5.2 vs 1.1 LSB
    assert r.readings.literal_lsb == each["box"].literal_lsb and r.readings.fused_lsb == each["box"].fused_lsb
    assert each["box"].scale != each["score"].scale  # each in its own output's step
    assert list(r.fidelity["per_output"]) == ["score", "box"]
    assert r.fidelity["per_output"]["box"]["literal"]["max_abs_error"] > 0
    report = r.as_dict()
    assert set(report["readings"]["per_output"]) == {"score", "box"}
    # the check --run verdict compares every output, each named, the worst one carried as max_lsb
    run = r.verdict.runs[0]
    assert list(run.per_output) == ["score", "box"] and run.max_lsb == max(run.per_output.values())


def test_a_constant_first_output_does_not_make_the_run_inconclusive(tmp_path):
    # the score head's weight is zero: its output is its bias for every input; the box head still varies,
    # so the run can tell a faithful file from a broken one (reading the first output alone: inconclusive)
    src = graphs.save(graphs.two_heads(np.zeros((8, 2))), tmp_path / "float.onnx")
    r = quantize_onnx_file(src, tmp_path / "int8.onnx", _calibration(), target="onnxruntime-cpu")
    assert r.verdict.verdict == "accepted", r.verdict.summary()
    assert r.verdict.runs[0].status == "passed"


def test_the_report_names_every_output(two_heads, tmp_path, capsys):
    src, _ = two_heads
    np.save(tmp_path / "cal.npy", _calibration()[0])
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(src), "--calib", str(tmp_path / "cal.npy"), "--out", str(out)]) == 0
    text = "".join(capsys.readouterr().out.replace("│", " ").split())  # the table's cells wrap
    assert "score" in text and "box" in text and "worstof2outputs" in text
    assert main(["quantize-onnx", str(src), "--calib", str(tmp_path / "cal.npy"), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["readings"]["per_output"]) == {"score", "box"}
    assert set(report["check"]["runs"][0]["per_output"]) == {"score", "box"}


def test_the_sqnr_report_reads_every_output(two_heads):
    from quantship.quantize_onnx.sensitivity import node_sqnr

    src, _ = two_heads
    report = node_sqnr(src, _calibration(), target="onnxruntime-cpu")
    each = report.per_output_sqnr_db
    assert list(each) == ["score", "box"]
    assert each["box"] < each["score"]  # the box head loses the most (its readings say the same, in LSB)
    assert report.output_sqnr_db == each["box"]  # the worst output's, not the first's
    assert "box" in report.to_markdown() and report.as_dict()["per_output_sqnr_db"] == each


def test_a_file_that_lost_renamed_or_reshaped_an_output_is_refused():
    from quantship.errors import ExportRefused
    from quantship.quantize_onnx.quantizer import check_outputs_kept

    score, box = np.zeros((4, 2), np.float32), np.zeros((4, 4), np.float32)
    check_outputs_kept(["score", "box"], ["score", "box"], [score, box], [score.copy(), box.copy()])
    with pytest.raises(ExportRefused, match=r"outputs \['box', 'score'\] are not"):
        check_outputs_kept(["score", "box"], ["box", "score"], [score, box], [box, score])
    with pytest.raises(ExportRefused, match=r"outputs \['score'\] are not"):
        check_outputs_kept(["score", "box"], ["score"], [score, box], [score])
    with pytest.raises(ExportRefused, match="output 'box' is float32 \\[4, 1\\]"):
        check_outputs_kept(["score", "box"], ["score", "box"], [score, box], [score, box[:, :1]])
