"""The ``quantize`` command's own float model parked in a file while ONNX Runtime's sessions run (issue 40, the
command's peak on large models): the same tensors and values, out of the process's resident memory until read."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import torch

import quantship.heap as heap
from quantship import Budget, Quantizer
from quantship.export import quantize_export_judged
from quantship.export.parked import SMALLEST, park
from quantship.targets import get


def _mapped(tensor: torch.Tensor, parked) -> bool:
    start = parked.storage.data_ptr()
    return start <= tensor.data_ptr() < start + parked.n_bytes


def test_parked_weights_keep_their_objects_and_values_and_ties(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).eval()
    model[2].weight = model[0].weight  # tied: one storage, parked once
    model.register_buffer("table", torch.arange(70_000, dtype=torch.int32))
    x = torch.randn(3, 256)
    with torch.no_grad():
        expected = model(x)
    weight, bias = model[0].weight, model[0].bias
    parked = park(model, tmp_path)
    assert parked is not None and parked.n_tensors == 2  # the tied weight once, the buffer; biases under SMALLEST
    assert bias.numel() * 4 < SMALLEST and not _mapped(bias, parked)
    assert model[0].weight is weight and model[2].weight is weight and isinstance(weight, torch.nn.Parameter)
    assert _mapped(weight, parked) and _mapped(model.table, parked)
    assert parked.path.stat().st_size == parked.n_bytes and parked.n_bytes % 4096 == 0
    for _ in range(2):  # read back from the file after each page-out
        with torch.no_grad():
            assert torch.equal(model(x), expected)
        assert torch.equal(model.table, torch.arange(70_000, dtype=torch.int32))
        parked.page_out()
    with torch.no_grad():
        weight.mul_(2.0)  # a write lands in the file: a page-out loses nothing
    parked.page_out()
    with torch.no_grad():
        assert torch.equal(model[0](x), torch.nn.functional.linear(x, 2 * _original(), model[0].bias))


def _in_file(address: int, maps: str, ending: str) -> bool:
    """Is ``address`` in a mapping of a file whose name ends with ``ending`` (``/proc/self/maps``)?"""
    for line in maps.splitlines():
        if line.endswith(ending):
            start, end = (int(v, 16) for v in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def _original() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(256, 256).weight.detach()


def test_a_model_without_a_large_cpu_tensor_is_left_alone(tmp_path):
    assert park(torch.nn.Linear(4, 4), tmp_path) is None
    assert not (tmp_path / "parked_weights.bin").exists()


class Convs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 96, 3, padding=1)
        self.b = torch.nn.Conv2d(96, 96, 3, padding=1)  # 332 kB of float weights, 83 kB in int8: both parked
        self.fc = torch.nn.Linear(96, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.b(torch.relu(self.a(x)))).mean((2, 3)))


def test_the_judged_command_parks_its_own_model_and_writes_the_same_file(tmp_path, monkeypatch):
    """Every model counted large, ``own_model``: the float model's large weights end mapped from the work folder's
    file (gone with the folder, the mapping kept), its outputs unchanged, the file judged, timed and written; the
    quantized model kept is mapped from its own file and still runs as the written file does."""
    torch.manual_seed(0)
    model = Convs().eval()
    data = torch.rand(40, 3, 16, 16)
    with torch.no_grad():
        expected = model(data[:4])
    monkeypatch.setattr(heap, "LARGE_MODEL_BYTES", 0)
    judged = quantize_export_judged(model, [data[:32]], data[:1], tmp_path / "q.onnx", target=get("onnxruntime-cpu"),
                                    overrides={}, held=[data[32:]], held_label="held", budget=Budget(),
                                    make_quantizer=Quantizer.for_target, own_model=True)
    maps = open("/proc/self/maps").read()
    assert "parked_weights.bin (deleted)" in maps  # the work folder is gone, the mapping the model reads stays
    int8 = [t for t in judged.qmodel.buffers() if t.dtype == torch.int8 and t.numel() >= SMALLEST]
    assert int8 and all(_in_file(t.data_ptr(), maps, "_weights.bin (deleted)") for t in int8)
    assert not any(_in_file(t.data_ptr(), maps, "parked_weights.bin (deleted)") for t in int8)  # its own file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx"]
    with torch.no_grad():
        assert torch.equal(model(data[:4]), expected)
    assert judged.fidelity.status == "met" and judged.speed is not None and judged.speed.not_measured is None
    session = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    literal = session.run(None, {session.get_inputs()[0].name: data[:4].numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(judged.qmodel(data[:4]).numpy(), literal, atol=0.05)


_CHILD = """
import json, sys, torch
from quantship.export.parked import park

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)]).eval()  # 67 MB of float32
x = torch.randn(2, 1024)
with torch.no_grad():
    model(x)
held = rss()
parked = park(model, sys.argv[1])
parked_rss = rss()
with torch.no_grad():
    model(x)
read = rss()
parked.page_out()
print(json.dumps({"held": held, "parked": parked_rss, "read": read, "out": rss(), "bytes": parked.n_bytes}))
"""


def test_parked_weights_leave_the_resident_set_until_read(tmp_path):
    """In a fresh process: parking frees the weights' memory, a forward maps them back, a page-out drops them."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    weights = got["bytes"]
    assert weights > 60e6
    assert got["held"] - got["parked"] > 0.9 * weights, got
    assert got["read"] - got["parked"] > 0.9 * weights, got
    assert got["read"] - got["out"] > 0.9 * weights, got
    assert np.isclose(got["out"], got["parked"], atol=0.05 * weights), got
