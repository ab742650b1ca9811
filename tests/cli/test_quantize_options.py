"""`quantship quantize` options a user reaches for first (issue 16): --config, --exclude,
--observer, --eval with top-1 and intervals, --max-drop."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quantship.cli.main import main
from quantship.examples import digits

BS = 40


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ux")
    split = digits.load_noisy_split()
    np.savez(root / "eval.npz", x=split.x_test.numpy(), y=split.y_test.numpy())
    np.save(root / "cal.npy", split.x_train[:2 * BS].numpy())
    torch.save(digits.noisy_trained_model().state_dict(), root / "w.pt")
    (root / "net.py").write_text("from quantship.examples.models import TinyResNet\n"
                                 "def build():\n    return TinyResNet(1, 10, 8)\n")
    return root


def _run(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured


def test_config_exclude_eval_and_budget(files, capsys):
    (files / "q.toml").write_text('[quantizer]\nact_observer = "minmax"\nmax_accuracy_drop = 1.0\n')
    out = files / "m.onnx"
    code, captured = _run([
        "quantize", f"{files / 'net.py'}:build", "--weights", str(files / "w.pt"), "--calib", str(files / "cal.npy"),
        "--batch-size", str(BS), "--out", str(out), "--eval", str(files / "eval.npz"), "--config", str(files / "q.toml"),
        "--exclude", "head", "--json"], capsys)
    report = json.loads(captured.out)
    assert code == 0 and out.is_file()
    assert report["spec"]["act_observer"] == "minmax" and report["spec"]["skip_activations"] == ["head"]
    acc = report["accuracy"]
    assert set(acc) == {"fp32_torch", "int8_torch", "int8_file_ort"}
    model = digits.noisy_trained_model()
    split = digits.load_noisy_split()
    assert acc["fp32_torch"]["correct"] == digits.evaluate(model, split.x_test, split.y_test)[0]
    assert acc["fp32_torch"]["n"] == 360
    for row in acc.values():
        low, high = row["wilson95"]
        assert low <= row["accuracy"] <= high and not row["vacuous"]
    # the torch INT8 model and the file agree on what they predict, to within a couple of images
    assert abs(acc["int8_torch"]["correct"] - acc["int8_file_ort"]["correct"]) <= 2
    search = report["accuracy_search"]
    assert search["met"] and search["max_drop_points"] == 1.0


def test_config_refusals(files, capsys):
    (files / "bad.toml").write_text('[quantizer]\nact_observr = "minmax"\n')
    code, captured = _run(["quantize", "torchvision:resnet18", "--calib", str(files / "cal.npy"),
                           "--out", str(files / "x.onnx"), "--config", str(files / "bad.toml")], capsys)
    assert code == 2 and "unknown key(s) ['act_observr']" in captured.err
    code, captured = _run(["quantize", "torchvision:resnet18", "--calib", str(files / "cal.npy"),
                           "--out", str(files / "x.onnx"), "--max-drop", "1"], capsys)
    assert code == 2 and "--max-drop (max_accuracy_drop) needs --eval" in captured.err
    (files / "ev.npz").write_bytes(b"")
    np.savez(files / "ev.npz", x=np.zeros((4, 1, 32, 32), np.float32))
    code, captured = _run(["quantize", f"{files / 'net.py'}:build", "--calib", str(files / "cal.npy"),
                           "--batch-size", str(BS), "--out", str(files / "x.onnx"), "--eval", str(files / "ev.npz")],
                          capsys)
    assert code == 2 and "lacks array(s) ['y']" in captured.err
    assert not (files / "x.onnx").exists()


def test_quiet_leaves_stderr_empty(files):
    import subprocess
    import sys

    out = files / "quiet.onnx"
    proc = subprocess.run(
        [sys.executable, "-m", "quantship", "quantize", f"{files / 'net.py'}:build", "--weights", str(files / "w.pt"),
         "--calib", str(files / "cal.npy"), "--batch-size", str(BS), "--out", str(out), "--quiet"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no torch/torchao log lines, no warnings: only quantship's own output
    assert out.is_file() and "check onnxruntime" in proc.stdout
