"""A large model's float file written from its own tensors (``export_onnx`` without optimization, the speed
reading's float reference; issue 40, the PyTorch path's memory): no serialised copy of the weights is held, and the
file is the model: one file when it fits, its one data file beside it otherwise, nothing else left."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import torch

import quantship.export.artifact as artifact
import quantship.heap as heap
from quantship import export_onnx
from quantship.inspect.read import external


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()


def _run(path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_streamed_float_files_are_the_model_in_one_file_or_beside_their_data(tmp_path, monkeypatch):
    model, x = _mlp(), torch.randn(5, 16)
    with torch.no_grad():
        expected = model(x).numpy()
    monkeypatch.setattr(heap, "LARGE_MODEL_BYTES", 0)  # every model streamed
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = export_onnx(model, x, tmp_path / "one" / "m.onnx", optimize=False, opset_version=18)
    assert sorted(p.name for p in one.parent.iterdir()) == ["m.onnx"]  # fits one file: its tensors inside
    assert not external.external_tensors(onnx.load(str(one), load_external_data=False))
    monkeypatch.setattr(artifact, "EXTERNAL_DATA_THRESHOLD", 1000)  # 4.4 kB of weights: over it
    beside = export_onnx(model, x, tmp_path / "two" / "m.onnx", optimize=False, opset_version=18)
    graph = onnx.load(str(beside), load_external_data=False)
    (location,) = external.locations(graph)
    assert sorted(p.name for p in beside.parent.iterdir()) == sorted(["m.onnx", location])
    assert artifact._own_data(beside).match(location)  # named as every data file of quantship's
    assert graph.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"  # the batch named as ever
    for path in (one, beside):
        np.testing.assert_allclose(_run(path, x.numpy()), expected, rtol=1e-5, atol=1e-6)


_CHILD = """
import json, sys, torch
import quantship.export.artifact as artifact
from quantship import export_onnx

artifact.EXTERNAL_DATA_THRESHOLD = 100 << 20  # the file's weights beside it, as a float model's over 1.5 GB

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)]).eval()  # 403 MB of float32
x = torch.randn(2, 2048)
model(x)
small = torch.nn.Linear(4, 4).eval()  # the exporter imported and warmed first: its own memory is not the weights'
export_onnx(small, torch.randn(2, 4), sys.argv[1] + ".small.onnx", optimize=False, opset_version=18)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = hwm()
export_onnx(model, x, sys.argv[1], optimize=False, opset_version=18)
print(json.dumps({"grew": hwm() - before, "weights": sum(p.numel() * 4 for p in model.parameters())}))
"""


def test_a_large_models_float_file_holds_no_copy_of_its_weights(tmp_path):
    """In a fresh process, a model of 403 MB of weights written with its data beside it: the export's peak grows by
    less than a quarter of the weights (measured: 3 MB; a ModelProto of the weights and the
    file read back for writing were two more copies)."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "big.onnx")], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["grew"] < 0.25 * measured["weights"], measured
