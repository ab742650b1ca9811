"""A DistilBERT (``input_ids``, ``attention_mask``: two integer inputs) through every command that runs a
file, from an ``.npz`` keyed by input name and with no data given: each command runs in a child process,
exits as documented and prints no traceback. Bad data is one line, exit 2 (through the CLI's ``main`` in this
process, one case in a child process too). (Issue 38, item 2.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.text_models import VOCAB, export_distilbert, token_data

SRC = Path(__file__).resolve().parents[2] / "src"
GENERATED = f"input_ids: ids in [0, {VOCAB}), attention_mask: ones"


def quantship(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-m", "quantship", *argv], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """The float file, its INT8 file from ``quantize-onnx`` (and that command's JSON), the torch model, the data."""
    folder = tmp_path_factory.mktemp("distilbert")
    model, float_path = export_distilbert(folder)
    np.savez(folder / "cal.npz", **token_data())
    done = quantship("quantize-onnx", float_path.name, "--calib", "cal.npz", "--out", "int8.onnx", "--json",
                     cwd=folder)
    assert done.returncode == 0, done.stderr
    return {"dir": folder, "model": model, "float": float_path, "int8": folder / "int8.onnx",
            "quantize": json.loads(done.stdout)}


def test_quantize_onnx_runs_its_check_on_both_inputs(bert):
    """The check --run row was 'accepted' while nothing ran (``check.runs == []``): it runs now."""
    report = bert["quantize"]
    (run,) = report["check"]["runs"]
    assert run["ran"] and run["status"] == "passed" and run["inputs"] == "given" and run["n_inputs"] > 0
    assert report["verdict"] == report["check"]["verdict"] == "accepted"


@pytest.mark.parametrize("data", ["npz", "none"])
def test_check_run(bert, data):
    given = ["--inputs", "cal.npz"] if data == "npz" else []
    done = quantship("check", "int8.onnx", "--target", "onnxruntime-cpu", "--run", *given, cwd=bert["dir"])
    assert done.returncode == 0, done.stderr
    assert "accepted (ran: ONNX Runtime" in done.stdout
    assert ("8 given input batch(es)" if given else f"20 generated input batch(es) (seeded; {GENERATED})") in done.stdout
    as_json = quantship("check", "int8.onnx", "--target", "onnxruntime-cpu", "--run", *given, "--json", cwd=bert["dir"])
    (run,) = json.loads(as_json.stdout)["runs"]
    assert run["ran"] and run["inputs"] == ("given" if given else "generated")


@pytest.mark.parametrize("data", ["npz", "none"])
def test_compare(bert, data):
    given = ["--inputs", "cal.npz"] if data == "npz" else []
    done = quantship("compare", "distilbert.onnx", "int8.onnx", "--target", "onnxruntime-cpu", *given, cwd=bert["dir"])
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if "LSB, mean" in line]
    assert len(rows) == 2 and "not run" not in done.stdout
    assert ("16 from cal.npz input(s) in 8 batch(es)" if given else GENERATED) in done.stdout


@pytest.mark.parametrize("data", ["npz", "none"])
def test_sensitivity(bert, data):
    given = ["--calib", "cal.npz"] if data == "npz" else []
    done = quantship("sensitivity", "distilbert.onnx", *given, "--out-dir", f"sens_{data}", "--json", cwd=bert["dir"])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["report"]["rows"] and (bert["dir"] / f"sens_{data}" / "sensitivity.html").is_file()
    assert report["data"] == ("--calib cal.npz" if given else f"data generated (seeded; {GENERATED}): no --calib given")


@pytest.mark.parametrize("data", ["dict", "list", "none"])
def test_verify_qdq(bert, data):
    from quantship.inspect.run.verify import verify_qdq

    arrays = token_data()
    sample = {"dict": arrays, "list": [{k: v[i:i + 2] for k, v in arrays.items()} for i in range(0, 16, 2)],
              "none": None}[data]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights: the classifier may predict one class (a warning)
        result = verify_qdq(bert["model"], bert["int8"], sample, n_batches=8 if data == "dict" else 1)
    assert 0.0 <= float(result) <= 1.0
    assert result.readings.literal_lsb is not None and result.readings.n_values == 16 * 3


@pytest.mark.parametrize("name, arrays, message", [
    ("wrong key", {"ids": "ids", "attention_mask": "mask"}, "the file's inputs are ['input_ids', 'attention_mask']"),
    ("wrong dtype", {"input_ids": "text", "attention_mask": "mask"}, "input 'input_ids' is declared int64"),
    ("fractions for ids", {"input_ids": "fractions", "attention_mask": "mask"}, "32 value(s) with a fraction"),
    ("NaN", {"input_ids": "nan", "attention_mask": "mask"}, "1 NaN or infinite value(s)"),
])
def test_bad_data_is_one_line_exit_2(bert, name, arrays, message, capsys, monkeypatch):
    """Each command through the CLI's ``main`` in this process (a child process pays some 15 s of imports
    before its one-line refusal); the first case also in a child process, for the exit code and stderr a shell
    sees."""
    from quantship.cli.main import main

    bad = f"bad_{name.replace(' ', '_')}.npz"
    good = token_data(4)
    values = {"ids": good["input_ids"], "mask": good["attention_mask"], "text": np.full((4, 8), "a"),
              "fractions": good["input_ids"] + 0.5, "nan": good["input_ids"].astype(np.float64)}
    values["nan"][0, 0] = np.nan
    np.savez(bert["dir"] / bad, **{key: values[v] for key, v in arrays.items()})
    monkeypatch.chdir(bert["dir"])
    before = sorted(p.name for p in bert["dir"].iterdir())
    commands = (["check", "int8.onnx", "--target", "onnxruntime-cpu", "--run", "--inputs", bad],
                ["compare", "distilbert.onnx", "int8.onnx", "--target", "onnxruntime-cpu", "--inputs", bad],
                ["sensitivity", "distilbert.onnx", "--calib", bad, "--out-dir", f"sens_{bad}"])
    for argv in commands:
        code = main(argv)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and message in lines[0], (argv, lines)
        assert "Traceback" not in lines[0]
    assert sorted(p.name for p in bert["dir"].iterdir()) == before  # nothing written, no report folder
    if name == "wrong key":
        done = quantship(*commands[2], cwd=bert["dir"])
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr


def test_a_run_that_cannot_run_here_says_not_run_in_the_table_and_the_json(bert):
    """TensorRT cannot run here: the check row says "not run" and why, never "accepted", in both forms."""
    table = quantship("quantize-onnx", "distilbert.onnx", "--calib", "cal.npz", "--target", "tensorrt",
                      "--out", "trt.onnx", cwd=bert["dir"])
    as_json = quantship("quantize-onnx", "distilbert.onnx", "--calib", "cal.npz", "--target", "tensorrt",
                        "--out", "trt_json.onnx", "--json", cwd=bert["dir"])
    assert table.returncode == as_json.returncode == 0, table.stderr + as_json.stderr
    report = json.loads(as_json.stdout)
    (run,) = report["check"]["runs"]
    assert report["verdict"] == report["check"]["verdict"] == "not run" and not run["ran"]
    assert "cannot run on this machine" in run["detail"]
    row = " ".join(line.strip("│ ") for line in table.stdout.splitlines() if "│" in line)
    assert "check tensorrt --run" in row and "not run (TensorRT" in row and "accepted" not in row
