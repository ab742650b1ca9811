"""The walk-throughs in docs/ are scripts that run: run them and check what they print.

Each runs as ``__main__`` with its command line, inside the test process: the imports and the
exporter's first-call set-up are paid once per suite rather than once per script. The ResNet-18
walk-through runs in a fresh process instead (tests/test_fresh_process.py): it follows the seed's
order, which only a fresh process can check.
"""

import runpy
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _run(name: str, tmp_path: Path, monkeypatch, capsys) -> str:
    monkeypatch.syspath_prepend(str(DOCS))
    monkeypatch.setattr(sys, "argv", [str(DOCS / name), "--out-dir", str(tmp_path)])
    capsys.readouterr()
    try:
        runpy.run_path(str(DOCS / name), run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (None, 0), f"{name} exited with {exc.code}"
    return capsys.readouterr().out


@pytest.mark.slow
def test_walkthrough_deploy(tmp_path, monkeypatch, capsys):
    out = _run("walkthrough_deploy.py", tmp_path, monkeypatch, capsys)
    for target in ("onnxruntime-cpu", "openvino", "tigris"):
        assert f"check {target}: accepted" in out, out
    assert "check tensorrt: not run" in out, out  # no GPU here: its rules accept the file, nothing ran
    assert "onnxruntime-cpu file checked against tensorrt: REFUSED" in out


@pytest.mark.slow
def test_walkthrough_qat(tmp_path, monkeypatch, capsys):
    if not (DOCS / "walkthrough_qat.py").exists():
        pytest.fail("docs/walkthrough_qat.py is missing")
    out = _run("walkthrough_qat.py", tmp_path, monkeypatch, capsys)
    assert "method': 'qat'" in out and "Wilson 95%" in out
    assert "'n_per_channel': 7" in out  # 6 convs + head: weights per channel, activations per tensor
