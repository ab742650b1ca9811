"""check --run and compare hold an INT8 file to its float reference, so either can gate a release.

A file with scrambled int8 weights reads the same in ONNX Runtime literally and fused (the runtime
check accepts it); only the float reference shows it no longer computes the model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from onnx import numpy_helper

from quantship.cli.main import main
from quantship.export import export_onnx
from quantship.quantize_onnx import quantize_onnx


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("reference")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4)).eval()
    export_onnx(model, torch.randn(2, 3, 16, 16), d / "float.onnx", opset_version=18)
    cal = np.random.default_rng(0).standard_normal((40, 3, 16, 16)).astype(np.float32)
    np.save(d / "cal.npy", cal)
    quantize_onnx(d / "float.onnx", d / "int8.onnx", cal[:32], target="onnxruntime-cpu", fidelity_data=cal[32:])
    scrambled = onnx.load(str(d / "int8.onnx"))
    rng = np.random.default_rng(0)
    for t in scrambled.graph.initializer:
        a = numpy_helper.to_array(t)
        if a.dtype == np.int8 and a.size > 8:  # the weights: same values, other places
            t.CopyFrom(numpy_helper.from_array(rng.permutation(a.ravel()).reshape(a.shape), t.name))
    onnx.save(scrambled, str(d / "scrambled.onnx"))
    return d


def _check(capsys, *argv, data=True) -> tuple[int, dict]:
    """``check --json`` on real inputs (the calibration data beside the file) unless ``data=False``."""
    real = ["--inputs", str(Path(argv[0]).parent / "cal.npy")] if data and (Path(argv[0]).parent / "cal.npy").is_file() else []
    code = main(["check", *argv, *real, "--target", "onnxruntime-cpu", "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_check_run_judges_the_file_against_the_float_file_its_metadata_names(files, capsys):
    code, report = _check(capsys, str(files / "int8.onnx"), "--run")
    assert code == 0 and report["verdict"] == "accepted"
    assert report["fidelity_fp32"]["status"] == "met" and "named by the file's metadata" in report["reference"]


def test_scrambled_weights_pass_the_runtime_check_and_fail_fidelity(files, capsys):
    code, report = _check(capsys, str(files / "scrambled.onnx"), "--run")
    assert report["verdict"] == "accepted"  # ONNX Runtime reproduces the file: the runtime check cannot tell
    assert report["fidelity_fp32"]["status"] == "missed" and code == 1
    real = ["--inputs", str(files / "cal.npy")]
    assert main(["compare", str(files / "float.onnx"), str(files / "scrambled.onnx"), "--target",
                 "onnxruntime-cpu", *real]) == 1
    assert main(["compare", str(files / "float.onnx"), str(files / "int8.onnx"), "--target", "onnxruntime-cpu",
                 *real]) == 0


def test_generated_inputs_are_measured_never_judged(files, capsys):
    """Seeded random inputs are not the model's data: the figure is shown, the verdict left to real inputs."""
    code, report = _check(capsys, str(files / "scrambled.onnx"), "--run", data=False)
    assert code == 0 and report["fidelity_fp32"]["status"] == "not judged"
    assert "give --inputs real data" in report["reference"]


def test_without_a_reference_the_report_says_fidelity_was_not_judged(files, capsys, tmp_path):
    alone = tmp_path / "int8.onnx"
    shutil.copy(files / "int8.onnx", alone)  # its float source is not beside it
    shutil.copy(files / "cal.npy", tmp_path / "cal.npy")
    code, report = _check(capsys, str(alone), "--run")
    assert code == 0 and report["fidelity_fp32"] is None and "not judged" in report["reference"]
    code, report = _check(capsys, str(alone), "--run", "--reference", str(files / "float.onnx"))
    assert code == 0 and report["fidelity_fp32"]["status"] == "met"


def test_a_changed_source_beside_the_file_is_not_taken_for_its_reference(files, capsys, tmp_path):
    shutil.copy(files / "int8.onnx", tmp_path / "int8.onnx")
    shutil.copy(files / "cal.npy", tmp_path / "cal.npy")
    model = onnx.load(str(files / "float.onnx"))
    model.doc_string = "edited"
    onnx.save(model, str(tmp_path / "float.onnx"))
    code, report = _check(capsys, str(tmp_path / "int8.onnx"), "--run")
    assert report["fidelity_fp32"] is None and "digest differs" in report["reference"]


@pytest.mark.parametrize("flags, says", [(["--min-sqnr", "-1"], "dB"), (["--min-agreement", "2"], "fraction")])
def test_bad_budgets_are_refused(files, capsys, flags, says):
    assert main(["check", str(files / "int8.onnx"), "--target", "onnxruntime-cpu", "--run", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_compare_judges_a_file_with_a_float_tail_it_has_no_lsb_for(tmp_path, capsys):
    """A softmax after the last DequantizeLinear leaves no output LSB for compare's rows: the fidelity to the
    float file is judged all the same, and gates the exit code."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
                          nn.Softmax(-1)).eval()
    export_onnx(model, torch.randn(2, 3, 16, 16), tmp_path / "float.onnx", opset_version=18)
    cal = np.random.default_rng(0).standard_normal((40, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "cal.npy", cal)
    quantize_onnx(tmp_path / "float.onnx", tmp_path / "int8.onnx", cal[:32], target="onnxruntime-cpu",
                  fidelity_data=cal[32:])
    code = main(["compare", str(tmp_path / "float.onnx"), str(tmp_path / "int8.onnx"), "--target", "onnxruntime-cpu",
                 "--inputs", str(tmp_path / "cal.npy"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] is None and "no output LSB" in report["no_rows"]
    assert report["fidelity_fp32"]["status"] == "met" and code == 0


def test_inspect_says_what_the_file_records_of_how_it_was_made(files, capsys):
    """inspect reads the same record quantize-onnx printed: the engine (not a PyTorch backend), the fidelity."""
    assert main(["inspect", str(files / "int8.onnx"), "--json"]) == 0
    recorded = json.loads(capsys.readouterr().out)["recorded"]
    assert recorded["made_by"] == "quantship quantize-onnx (the ONNX path)"
    assert recorded["fidelity_fp32"]["status"] == "met" and recorded["fidelity_fp32"]["sqnr_db"] > 10
    assert main(["inspect", str(files / "int8.onnx")]) == 0
    shown = capsys.readouterr().out
    assert "fidelity vs FP32 (recorded)" in shown and "'backend'" not in shown
