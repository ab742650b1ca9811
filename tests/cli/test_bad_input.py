"""Bad input never crashes, hangs or leaves files: one stderr line, exit 2, nothing outside --out.

Each case of issue 15 runs in-process through ``main`` (the one place errors become exit codes),
from an empty working directory and with ``tempfile``'s directory watched, and asserts: exit 2,
exactly one stderr line saying what is wrong, and no file added anywhere. A few run as real
processes: no traceback, Ctrl-C, kill -9 and a second writer.
"""

from __future__ import annotations

import builtins
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from quantship.cli.main import main
from tests.pause_points import PAUSE_ENV, child_env
from tests.processes import wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")
MODEL_PY = """
import torch.nn as nn

def build():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))

def boom():
    raise RuntimeError("factory exploded")
"""


def _with_input_dim(src: Path, dst: Path, value: int) -> Path:
    model = onnx.load(str(src))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = value
    onnx.save(model, str(dst))
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Every input the cases need, made once: data files, a model file, float and INT8 ONNX files."""
    d = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(0)
    good = rng.standard_normal((8, 3, 16, 16)).astype(np.float32)
    np.save(d / "cal.npy", good)
    for name, value in (("nan", np.nan), ("inf", np.inf)):
        bad = good.copy()
        bad[3, 1, 2, 2] = value
        np.save(d / f"{name}.npy", bad)
    np.save(d / "complex.npy", good.astype(np.complex64) + 1j)
    np.save(d / "zero.npy", np.zeros((0, 3, 16, 16), np.float32))
    np.save(d / "wrong.npy", np.zeros((8, 1, 16, 16), np.float32))
    (d / "empty.npy").write_bytes(b"")
    (d / "trunc.npy").write_bytes((d / "cal.npy").read_bytes()[:300])
    (d / "model.py").write_text(MODEL_PY)

    from quantship.export import export_onnx
    from quantship.export.ort_quantize import quantize_onnx_file
    from quantship.sources import load_model

    torch.manual_seed(0)
    float_path = export_onnx(load_model(f"{d / 'model.py'}:build"), torch.from_numpy(good), d / "f.onnx",
                             dynamic_batch=False)
    int8 = quantize_onnx_file(float_path, d / "q.onnx", [good], "onnxruntime-cpu").path
    unloadable = onnx.load(str(int8))
    conv = next(n for n in unloadable.graph.node if n.op_type == "Conv")
    conv.op_type, conv.domain = "NoSuchOp", "com.example"
    unloadable.opset_import.append(onnx.helper.make_opsetid("com.example", 1))
    onnx.save(unloadable, str(d / "unloadable.onnx"))
    custom = onnx.load(str(float_path))  # a float op ORT's symbolic shape inference does not know
    relu = next(n for n in custom.graph.node if n.op_type == "Relu")
    relu.op_type, relu.domain = "MyRelu", "com.example"
    custom.opset_import.append(onnx.helper.make_opsetid("com.example", 1))
    onnx.save(custom, str(d / "custom.onnx"))
    return {
        "CAL": d / "cal.npy", "NAN": d / "nan.npy", "INF": d / "inf.npy", "COMPLEX": d / "complex.npy",
        "ZERO": d / "zero.npy", "WRONG": d / "wrong.npy", "EMPTY": d / "empty.npy", "TRUNC": d / "trunc.npy",
        "BUILD": Path(f"{d / 'model.py'}:build"), "BOOM": Path(f"{d / 'model.py'}:boom"),
        "FLOAT": float_path, "INT8": int8, "UNLOADABLE": d / "unloadable.onnx", "CUSTOM": d / "custom.onnx",
        "HUGE": _with_input_dim(int8, d / "huge.onnx", 10**12),
        "ZERO_INT8": _with_input_dim(int8, d / "zero_int8.onnx", 0),
    }


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """An empty working directory, an output directory and a watched tempfile directory."""
    cwd, out, scratch = tmp_path / "cwd", tmp_path / "out", tmp_path / "scratch"
    for p in (cwd, out, scratch):
        p.mkdir()
    (out / "EXISTING_DIR").mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return tmp_path


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _run_case(argv, files, sandbox, capsys) -> tuple[int, list[str], float]:
    argv = [str(files[a]) if a in files else str(sandbox / "out" / a[4:]) if a.startswith("OUT/") else a
            for a in argv]
    before = _tree(sandbox)
    start = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - start
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert _tree(sandbox) == before, "a file was added or removed outside what the command may write"
    return code, err, seconds


CASES = [
    ("nan pixel", ["quantize", "BUILD", "--calib", "NAN", "--out", "OUT/q.onnx", "--batch-size", "4"], "NaN or infinite"),
    ("inf pixel", ["quantize", "BUILD", "--calib", "INF", "--out", "OUT/q.onnx", "--batch-size", "4"], "NaN or infinite"),
    ("complex data", ["quantize", "BUILD", "--calib", "COMPLEX", "--out", "OUT/q.onnx", "--batch-size", "4"], "complex"),
    ("empty .npy", ["quantize", "BUILD", "--calib", "EMPTY", "--out", "OUT/q.onnx"], "empty or truncated"),
    ("truncated .npy", ["quantize", "BUILD", "--calib", "TRUNC", "--out", "OUT/q.onnx"], "empty or truncated"),
    ("zero samples", ["quantize", "BUILD", "--calib", "ZERO", "--out", "OUT/q.onnx"], "is empty"),
    ("factory raises", ["quantize", "BOOM", "--calib", "CAL", "--out", "OUT/q.onnx"], "raised RuntimeError: factory exploded"),
    ("sensitivity of a PyTorch model without data", ["sensitivity", "BUILD", "--out-dir", "OUT/report"],
     "--calib DATA is required for a PyTorch model"),
    ("batch -5", ["quantize", "BUILD", "--calib", "CAL", "--out", "OUT/q.onnx", "--batch-size", "-5"], "positive integer"),
    ("model vs data mismatch", ["quantize", "BUILD", "--calib", "WRONG", "--out", "OUT/q.onnx"], "cannot run on a calibration batch"),
    ("quantize --out dir", ["quantize", "BUILD", "--calib", "CAL", "--out", "OUT/EXISTING_DIR"], "is a directory"),
    ("onnx --out dir", ["quantize-onnx", "FLOAT", "--calib", "CAL", "--out", "OUT/EXISTING_DIR"], "is a directory"),
    ("already quantized", ["quantize-onnx", "INT8", "--calib", "CAL", "--out", "OUT/q.onnx"], "already quantized"),
    ("calib shape mismatch", ["quantize-onnx", "FLOAT", "--calib", "WRONG", "--out", "OUT/q.onnx"], "declares input"),
    ("onnx nan pixel", ["quantize-onnx", "FLOAT", "--calib", "NAN", "--out", "OUT/q.onnx"], "NaN or infinite"),
    ("onnx complex data", ["quantize-onnx", "FLOAT", "--calib", "COMPLEX", "--out", "OUT/q.onnx"], "complex"),
    ("ORT shape inference fails", ["quantize-onnx", "CUSTOM", "--calib", "CAL", "--out", "OUT/q.onnx", "--engine",
                                   "ort"], "Incomplete symbolic shape inference"),  # ORT writes sym_shape_infer_temp.onnx to the CWD here
    ("an op ORT cannot run", ["quantize-onnx", "CUSTOM", "--calib", "CAL", "--out", "OUT/q.onnx"],
     "does not run in ONNX Runtime"),
    # a batch declared -5 is dynamic, as ONNX Runtime reads it (quantize-onnx takes it: tests/quantize_onnx); 0 is not
    ("compare declares batch 0", ["compare", "FLOAT", "ZERO_INT8", "--target", "onnxruntime"], "must be positive"),
    ("compare huge dim", ["compare", "FLOAT", "HUGE", "--target", "onnxruntime"], "larger than 4 GiB"),
    ("compare unloadable", ["compare", "FLOAT", "UNLOADABLE", "--target", "onnxruntime"], "ONNX Runtime cannot load"),
    ("compare --n -5", ["compare", "FLOAT", "INT8", "--n", "-5"], "positive integer"),
    ("check --run --n -5", ["check", "INT8", "--target", "onnxruntime", "--run", "--n", "-5"], "positive integer"),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(argv, message, files, sandbox, capsys):
    code, err, seconds = _run_case(argv, files, sandbox, capsys)
    assert code == 2, err
    assert len(err) == 1 and message in err[0] and err[0].startswith(f"quantship {argv[0]}: error: "), err
    assert "unexpected" not in err[0] and "Traceback" not in err[0]
    assert seconds < 30  # refused up front, never a hang


def test_an_already_quantized_file_is_refused_in_milliseconds(files, sandbox, capsys):
    code, err, seconds = _run_case(["quantize-onnx", "INT8", "--calib", "CAL", "--out", "OUT/q.onnx"],
                                   files, sandbox, capsys)
    assert code == 2 and "already quantized" in err[0]
    assert seconds < 1.0, f"{seconds:.2f} s"  # before any calibration data is read or ORT runs


def test_quantize_onnx_keeps_ort_scratch_files_out_of_cwd_and_tmp(files, sandbox, capsys, monkeypatch):
    """ORT writes sym_shape_infer_temp.onnx to the CWD (and temp dirs to tempfile's) when it fails."""
    import onnxruntime.quantization.shape_inference as shape_inference

    def failing_pre_process(src, dst, **kwargs):
        onnx.save(onnx.load(src), "sym_shape_infer_temp.onnx")  # what ORT does on incomplete inference
        tempfile.mkdtemp(prefix="pre.quant.")
        raise Exception("Incomplete symbolic shape inference")

    monkeypatch.setattr(shape_inference, "quant_pre_process", failing_pre_process)
    code, err, _ = _run_case(["quantize-onnx", "FLOAT", "--calib", "CAL", "--out", "OUT/q.onnx", "--engine", "ort"],
                             files, sandbox, capsys)
    assert code == 2 and len(err) == 1 and "Incomplete symbolic shape inference" in err[0], err


def test_a_good_quantize_onnx_run_writes_only_its_file(files, sandbox, capsys):
    before = _tree(sandbox)
    assert main(["quantize-onnx", str(files["FLOAT"]), "--calib", str(files["CAL"]), "--out",
                 str(sandbox / "out" / "q.onnx"), "--quiet"]) == 0
    assert sorted(set(_tree(sandbox)) - set(before)) == ["out/q.onnx"]


def _deny(path: Path, monkeypatch) -> None:
    """Make Python's open() refuse ``path`` as an unreadable file would (tests run as root: chmod is no use)."""
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).resolve() == path.resolve():
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    monkeypatch.setattr(io, "open", guarded)


