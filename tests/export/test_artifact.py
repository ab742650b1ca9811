"""Atomic artifacts: old or new file, never a mix; no temporaries left; one writer at a time; Ctrl-C honoured.

The subprocess tests write a tiny ONNX graph (one Add of a constant) through ``atomic_destination``
so that each process costs only the onnx import; ``tests.pause_points`` stops a writer at a named
stage (from the test side: the library carries no hook) so the test can kill it exactly there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import quantship.export.artifact as artifact
from quantship.errors import ExportRefused
from tests.pause_points import child_env, install
from tests.processes import wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")

WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    import quantship.export.artifact as artifact

    path, value, external, wait = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
    if external:
        artifact.EXTERNAL_DATA_THRESHOLD = 0
    const = numpy_helper.from_array(np.full((64, 64), value, np.float32), "c")
    graph = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])], [const])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    try:
        with artifact.atomic_destination(path, wait=wait) as staged:
            print("quantship-started", file=sys.stderr, flush=True)
            artifact.save_model(model, staged)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
""")


def _model(value: float) -> onnx.ModelProto:
    const = numpy_helper.from_array(np.full((64, 64), value, np.float32), "c")
    graph = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])], [const])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _value(path: Path) -> float:
    """The constant the graph at ``path`` adds, read with its external data (fails on a mismatched pair)."""
    model = onnx.load(str(path))
    return float(numpy_helper.to_array(model.graph.initializer[0]).flat[0])


def _write(path: Path, value: float) -> None:
    with artifact.atomic_destination(path) as staged:
        artifact.save_model(_model(value), staged)


def _spawn(tmp_path: Path, out: Path, value: float, *, external: bool, wait: bool = True,
           pause: str | None = None) -> subprocess.Popen:
    script = tmp_path.parent / "writer.py"
    if not script.exists():
        script.write_text(WRITER)
    env = child_env({**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}, pause)
    return subprocess.Popen([sys.executable, str(script), str(out), str(value), "1" if external else "0",
                             "1" if wait else "0"], stderr=subprocess.PIPE, text=True, env=env)


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_plain_write_leaves_only_the_file(tmp_path):
    _write(tmp_path / "m.onnx", 1.0)
    _write(tmp_path / "m.onnx", 2.0)
    assert _listing(tmp_path) == ["m.onnx"] and _value(tmp_path / "m.onnx") == 2.0


def test_external_data_pair_gets_a_new_name_and_the_old_weights_go(tmp_path, monkeypatch):
    monkeypatch.setattr(artifact, "EXTERNAL_DATA_THRESHOLD", 0)
    out = tmp_path / "big.onnx"
    _write(out, 1.0)
    first = artifact.external_locations(out)
    _write(out, 2.0)
    second = artifact.external_locations(out)
    assert len(first) == len(second) == 1 and first != second
    assert _listing(tmp_path) == sorted(["big.onnx", *second]) and _value(out) == 2.0


def test_a_crash_between_the_weights_and_the_graph_keeps_the_old_pair(tmp_path, monkeypatch):
    monkeypatch.setattr(artifact, "EXTERNAL_DATA_THRESHOLD", 0)
    out = tmp_path / "big.onnx"
    _write(out, 1.0)

    def crash(stage):
        if stage == "data-moved":
            raise RuntimeError("injected crash after the weights moved")

    undo = install(crash)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            _write(out, 2.0)
    finally:
        undo()
    assert _value(out) == 1.0  # the old graph, with its own weights
    assert _listing(tmp_path) == sorted(["big.onnx", *artifact.external_locations(out)])


def test_a_directory_or_a_missing_parent_is_refused_before_any_work(tmp_path):
    (tmp_path / "d.onnx").mkdir()
    with pytest.raises(ExportRefused, match="is a directory"):
        _write(tmp_path / "d.onnx", 1.0)
    with pytest.raises(ExportRefused, match="does not exist"):
        _write(tmp_path / "nope" / "m.onnx", 1.0)
    assert _listing(tmp_path) == ["d.onnx"] and list((tmp_path / "d.onnx").iterdir()) == []


