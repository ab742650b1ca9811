"""A missing input path is refused before any heavy import (issue 38, item 5).

Each command runs as a real process under ``python -X importtime``, which lists every module the
process imported: the refusal (exit 2, one stderr line naming the path) comes with none of torch,
onnx, ONNX Runtime or numpy imported. No wall-time assertion: what the process imported is what
makes it slow (torch alone took 32 s on a cold cache).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
HEAVY = ("torch", "onnx", "onnxruntime", "onnx_ir", "numpy")

MISSING = [
    (["quantize-onnx", "missing.onnx", "--calib", "x.npy", "--out", "y.onnx"], "missing.onnx"),
    (["quantize-onnx", "missing.onnx", "--activations", "dynamic", "--out", "y.onnx"], "missing.onnx"),
    (["quantize", "missing.py:build", "--calib", "x.npy", "--out", "y.onnx"], "missing.py"),
    (["quantize", "torchvision:resnet18", "--calib", "missing.npy", "--out", "y.onnx"], "missing.npy"),
    (["check", "missing.onnx", "--target", "tigris"], "missing.onnx"),
    (["compare", "missing.onnx", "also_missing.onnx"], "missing.onnx"),
    (["inspect", "missing.onnx"], "missing.onnx"),
    (["sensitivity", "missing.onnx", "--calib", "x.npy", "--out-dir", "d"], "missing.onnx"),
    (["sensitivity", "missing.py:build", "--calib", "x.npy", "--out-dir", "d"], "missing.py"),
    (["export-onnx", "missing.py:build", "--shape", "1,3,8,8", "--out", "y.onnx"], "missing.py"),
]


def _imported(importtime_stderr: str) -> set[str]:
    """Module names from ``-X importtime`` lines (``import time: self | cumulative | name``)."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


@pytest.mark.parametrize("argv, path", MISSING, ids=[" ".join(a[:2]) for a, _ in MISSING])
def test_missing_path_refused_before_heavy_imports(argv, path, tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "quantship", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(said) == 1 and path in said[0] and "does not exist" in said[0], said
    imported = _imported(done.stderr)
    assert "quantship.cli.main" in imported  # the listing is real: it sees our own modules
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    assert list(tmp_path.iterdir()) == []


def test_existing_hub_names_are_not_paths(tmp_path):
    """``torchvision:NAME``, a weight set name and an ``hf:`` hub reference name no local file: not refused here."""
    from argparse import Namespace

    from quantship.cli.paths import refuse_missing_inputs
    from quantship.cli.usage import UsageError

    refuse_missing_inputs(Namespace(model="torchvision:resnet18", weights="IMAGENET1K_V1"))
    refuse_missing_inputs(Namespace(model="hf:sshleifer/tiny-gpt2", weights="DEFAULT"))
    with pytest.raises(UsageError, match="weights file .* does not exist"):
        refuse_missing_inputs(Namespace(model="torchvision:resnet18", weights=str(tmp_path / "w.pt")))
    with pytest.raises(UsageError, match="model file .*config.json does not exist"):
        refuse_missing_inputs(Namespace(model=f"hf:{tmp_path / 'config.json'}"))


def test_help_texts_say_the_opset_rule_the_default_target_and_an_onnx_model(capsys):
    """--opset says in both commands which file its range is for (the INT8 file 17-18, the float file 17 or
    higher), quantize-onnx states its default target, and
    sensitivity's MODEL names the .onnx file it takes."""
    from quantship.cli.main import main

    def help_of(command: str) -> str:
        assert main([command, "--help"]) == 0
        return " ".join(capsys.readouterr().out.split())

    assert "ONNX opset of the INT8 file: 17 or 18 (default 18; the float file of export-onnx may go higher)" \
        in help_of("quantize")
    assert "ONNX opset of the float file: 17 or higher (default 18; an INT8 file from quantize is 17 or 18)" \
        in help_of("export-onnx")
    assert "deployment preset (default onnxruntime-cpu)" in help_of("quantize-onnx")
    assert "or a float FILE.onnx" in help_of("sensitivity")