PERMISSION_CASES = [
    (["quantize", "BUILD", "--calib", "CAL", "--out", "OUT/q.onnx"], "CAL"),
    (["quantize-onnx", "FLOAT", "--calib", "CAL", "--out", "OUT/q.onnx"], "FLOAT"),
    (["inspect", "INT8"], "INT8"),
    (["check", "INT8", "--target", "onnxruntime"], "INT8"),
    (["compare", "FLOAT", "INT8", "--target", "onnxruntime"], "FLOAT"),
]


@pytest.mark.parametrize("argv, denied", PERMISSION_CASES, ids=[c[0][0] for c in PERMISSION_CASES])
def test_an_unreadable_file_is_one_line_in_process(argv, denied, files, sandbox, capsys, monkeypatch):
    _deny(files[denied], monkeypatch)
    code, err, _ = _run_case(argv, files, sandbox, capsys)
    assert code == 2 and len(err) == 1 and "permission denied" in err[0].lower(), err
    assert Path(str(files[denied])).name in err[0]


def _default_sigint() -> None:
    # a shell starts background jobs (and some CI runners their children) with SIGINT ignored, and
    # an ignored signal is inherited: give the child the default, as a terminal would
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(*argv: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    env = dict(env or {})
    full_env = child_env({**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **env},
                         env.pop(PAUSE_ENV, None))
    return subprocess.Popen([sys.executable, "-m", "quantship", *argv], stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=full_env, preexec_fn=_default_sigint, **kwargs)


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: chmod 000 does not deny root a read, so an "
                    "unreadable file cannot be made here (the in-process test covers the mapping)")
