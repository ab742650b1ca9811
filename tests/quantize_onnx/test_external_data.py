"""Float files with external data in, INT8 files with external data out (issue 40, item 1).

The CLI runs in a fresh process on files that really keep their weights beside the graph (one data
file, or one file per tensor, as ``onnx.save_model(..., save_as_external_data=True)`` writes them).
The writer's threshold is lowered in-process to write a graph + data pair without 2 GB of weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from quantship.errors import ExportRefused
from quantship.export import artifact
from quantship.inspect.read import external
from quantship.inspect.read.loading import load_onnx
from quantship.inspect.run.consumers import session_of
from quantship.quantize_onnx import quantizer
from tests.quantize_onnx import graphs

SRC = Path(__file__).resolve().parents[2] / "src"
CHANNELS = 64  # w1 is 64x3x3x3: 1,728 bytes as int8, above EXTERNAL_TENSOR_MIN_BYTES once quantized too


def _cli(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-m", "quantship", *argv], capture_output=True, text=True, env=env,
                          timeout=300, cwd=cwd)


def _save_external(path: Path, *, one_file: bool) -> Path:
    model = graphs.conv_relu_conv(CHANNELS)
    onnx.checker.check_model(model)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=one_file,
                    location=path.name + ".data" if one_file else None, size_threshold=0)
    return path


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    """The file run by path in ONNX Runtime (its external data resolved beside it), at default optimizations."""
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _sqnr_db(reference: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - got) ** 2)))


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "cal.npy"
    np.save(path, graphs.images(16))
    return path


def test_cli_quantizes_a_float_file_with_one_data_file_per_tensor_into_one_file(tmp_path, calib):
    float_path = _save_external(tmp_path / "float.onnx", one_file=False)
    assert sorted(external.locations(onnx.load(str(float_path), load_external_data=False))) == ["b1", "w1", "w2"]
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    done = _cli("quantize-onnx", str(float_path), "--calib", str(calib), "--out", str(out), "--no-speed", "--json")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["q.onnx"]  # small: one file, no data beside it
    assert not external.locations(onnx.load(str(out), load_external_data=False))
    fidelity = json.loads(done.stdout)["fidelity_fp32"]  # measured by the CLI on held-out samples
    assert fidelity["status"] == "met" and fidelity["sqnr_db"] > 25, fidelity
    x = graphs.images(8, seed=1)
    sqnr = _sqnr_db(_run(float_path, x), _run(out, x))
    assert sqnr > 25, sqnr  # 8-bit activations on an 8x8 two-conv net: about 34 dB here


def test_writer_over_the_threshold_writes_graph_and_data_that_ort_loads_from_the_destination(
        tmp_path, calib, monkeypatch):
    float_path = _save_external(tmp_path / "float.onnx", one_file=True)
    monkeypatch.setattr(artifact, "EXTERNAL_DATA_THRESHOLD", 0)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = quantizer.quantize_onnx_file(float_path, out_dir / "q.onnx", np.load(calib), target="onnxruntime-cpu")
    (data,) = external.locations(onnx.load(str(result.path), load_external_data=False))
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(["q.onnx", data])
    assert data.startswith("q.onnx.") and data.endswith(".data")
    stored = {t.name: t for t in onnx.load(str(result.path), load_external_data=False).graph.initializer}
    assert stored["w1_quantized"].data_location == onnx.TensorProto.EXTERNAL  # 1,728 bytes: beside the graph
    assert stored["x_scale"].data_location == onnx.TensorProto.DEFAULT  # a scalar: kept in the graph
    x = graphs.images(8, seed=2)
    monkeypatch.chdir(tmp_path)  # ONNX Runtime resolves the data beside the graph, not from the working directory
    assert _sqnr_db(_run(float_path, x), _run(result.path, x)) > 25
    assert result.fp32 is not None


def test_external_writer_leaves_the_model_unchanged_and_sessions_agree(tmp_path, monkeypatch):
    model = graphs.conv_relu_conv(CHANNELS)
    before = model.SerializeToString()
    assert external.save_with_external_data(model, tmp_path / "m.onnx", "m.onnx.data", min_bytes=0)
    assert model.SerializeToString() == before
    x = graphs.images(4)
    by_path = _run(tmp_path / "m.onnx", x)
    options = ort.SessionOptions()
    monkeypatch.setattr(external, "SINGLE_FILE_MAX_BYTES", 0)  # the in-memory model goes through a temp folder
    through_folder = session_of(model, options).run(None, {"x": x})[0]
    assert np.array_equal(by_path, through_folder)
    assert np.array_equal(by_path, _run_bytes(model, x))


def _run_bytes(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, calib) -> tuple[Path, Path]:
    """An external-data float file and its INT8 file, also with external data."""
    d = tmp_path_factory.mktemp("pair")
    float_path = _save_external(d / "float.onnx", one_file=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(artifact, "EXTERNAL_DATA_THRESHOLD", 0)
        q = quantizer.quantize_onnx_file(float_path, d / "int8.onnx", np.load(calib), target="onnxruntime-cpu",
                                         run_check=False).path
    assert external.locations(onnx.load(str(q), load_external_data=False))
    return float_path, q


@pytest.mark.parametrize("argv", [["inspect", "{float}"], ["inspect", "{int8}"],
                                  ["check", "{int8}", "--target", "onnxruntime-cpu", "--run"],
                                  ["compare", "{float}", "{int8}"]], ids=["inspect float", "inspect int8", "check --run", "compare"])
def test_readers_take_an_external_data_pair(pair, argv):
    float_path, int8_path = pair
    args = [a.format(float=float_path, int8=int8_path) for a in argv]
    done = _cli(*args, cwd=float_path.parent.parent)  # the working directory is not the files' folder
    assert done.returncode == 0, done.stderr
    if argv[0] == "check":
        assert "accepted" in done.stdout and "passed" in done.stdout, done.stdout
    if argv[0] == "compare":
        assert "LSB" in done.stdout and "SQNR" in done.stdout, done.stdout


def _break(kind: str, folder: Path) -> Path:
    path = _save_external(folder / "float.onnx", one_file=True)
    data = folder / "float.onnx.data"
    if kind == "missing":
        data.unlink()
    elif kind == "truncated":
        data.write_bytes(data.read_bytes()[:100])
    else:
        model = onnx.load(str(path), load_external_data=False)
        for entry in next(t for t in model.graph.initializer if t.name == "w1").external_data:
            if entry.key == "location":
                entry.value = "../../etc/passwd" if kind == "escapes" else "/etc/passwd"
        onnx.save_model(model, str(path))
    return path


@pytest.mark.parametrize("kind, said", [("missing", "missing"), ("truncated", "truncated"),
                                        ("escapes", "outside the model's folder"),
                                        ("absolute", "outside the model's folder")])
def test_bad_external_data_is_refused_in_one_line_naming_tensor_and_file(kind, said, tmp_path, calib):
    src = tmp_path / "src"
    src.mkdir()
    path = _break(kind, src)
    before = _digest(src)
    out = tmp_path / "out"
    out.mkdir()
    done = _cli("quantize-onnx", str(path), "--calib", str(calib), "--out", str(out / "q.onnx"))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert said in lines[0] and ("'w1'" in lines[0] or "'b1'" in lines[0] or "'w2'" in lines[0]), lines[0]
    assert "float.onnx.data" in lines[0] or "passwd" in lines[0], lines[0]
    assert list(out.iterdir()) == [] and _digest(src) == before


def test_a_failure_after_staging_leaves_neither_graph_nor_data(tmp_path, calib, monkeypatch):
    float_path = _save_external(tmp_path / "float.onnx", one_file=True)
    before = _digest(tmp_path)
    monkeypatch.setattr(artifact, "EXTERNAL_DATA_THRESHOLD", 0)
    staged_pair = []

    def refuse_after_writing(path, *args, **kwargs):  # the last post-condition, on the staged pair
        staged_pair.extend(p.name for p in Path(path).parent.iterdir())
        raise ExportRefused("the post-condition failed")

    monkeypatch.setattr(quantizer, "check_file", refuse_after_writing)
    with pytest.raises(ExportRefused, match="post-condition"):
        quantizer.quantize_onnx_file(float_path, tmp_path / "q.onnx", np.load(calib), target="onnxruntime-cpu")
    assert any(name.endswith(".data") for name in staged_pair)  # the pair really was staged with its data
    assert _digest(tmp_path) == before  # neither q.onnx nor its data file; the input untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["float.onnx", "float.onnx.data"]


def test_an_input_data_file_named_like_the_outputs_is_never_removed(tmp_path, calib):
    """A float file whose data file is called ``q.onnx.data`` quantized to ``q.onnx`` in the same folder: the
    writer's clean-up of its own stale data files must not take the input's weights."""
    model = graphs.conv_relu_conv(CHANNELS)
    float_path = tmp_path / "a.onnx"
    onnx.save_model(model, str(float_path), save_as_external_data=True, location="q.onnx.data", size_threshold=0)
    quantizer.quantize_onnx_file(float_path, tmp_path / "q.onnx", np.load(calib), target="onnxruntime-cpu",
                                 run_check=False)
    assert (tmp_path / "q.onnx.data").is_file()
    assert load_onnx(float_path) is not None
