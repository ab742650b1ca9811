"""quantship inspect / check on the command line: exit codes 0 / 1 / 2, JSON, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest
import torch
from onnx import helper

from quantship.cli.main import main
from quantship.inspect.run.consumers import tigris_executable
from tests.inspect.conftest import SmallNet, export_pt2e, with_external_data
from tests.onnx_edits import strip_kernel_shape


@pytest.fixture(scope="module")
def small_files(tmp_path_factory):
    """A pt2e INT8 SmallNet file and the same file with every Conv's kernel_shape removed."""
    root = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(1, 3, 32, 32, generator=g) for _ in range(4)]
    good = export_pt2e(SmallNet().eval(), calib, root / "small_int8.onnx")
    model = onnx.load(str(good))
    strip_kernel_shape(model)
    stripped = root / "small_no_kernel_shape.onnx"
    onnx.save(model, str(stripped))
    return {"good": good, "stripped": stripped}


def test_check_exit_codes(small_files, capsys):
    assert main(["check", str(small_files["good"]), "--target", "tigris"]) == 0
    assert main(["check", str(small_files["stripped"]), "--target", "tensorrt"]) == 1
    out = capsys.readouterr().out
    assert "conv_kernel_shape" in out and "fix:" in out


def test_check_json(small_files, capsys):
    assert main(["check", str(small_files["stripped"]), "--target", "tensorrt", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["version"] == 1 and data["ok"] is False and data["findings"][0]["rule"] == "conv_kernel_shape"


def test_check_run_tigris(small_files, capsys):
    if tigris_executable() is None:
        pytest.skip("tigris CLI not installed")
    assert main(["check", str(small_files["good"]), "--target", "tigris", "--run", "--n", "5"]) == 0
    assert "run TiGrIS: passed" in capsys.readouterr().out


def test_inspect_human_and_json(small_files, capsys):
    assert main(["inspect", str(small_files["good"])]) == 0
    out = capsys.readouterr().out
    assert "QDQ" in out and "naive peak" in out and "stored as int8" in out
    assert main(["inspect", str(small_files["good"]), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["version"] == 1 and data["format"] == "QDQ"


def _garbage(kind: str, small_files, tmp_path):
    path = tmp_path / f"{kind}.onnx"
    if kind == "not_onnx":
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    elif kind == "truncated":
        data = small_files["good"].read_bytes()
        path.write_bytes(data[: len(data) * 2 // 3])
    elif kind == "missing_external_data":
        with_external_data(small_files["good"], path)
        path.with_name(path.name + ".data").unlink()
    elif kind == "empty_graph":
        onnx.save(helper.make_model(helper.make_graph([], "g", [], []),
                                    opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


@pytest.mark.parametrize("kind", ["not_onnx", "truncated", "missing_external_data", "empty_graph"])
@pytest.mark.parametrize("command", [["inspect"], ["check", "--target", "tigris"]])
def test_garbage_is_one_line_exit_2(small_files, tmp_path, capsys, kind, command):
    path = _garbage(kind, small_files, tmp_path)
    assert main([command[0], str(path), *command[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "error:" in err and "Traceback" not in err


def test_garbage_through_a_subprocess(small_files, tmp_path):
    path = _garbage("truncated", small_files, tmp_path)
    done = subprocess.run([sys.executable, "-m", "quantship", "check", str(path), "--target", "tensorrt"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


# --- one verdict: --run --inputs, failed vs refused vs inconclusive, exit codes ----------------------

def test_check_run_on_real_inputs_npy_npz_and_image_folder(small_files, tmp_path, capsys):
    import numpy as np
    from PIL import Image

    x = np.random.default_rng(3).standard_normal((5, 3, 32, 32)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "x.npz", images=x, labels=np.arange(5))
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(4):
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    good = str(small_files["good"])
    for extra, n in ((["--inputs", str(tmp_path / "x.npy")], 5), (["--inputs", str(tmp_path / "x.npz"), "--key", "images"], 5),
                     (["--inputs", str(folder), "--resize", "32", "--crop", "32"], 4)):
        assert main(["check", good, "--target", "onnxruntime", "--run", "--n", "20", *extra, "--json"]) == 0
        run = json.loads(capsys.readouterr().out)["runs"][0]
        assert run["inputs"] == "given" and run["status"] == "passed", run
        assert run["n_inputs"] == n  # a batch-1 file: one batch per image
    assert main(["check", good, "--target", "onnxruntime", "--run", "--n", "2", "--inputs", str(tmp_path / "x.npy")]) == 0
    assert "on 2 given input batch(es)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--inputs", "X"], "add --run"),
    (["--run", "--inputs", "missing.npy"], "does not exist"),
    (["--run", "--inputs", "WRONG"], "dimension 2 is 16, not 32"),
    (["--run", "--n", "0"], "must be a positive integer"),
])
def test_check_inputs_bad_input_exit_2(small_files, tmp_path, capsys, monkeypatch, argv, message):
    import numpy as np

    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "x.npy", np.zeros((2, 3, 32, 32), np.float32))
    np.save(tmp_path / "wrong.npy", np.zeros((2, 3, 16, 16), np.float32))
    argv = [{"X": "x.npy", "WRONG": "wrong.npy"}.get(a, a) for a in argv]
    assert main(["check", str(small_files["good"]), "--target", "onnxruntime", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def _fake_run(status, max_lsb, detail=""):
    from quantship.inspect.judge.runs import RunResult

    def run_consumer(path, target, n_inputs=20, seed=0, inputs=None, weight_only=None):
        return RunResult("OpenVINO", True, status == "passed", detail, n_inputs, max_lsb, 0.5, 2.0, status)
    return run_consumer


@pytest.mark.parametrize("status, max_lsb, detail, shown", [
    ("failed", 3.0, "", "failed: OpenVINO 3.0 LSB > tolerance 2"),
    ("inconclusive", 0.0, "inconclusive: the reference output is the same for every input; pass real inputs",
     "inconclusive (OpenVINO): the reference output is the same for every input; pass real inputs"),
    ("passed", 1.0, "", "accepted (ran: OpenVINO 1.0 LSB <= 2)"),
])
def test_check_run_verdict_words_and_exit_code(small_files, capsys, monkeypatch, status, max_lsb, detail, shown):
    """A tolerance miss is 'failed', never 'refused'; a vacuous comparison is 'inconclusive' and exits 1."""
    from quantship.inspect.judge import runs

    monkeypatch.setattr(runs, "run_consumer", _fake_run(status, max_lsb, detail))
    code = main(["check", str(small_files["good"]), "--target", "openvino", "--run", "--n", "2"])
    out = capsys.readouterr().out
    assert code == (0 if status == "passed" else 1)
    assert shown in out and "refused" not in out, out
    assert main(["check", str(small_files["good"]), "--target", "openvino", "--run", "--n", "2", "--json"]) == code
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == {"passed": "accepted"}.get(status, status) and data["runs"][0]["status"] == status


def test_static_refusal_is_refused_exit_1(small_files, capsys):
    assert main(["check", str(small_files["stripped"]), "--target", "tensorrt", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["verdict"] == "refused"
