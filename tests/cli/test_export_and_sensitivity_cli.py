"""`quantship export-onnx` (the float file) and `quantship sensitivity` (per-layer SQNR report)."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from quantship.cli.main import main
from quantship.examples import digits


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmds")
    split = digits.load_split()
    np.save(root / "cal.npy", split.x_train[:40].numpy())
    torch.save(digits.trained_model().state_dict(), root / "w.pt")
    (root / "net.py").write_text("from quantship.examples.digits import build_model\n"
                                 "def build():\n    return build_model()\n")
    return root


def test_export_onnx_any_batch_matches_torch(files, capsys):
    out = files / "float.onnx"
    code = main(["export-onnx", f"{files / 'net.py'}:build", "--weights", str(files / "w.pt"),
                 "--shape", "1,1,32,32", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["version"] and report["dynamic_batch"] is True and report["path"] == str(out)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    model = digits.trained_model()
    for n in (1, 3):
        x = digits.load_split().x_test[:n]
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=1e-4, atol=1e-4)


def test_export_onnx_bad_shape(files, capsys):
    code = main(["export-onnx", f"{files / 'net.py'}:build", "--shape", "1,x,-3", "--out", str(files / "bad.onnx")])
    assert code == 2 and "--shape" in capsys.readouterr().err and not (files / "bad.onnx").exists()


def test_sensitivity_table_png_html_and_suggestion(files, capsys):
    out_dir = files / "sens"
    code = main(["sensitivity", f"{files / 'net.py'}:build", "--weights", str(files / "w.pt"), "--calib",
                 str(files / "cal.npy"), "--batch-size", "20", "--out-dir", str(out_dir), "--k", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = report["report"]["rows"]
    assert len(rows) >= 8 and all(np.isfinite(r["sqnr_db"]) for r in rows)
    worst_two = sorted(rows, key=lambda r: r["sqnr_db"])[:2]
    assert report["suggested_exclude"] == list(dict.fromkeys(r["module"] for r in worst_two if r["module"]))[:2]
    assert (out_dir / "sensitivity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out_dir / "sensitivity.html").read_text()
    assert "data:image/png;base64," in page and "--exclude " + " ".join(report["suggested_exclude"]) in page
    assert "src=\"http" not in page  # self-contained: nothing to fetch


def test_the_suggested_command_runs_as_printed(files, capsys, monkeypatch):
    """The suggestion is a whole command (data, target, --out): pasted, it writes the file with those nodes
    float. An ONNX model given no --calib: the generated data the report ran on is saved and named."""
    import shlex

    monkeypatch.chdir(files)
    assert main(["export-onnx", "net.py:build", "--weights", "w.pt", "--shape", "1,1,32,32", "--out", "f.onnx"]) == 0
    capsys.readouterr()
    assert main(["sensitivity", "f.onnx", "--out-dir", "sens_onnx", "--k", "2"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("suggested: "))
    argv = shlex.split(line.removeprefix("suggested: "))
    assert argv[:2] == ["quantship", "quantize-onnx"] and "--calib" in argv and "--out" in argv
    assert (files / "sens_onnx" / "calibration.npz").is_file()
    capsys.readouterr()
    assert main([*argv[1:], "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert set(argv[argv.index("--exclude") + 1:]) <= set(written["excluded"])
    assert (files / argv[argv.index("--out") + 1]).is_file()
