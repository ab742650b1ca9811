"""The walk-throughs in docs/ are scripts that run: run them and check what they print.

Each runs as ``__main__`` with its command line, inside the test process: the imports and the
exporter's first-call set-up are paid once per suite rather than once per script. The ResNet-18
walk-through runs in a fresh process instead (tests/test_fresh_process.py): it follows the seed's
order, which only a fresh process can check. README.md's quick start runs here too, block by block
(its python blocks and its `quantship` command lines), and so does every code block of docs/*.md
(``test_docs_code_blocks_run``); a synopsis of flags is a ```text block, not code.
"""

import re
import runpy
import shlex
import subprocess
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


def _doc_blocks(name: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```", (DOCS / name).read_text(encoding="utf-8"), flags=re.S | re.M)


def _commands(code: str) -> list[str]:
    """A bash block's command lines, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


INSTALL = ("make ", "pip ")  # the set-up's lines: what `make test` itself ran
RUNNABLE_DOCS = sorted(p.name for p in DOCS.glob("*.md")
                       if any(lang in ("python", "bash") for lang, _ in _doc_blocks(p.name)))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the reference model predicts")  # random weights, as the page says
@pytest.mark.parametrize("name", RUNNABLE_DOCS)
def test_docs_code_blocks_run(name, tmp_path, monkeypatch):
    """Each python block of a docs page runs, in order, in one namespace (a block whose first line is ``# f.py``
    is that file, written for the commands after it); each command of its bash blocks runs as printed."""
    from quantship.cli.main import main

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    ran = 0
    for lang, code in _doc_blocks(name):
        if lang == "python" and re.match(r"# [\w.]+\.py\n", code):
            (tmp_path / code.split("\n", 1)[0][2:]).write_text(code)
        elif lang == "python":
            exec(compile(code, f"docs/{name}", "exec"), namespace)
            ran += 1
        elif lang == "bash":
            for line in _commands(code):
                if line.startswith(INSTALL):
                    continue
                argv = shlex.split(line)
                if argv[0] == "quantship":
                    assert main(argv[1:]) == 0, f"docs/{name}: {line}"
                elif argv[0] == "torchrun":
                    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv[1:]],
                                          capture_output=True, text=True, timeout=600)
                    assert done.returncode == 0, done.stderr[-2000:]
                else:
                    pytest.fail(f"docs/{name}: a command the suite does not know how to run: {line}")
                ran += 1
    if name != "demo.md":  # demo.md's only block is the install's two make lines
        assert ran >= 1, f"docs/{name} lost its code"