def test_stale_temp_dirs_are_removed_but_a_live_one_is_kept(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    stale = tmp_path / f".quantship-other.onnx-{dead_pid}-0badf00d.tmp"
    stale.mkdir()
    (stale / "half.onnx").write_bytes(b"partial")
    live = tmp_path / f".quantship-busy.onnx-{dead_pid}-0123abcd.tmp"
    live.mkdir()
    unrelated = tmp_path / ".quantship-notes"  # not our name pattern: never touched
    unrelated.mkdir()
    fresh = tmp_path / f".quantship-m.onnx-{dead_pid}-00000001.new"  # a run between mkdir and lock: kept
    fresh.mkdir()
    old_new = tmp_path / f".quantship-m.onnx-{dead_pid}-00000002.new"  # killed there long ago: removed
    old_new.mkdir()
    os.utime(old_new, (time.time() - 600, time.time() - 600))
    import fcntl

    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a live run holds its directory's lock
        _write(tmp_path / "m.onnx", 1.0)
        assert _listing(tmp_path) == sorted([live.name, unrelated.name, fresh.name, "m.onnx"])
    finally:
        os.close(fd)
    _write(tmp_path / "m.onnx", 2.0)
    assert _listing(tmp_path) == sorted([unrelated.name, fresh.name, "m.onnx"])


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler, whatever the runner started us with (a background job ignores SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_swallowed_ctrl_c_stops_the_commit(tmp_path, default_sigint):
    out = tmp_path / "m.onnx"
    _write(out, 1.0)
    with pytest.raises(KeyboardInterrupt):
        with artifact.atomic_destination(out) as staged:
            artifact.save_model(_model(2.0), staged)
            try:  # what a library that catches KeyboardInterrupt does
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:
                pass
    assert _value(out) == 1.0 and _listing(tmp_path) == ["m.onnx"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external-data"])
def test_kill_9_at_each_stage_leaves_the_old_or_the_new_file(tmp_path, external):
    """kill -9 at every stage of a commit; after the next run: exactly one whole file, nothing else."""
    outcomes = {}
    for stage in ("staged", "data-moved", "graph-replaced"):
        if stage == "data-moved" and not external:
            continue
        work = tmp_path / stage
        work.mkdir()
        out = work / "m.onnx"
        proc = _spawn(tmp_path, out, 1.0, external=external)
        assert proc.wait(60) == 0, proc.stderr.read()
        proc = _spawn(tmp_path, out, 2.0, external=external, pause=stage)
        wait_for(proc, f"quantship-paused:{stage}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert any(p.name.startswith(".quantship-") for p in work.iterdir())  # the killed run's leftovers
        outcomes[stage] = _value(out)  # whole and self-consistent even before the next run
        proc = _spawn(tmp_path, work / "other.onnx", 3.0, external=external)  # the next run in that directory
        assert proc.wait(60) == 0, proc.stderr.read()
        assert not [p.name for p in work.iterdir() if p.name.startswith(".")]  # its temp dir and lock are gone
        # weights moved before the kill but never referenced are removed by the next write of m.onnx
        proc = _spawn(tmp_path, out, outcomes[stage], external=external)
        assert proc.wait(60) == 0, proc.stderr.read()
        keep = {"m.onnx", "other.onnx"} | artifact.external_locations(out) | artifact.external_locations(work / "other.onnx")
        assert set(_listing(work)) == keep, _listing(work)
    assert outcomes["staged"] == 1.0 and outcomes["graph-replaced"] == 2.0
    if external:
        assert outcomes["data-moved"] == 1.0


def test_a_second_writer_waits_or_is_refused_with_no_wait(tmp_path):
    out = tmp_path / "m.onnx"
    first = _spawn(tmp_path, out, 1.0, external=False, pause="staged")
    wait_for(first, "quantship-paused:staged")
    refused = _spawn(tmp_path, out, 2.0, external=False, wait=False)
    assert refused.wait(60) == 2
    assert "another process is writing" in refused.stderr.read()
    waiting = _spawn(tmp_path, out, 3.0, external=False, wait=True)
    time.sleep(1.0)
    assert waiting.poll() is None  # blocked on the lock, not writing over the first
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    assert waiting.wait(60) == 0, waiting.stderr.read()
    assert _value(out) == 3.0 and _listing(tmp_path) == ["m.onnx"]


def test_many_concurrent_writers_leave_one_whole_file(tmp_path, monkeypatch):
    out = tmp_path / "m.onnx"
    writers = [_spawn(tmp_path, out, float(v), external=True) for v in range(4)]
    assert [w.wait(120) for w in writers] == [0, 0, 0, 0]
    assert _value(out) in {0.0, 1.0, 2.0, 3.0}
    assert _listing(tmp_path) == sorted(["m.onnx", *artifact.external_locations(out)])


def test_the_lock_is_reentrant_in_a_thread_and_excludes_another(tmp_path):
    import threading

    out = tmp_path / "m.onnx"
    refused = []
    with artifact.destination_lock(out):
        _write(out, 1.0)  # the command holds the lock and its own export takes it again

        def other_writer():
            try:
                with artifact.destination_lock(out, wait=False):
                    pass
            except ExportRefused as exc:
                refused.append(str(exc))

        thread = threading.Thread(target=other_writer)
        thread.start()
        thread.join(30)
    assert len(refused) == 1 and "another process is writing" in refused[0]
    assert _listing(tmp_path) == ["m.onnx"]  # the lock file goes with the last holder
