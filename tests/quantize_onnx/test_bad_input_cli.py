"""Bad input to ``quantize-onnx`` (issue 27), each through the real command in a fresh process: exit 2,
one line on stderr, no traceback, nothing at ``--out`` (nor a staging file beside it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from quantship.errors import DataRefused
from quantship.inspect.read import external
from quantship.quantize_onnx.memory import MODEL_COPIES, available_bytes, refuse_if_too_large
from tests.quantize_onnx import graphs

SRC = Path(__file__).resolve().parents[2] / "src"


_varint = external.encoded_varint  # protobuf's varint, to write a file's bytes by hand


def huge_conv(path: Path, n_bytes: int) -> Path:
    """A valid ONNX file whose one Conv weight holds ``n_bytes`` of zeros, written sparse (the disk holds
    a few hundred bytes whatever its size). The weight is a second ``graph`` field, which protobuf merges
    into the first: its initializer list gains the weight."""
    channels = n_bytes // 4
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")]
    head = graphs.model(nodes, [graphs.value("x", [1, 1, 1, 1])], [graphs.value("y", [1, channels, 1, 1])])
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[channels, 1, 1, 1]).SerializeToString()
    size = 4 * channels
    weight = tensor + b"\x4a" + _varint(size)  # TensorProto.raw_data (field 9), then the bytes
    initializer = b"\x2a" + _varint(len(weight) + size)  # GraphProto.initializer (field 5)
    graph = b"\x3a" + _varint(len(initializer) + len(weight) + size)  # ModelProto.graph (field 7)
    with open(path, "wb") as f:
        f.write(head.SerializeToString() + graph + initializer + weight)
        f.truncate(f.tell() + size)
    return path


def test_the_sparse_builder_writes_a_model_onnx_and_ort_read():
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as d:
        path = huge_conv(Path(d) / "small.onnx", 4 * 6)
        onnx.checker.check_model(onnx.load(str(path)))
        y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
            None, {"x": np.ones((1, 1, 1, 1), np.float32)})[0]
        assert y.shape == (1, 6, 1, 1) and not y.any()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_cli")
    float_path = graphs.save(graphs.conv_relu_conv(), d / "float.onnx")
    np.save(d / "cal.npy", graphs.images(4))
    from quantship.quantize_onnx import quantize_onnx_file

    quantize_onnx_file(float_path, d / "int8.onnx", graphs.images(4), target="onnxruntime-cpu", run_check=False)
    onnx.save_model(onnx.load(str(float_path)), str(d / "external.onnx"), save_as_external_data=True,
                    location="external.data", size_threshold=0)
    (d / "external.data").unlink()  # the weights the graph points to are not beside it
    graphs.save(graphs.integer_ids(), d / "ids.onnx")
    np.save(d / "ids_float.npy", np.full((6, 5), 2.5, np.float32))  # fractions: no exact int cast
    np.save(d / "rank3.npy", np.zeros((4, 3, 8), np.float32))
    room = available_bytes()
    if room is not None:  # as large as all the memory available now: MODEL_COPIES of it cannot fit
        huge_conv(d / "huge.onnx", room)
    return d


CASES = [
    ("already quantized", "quantize-onnx", "int8.onnx", "cal.npy", "already quantized"),
    ("external data missing", "quantize-onnx", "external.onnx", "cal.npy", "'external.data', which is missing"),
    ("larger than memory", "quantize-onnx", "huge.onnx", "cal.npy", "MemAvailable"),
    ("fractions for an int32 input", "quantize-onnx", "ids.onnx", "ids_float.npy", "with a fraction"),
    ("wrong rank", "quantize-onnx", "float.onnx", "rank3.npy", "rank 4"),
    ("sensitivity on a quantized file", "sensitivity", "int8.onnx", "cal.npy", "already quantized"),
    ("sensitivity, larger than memory", "sensitivity", "huge.onnx", "cal.npy", "MemAvailable"),
]


@pytest.mark.parametrize("command, model, calib, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(command, model, calib, message, files, tmp_path):
    if not (files / model).exists():
        pytest.skip("no MemAvailable in /proc/meminfo here: the memory estimate has nothing to compare with")
    out = tmp_path / "q.onnx"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    where = ["--out", str(out)] if command == "quantize-onnx" else ["--out-dir", str(tmp_path / "report")]
    done = subprocess.run([sys.executable, "-m", "quantship", command, str(files / model), "--calib",
                           str(files / calib), *where], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_the_memory_estimate_names_the_data_when_the_data_is_what_does_not_fit(tmp_path):
    path = graphs.save(graphs.conv_relu_conv(), tmp_path / "f.onnx")
    feeds = [{"x": graphs.images(64)}]
    fits = refuse_if_too_large(path, feeds, available=1 << 40)
    # the data held, and the batch ONNX Runtime copies in for a run
    assert fits.data_bytes == 2 * feeds[0]["x"].nbytes and fits.total > MODEL_COPIES * path.stat().st_size
    assert refuse_if_too_large(path, feeds, available=fits.fixed + 1) == fits  # calibration slices shrink to fit
    with pytest.raises(DataRefused, match=r"--max-samples.*--batch-size"):
        refuse_if_too_large(path, feeds, available=fits.fixed)


@pytest.mark.parametrize("extra, message", [
    (["--shared-scale", "conv1"], "--shared-scale 'conv1' names no Concat"),
    (["--shared-scale", "conv1", "--engine", "ort"], "--shared-scale runs in quantship's engine"),
], ids=["not a concat", "with --engine ort"])
def test_a_shared_scale_the_file_cannot_take_exits_2_with_one_line(extra, message, files, tmp_path):
    out = tmp_path / "q.onnx"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-m", "quantship", "quantize-onnx", str(files / "float.onnx"), "--calib",
                           str(files / "cal.npy"), "--out", str(out), *extra], capture_output=True, text=True,
                          env=env, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not out.exists()
