"""Per-node SQNR of an ONNX file (``quantize_onnx.sensitivity.node_sqnr``, ``quantship sensitivity x.onnx``)."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from quantship.cli.main import main
from quantship.quantize.layer_error import sqnr_db
from quantship.quantize_onnx import quantize_onnx_file, sensitivity
from quantship.quantize_onnx.sensitivity import node_sqnr
from tests.quantize_onnx import graphs, outlier


def _output(path, x):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0].astype(np.float64)


def test_rows_follow_the_plan_and_the_last_one_is_the_output_sqnr_measured_independently(tmp_path):
    path = graphs.save(graphs.conv_relu_conv(), tmp_path / "f.onnx")
    x = graphs.images(12)
    q = quantize_onnx_file(path, tmp_path / "q.onnx", [x[:6], x[6:]], target="onnxruntime-cpu")
    report = node_sqnr(path, [x[:6], x[6:]], target="onnxruntime-cpu", quantized_path=q.path)
    # conv1's row is measured after its fused Relu (the quantization point), conv2's is the graph output
    assert [(r.node, r.tensor, r.role) for r in report.rows] == [("conv1", "r1", "weighted"), ("conv2", "y", "weighted")]
    assert report.n_samples == 12 and report.unmatched == []
    ref, got = _output(path, x), _output(q.path, x)
    expected = sqnr_db(float((ref ** 2).sum()), float(((ref - got) ** 2).sum()))
    assert report.rows[-1].sqnr_db == pytest.approx(expected, abs=1e-6)
    assert report.output_sqnr_db == pytest.approx(expected, abs=1e-6)
    assert report.as_dict()["measure"] == "accumulated" and "accumulated" in report.to_markdown()


def test_measuring_in_one_sample_slices_gives_the_same_figures(tmp_path, monkeypatch):
    path = graphs.save(graphs.conv_relu_conv(), tmp_path / "f.onnx")
    x = graphs.images(8)
    whole = node_sqnr(path, x, target="onnxruntime-cpu")
    monkeypatch.setattr(sensitivity, "MEMORY_BUDGET", 1)  # one sample per run: the bounded-memory path
    sliced = node_sqnr(path, x, target="onnxruntime-cpu")
    assert [r.sqnr_db for r in sliced.rows] == pytest.approx([r.sqnr_db for r in whole.rows], abs=1e-6)


def test_the_collapsing_node_is_the_worst_and_excluding_it_raises_the_output_sqnr(tmp_path):
    f = outlier.files(tmp_path)
    x = np.load(f["calib"])
    report = node_sqnr(f["float"], x, target="onnxruntime-cpu", observer="minmax")
    assert report.suggest_exclude(1) == ["fc2"]
    kept = node_sqnr(f["float"], x, target="onnxruntime-cpu", observer="minmax", exclude=["fc2"])
    assert kept.excluded == ["fc2"] and [r.node for r in kept.rows] == ["fc1"]
    assert kept.output_sqnr_db > report.output_sqnr_db + 10


def test_sensitivity_cli_on_an_onnx_file_writes_its_reports_and_a_usable_exclude_list(tmp_path, capsys):
    f = outlier.files(tmp_path)
    out_dir = tmp_path / "report"
    assert main(["sensitivity", str(f["float"]), "--calib", str(f["calib"]), "--out-dir", str(out_dir),
                 "--observer", "minmax", "--k", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["engine"] == "quantize_onnx" and doc["report"]["measure"] == "accumulated"
    assert doc["suggested_exclude"] == ["fc2"]
    assert (out_dir / "sensitivity.png").read_bytes()[:4] == b"\x89PNG"
    page = (out_dir / "sensitivity.html").read_text()
    assert "quantship quantize-onnx" in page and "accumulated" in page
    # the suggestion is what quantize-onnx takes
    assert main(["quantize-onnx", str(f["float"]), "--calib", str(f["calib"]), "--out", str(tmp_path / "q.onnx"),
                 "--exclude", *doc["suggested_exclude"], "--quiet"]) == 0


def test_sensitivity_refuses_pytorch_only_options_for_an_onnx_file(tmp_path, capsys):
    f = outlier.files(tmp_path)
    assert main(["sensitivity", str(f["float"]), "--calib", str(f["calib"]), "--out-dir", str(tmp_path / "r"),
                 "--placement", "per_op"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--placement" in err[0] and not (tmp_path / "r").exists()