def test_an_unreadable_file_through_real_processes(files, tmp_path):
    for argv, denied in PERMISSION_CASES:
        locked = tmp_path / Path(str(files[denied])).name
        locked.write_bytes(Path(str(files[denied])).read_bytes())
        locked.chmod(0)
        args = [str(locked) if a == denied else str(files[a]) if a in files else
                str(tmp_path / a[4:]) if a.startswith("OUT/") else a for a in argv]
        done = _cli(*args)
        _, err = done.communicate(timeout=120)
        assert done.returncode == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        locked.unlink()


def test_real_processes_kill_9_second_writer_and_ctrl_c(files, tmp_path):
    """quantize-onnx as a user runs it: a writer paused before its commit holds the lock; a second
    writer with --no-wait is refused; kill -9 keeps the old file; the next run cleans up; Ctrl-C
    exits 130 and writes nothing."""
    out = tmp_path / "q.onnx"
    out.write_bytes(b"the old file")
    argv = ("quantize-onnx", str(files["FLOAT"]), "--calib", str(files["CAL"]), "--out", str(out), "--quiet")

    first = _cli(*argv, env={PAUSE_ENV: "staged"})
    wait_for(first, "quantship-paused:staged", timeout=120)
    second = _cli(*argv, "--no-wait")
    _, err = second.communicate(timeout=120)
    assert second.returncode == 2 and "another process is writing" in err and len(err.strip().splitlines()) == 1, err
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    assert out.read_bytes() == b"the old file"
    assert any(p.name.startswith(".quantship-") for p in tmp_path.iterdir())  # the killed run's temp dir

    third = _cli(*argv, env={PAUSE_ENV: "staged"})
    wait_for(third, "quantship-paused:staged", timeout=120)
    third.send_signal(signal.SIGINT)
    _, err = third.communicate(timeout=60)
    assert third.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert out.read_bytes() == b"the old file"

    fourth = _cli(*argv)
    _, err = fourth.communicate(timeout=120)
    assert fourth.returncode == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx"]
    assert onnx.load(str(out)).graph.node  # the new, whole file


