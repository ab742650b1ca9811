"""The walk-throughs in docs/ are scripts that run: run them and check what they print.

Each runs as ``__main__`` with its command line, inside the test process: the imports and the
exporter's first-call set-up are paid once per suite rather than once per script. The ResNet-18
walk-through runs in a fresh process instead (tests/test_fresh_process.py): it follows the seed's
order, which only a fresh process can check. README.md's quick start runs here too, block by block
(its python blocks and its `quantship` command lines); the code in docs/*.md is fragments of prose, not run.
"""

import re
import runpy
import shlex
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


def _readme_blocks() -> list[tuple[str, str]]:
    """README's fenced blocks, in order: (language, code)."""
    text = (DOCS.parent / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the reference model predicts")  # the README says so: random weights
def test_readme_quick_start_runs(tmp_path, monkeypatch, capsys):
    """Every python block of the README and every `quantship` line of its bash blocks runs, in order, in one
    namespace (the ONNX path reads the files the PyTorch path wrote); `make` and `pip` lines are the install's."""
    from quantship.cli.main import main

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    ran = 0
    for lang, code in _readme_blocks():
        if lang == "python":
            exec(compile(code, "README.md", "exec"), namespace)
            ran += 1
        elif lang == "bash":
            for line in code.splitlines():
                if line.startswith("quantship "):
                    argv = shlex.split(line.split("#")[0])[1:]
                    assert main(argv) == 0, f"README: {line}"
                    ran += 1
    assert ran >= 4, "the README's quick start lost its blocks"
    assert "within the budget" in capsys.readouterr().out  # quantize_onnx's fidelity line, printed by the README
    for name in ("r18_int8.onnx", "r18.onnx", "r18_int8_ort.onnx", "r18_int8_api.onnx"):
        assert (tmp_path / name).is_file(), name
