"""The walk-throughs in docs/ are scripts that run: run them and check what they print."""

import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _run(name: str, tmp_path: Path) -> str:
    done = subprocess.run([sys.executable, str(DOCS / name), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_walkthrough_resnet18(tmp_path):
    out = _run("walkthrough_resnet18.py", tmp_path)
    assert "11,689,512 parameters" in out
    assert "'n_per_channel': 21, 'n_nonzero_zero_point': 0, 'n_unquantized_conv_add': 0" in out
    assert "'n_unquantized_conv_add': 8" in out and "cleared 8 of 8" in out
    assert "spec read back from the file equals the model's: True" in out
    assert "vacuous" in out


@pytest.mark.slow
def test_walkthrough_deploy(tmp_path):
    out = _run("walkthrough_deploy.py", tmp_path)
    for target in ("onnxruntime", "tensorrt", "openvino", "tigris"):
        assert f"check {target}: accepted" in out, out
    assert "onnxruntime-cpu file checked against tensorrt: REFUSED" in out


@pytest.mark.slow
def test_walkthrough_qat(tmp_path):
    if not (DOCS / "walkthrough_qat.py").exists():
        pytest.fail("docs/walkthrough_qat.py is missing")
    out = _run("walkthrough_qat.py", tmp_path)
    assert "method': 'qat'" in out and "Wilson 95%" in out
    assert "'n_per_channel': 7" in out  # 6 convs + head: weights per channel, activations per tensor