def test_the_api_refuses_bad_calibration_before_any_work():
    from quantship import DataRefused, Quantizer

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    bad = torch.randn(4, 3, 8, 8)
    bad[1, 0, 0, 0] = float("nan")
    with pytest.raises(DataRefused, match="batch 1 holds 1 NaN"):
        Quantizer(backend="pt2e").quantize(model, [torch.randn(4, 3, 8, 8), bad])
    with pytest.raises(DataRefused, match="complex"):
        Quantizer(backend="pt2e").quantize(model, [torch.randn(4, 3, 8, 8, dtype=torch.complex64)])
    with pytest.raises(DataRefused, match="empty"):
        Quantizer(backend="pt2e").quantize(model, [torch.zeros(0, 3, 8, 8)])


@pytest.mark.parametrize("command", ["quantize", "quantize-onnx"])
def test_no_wait_refuses_while_another_writer_holds_the_path(command, files, sandbox, capsys):
    import threading

    from quantship.export.artifact import destination_lock

    out = sandbox / "out" / "q.onnx"
    held, release = threading.Event(), threading.Event()

    def other_writer():
        with destination_lock(out):
            held.set()
            release.wait(60)

    thread = threading.Thread(target=other_writer)
    thread.start()
    held.wait(30)
    try:
        source = "BUILD" if command == "quantize" else "FLOAT"
        code, err, seconds = _run_case([command, source, "--calib", "CAL", "--out", "OUT/q.onnx", "--no-wait"],
                                       files, sandbox, capsys)
    finally:
        release.set()
        thread.join(30)
    assert code == 2 and len(err) == 1 and "another process is writing" in err[0] and seconds < 5, err
    assert not out.exists()
