"""The PyTorch path's speed against FP32 (``export.judged.time_against_float``): the float model exported to
ONNX as the reference, the reading in the report and the file, ``--require-faster`` refusing a slower file
before it is moved into place. The slower case is a 1 -> 4 -> 8 channel CNN at 12 px (about 0.5-0.65x FP32 as
INT8 in ONNX Runtime, FIELD-NOTES): no assertion compares timings closely."""

from __future__ import annotations

import json

import onnx
import pytest

from quantship.cli.main import main
from quantship.export.speed_gate import SPEED_KEY
from tests.model_files import factory_and_calibration

MODEL = """
import torch.nn as nn


def small():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 8, 3, padding=1)).eval()
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return factory_and_calibration(tmp_path_factory.mktemp("torch_speed"), MODEL, "small", (16, 1, 12, 12))


def test_quantize_times_the_file_against_the_float_export_and_warns_first(small, tmp_path, capsys):
    model, calib = small
    out = tmp_path / "q.onnx"
    # --plain-placement: the profile could keep a conv float on some CPU; the gate is read on the plain file
    assert main(["quantize", model, "--calib", str(calib), "--out", str(out), "--json", "--plain-placement"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0].startswith("quantship quantize: warning: the INT8 file runs slower than FP32")
    speed = json.loads(captured.out)["speed"]
    assert speed["batches"] == [1, 8] and speed["slower"] and speed["not_measured"] is None
    assert {n["module"] for n in speed["slowest_nodes"] if n["op_type"] == "QLinearConv"} == {"0", "2"}
    assert "--exclude" in speed["hint"]
    recorded = json.loads({p.key: p.value for p in onnx.load(str(out)).metadata_props}[SPEED_KEY])
    assert recorded["speedup"].keys() == {"1", "8"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx"]  # the float reference stayed in scratch


def test_require_faster_exits_1_and_writes_nothing(small, tmp_path, capsys):
    model, calib = small
    out = tmp_path / "q.onnx"
    assert main(["quantize", model, "--calib", str(calib), "--out", str(out), "--require-faster", "--json",
                 "--plain-placement"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("quantship quantize: --require-faster: the INT8 file runs slower")
    assert json.loads(captured.out)["verdict"] == "slower_than_fp32" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra", [["--no-speed"], ["--target", "tensorrt"]])  # weight-only: test_quantize_weight_only_cli
def test_require_faster_without_a_reading_is_refused(small, tmp_path, capsys, extra):
    model, calib = small
    code = main(["quantize", model, "--calib", str(calib), "--out", str(tmp_path / "q.onnx"), "--require-faster",
                 *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--require-faster" in err[0], err
    assert list(tmp_path.iterdir()) == []
