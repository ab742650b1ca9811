"""Progress on a terminal (issue 16): the steps the library marks, shown on stderr when it is a TTY.

A transient spinner names the running step; a step longer than 2 s leaves one line with its time.
Nothing is shown with --quiet or --json, nor when stderr is not a terminal.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from quantship.cli.progress_view import SLOW_STEP_S, TerminalProgress, terminal_progress
from quantship.progress import END, START, Step, active, listening, step


def test_a_step_without_listener_does_nothing():
    assert not active()
    with step("anything", total=3) as current:
        current.advance(2)
    assert current.done == 2 and current.seconds is None  # nobody listening: no timing, no output


def test_listener_hears_start_advance_end_and_failure():
    heard = []
    with listening(lambda event, s: heard.append((event, s.label, s.done, s.failed))):
        assert active()
        with step("calibrating", total=4) as current:
            current.advance(4)
        with pytest.raises(RuntimeError), step("export"):
            raise RuntimeError("boom")
    assert not active()
    assert heard == [("start", "calibrating", 0, False), ("advance", "calibrating", 4, False),
                     ("end", "calibrating", 4, False), ("start", "export", 0, False), ("end", "export", 0, True)]


def test_terminal_view_leaves_a_line_for_slow_steps_only():
    from rich.console import Console

    stream = io.StringIO()
    view = TerminalProgress(Console(file=stream, force_terminal=True, width=120))
    slow, quick = Step("export: torch.onnx.export (dynamo)"), Step("export check: the file holds the spec")
    view(START, slow)
    view(START, quick)
    quick.seconds = 0.4
    view(END, quick)
    slow.seconds = SLOW_STEP_S + 1.5
    view(END, slow)
    assert view.live is None  # the spinner is gone once no step runs
    text = stream.getvalue()
    assert "export: torch.onnx.export (dynamo): done in 3.5 s" in text
    assert "holds the spec: done" not in text


@pytest.mark.parametrize("flags", [["--quiet"], ["--json"], []])
def test_nothing_shown_when_quiet_json_or_not_a_terminal(flags, capsys):
    args = argparse.Namespace(quiet="--quiet" in flags, json="--json" in flags)
    with terminal_progress(args) as shown:  # under pytest stderr is captured: not a terminal
        assert shown is None and not active()


def _qdq_file(path: Path) -> None:
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wd"]),
             helper.make_node("Conv", ["xd", "wd"], ["y"]),
             helper.make_node("QuantizeLinear", ["y", "s", "z"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["out"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor("w", TensorProto.INT8, [1, 1, 1, 1], [3]),
         helper.make_tensor("s", TensorProto.FLOAT, [], [0.05]),
         helper.make_tensor("z", TensorProto.INT8, [], [0])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
@pytest.mark.parametrize("json_flag", [False, True])
def test_check_run_shows_its_step_on_a_terminal_and_nothing_with_json(tmp_path, json_flag):
    """A real process with stderr on a pseudo-terminal: the consumer run is shown (and erased); with
    --json stderr stays empty."""
    import pty

    path = tmp_path / "m.onnx"
    _qdq_file(path)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((3, 1, 4, 4)).astype(np.float32))
    controller, terminal = pty.openpty()
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "TERM": "xterm"}
    argv = [sys.executable, "-m", "quantship", "check", str(path), "--target", "onnxruntime", "--run",
            "--inputs", str(tmp_path / "x.npy")] + (["--json"] if json_flag else [])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=terminal, env=env)
    os.close(terminal)
    err = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the process closed its end
            break
        if not chunk:
            break
        err += chunk
    out, _ = proc.communicate(timeout=120)
    os.close(controller)
    assert proc.returncode == 0, (out, err)
    if json_flag:
        assert err == b""
    else:
        assert b"check --run: onnxruntime" in err  # the spinner named the step
        assert b"check --run" not in out  # progress never goes to stdout
