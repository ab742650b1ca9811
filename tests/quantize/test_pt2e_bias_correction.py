"""Bias correction on the pt2e path: after conversion only biases move (a missing one is added), the
per-channel mean output error shrinks on a model whose weights round with a bias, in torch and in the
exported file read by ONNX Runtime, and the record reaches the file's provenance."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

from quantship import Quantizer, export_qdq
from quantship.cli.main import main
from quantship.errors import SpecRefused
from quantship.quantize import bias_correction

STEP = 0.01  # every weight sits 0.45 of a grid step above a grid point: rounding to nearest moves each down


def _biased(layer: nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        w = layer.weight.view(layer.weight.shape[0], -1)
        grid = torch.randint(-100, 100, w.shape, generator=generator).float() + 0.45
        grid[:, 0] = 127  # the largest weight of each channel sets its scale to exactly STEP
        w.copy_(grid * STEP)


class Net(nn.Module):
    """c1 (no bias) -> relu -> c2 -> bn -> relu -> mean -> fc, inputs positive: the weights' rounding error
    adds up in every output instead of cancelling."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the layers' default initialisation (the biases)
        g = torch.Generator().manual_seed(0)
        self.c1, self.c2, self.bn, self.fc = nn.Conv2d(4, 16, 3, bias=False), nn.Conv2d(16, 8, 1), \
            nn.BatchNorm2d(8), nn.Linear(8, 6)
        for layer in (self.c1, self.c2, self.fc):
            _biased(layer, g)
        with torch.no_grad():
            self.bn.running_mean.uniform_(0, 1, generator=g)
            self.bn.running_var.uniform_(1, 2, generator=g)

    def forward(self, x):
        h = torch.relu(self.bn(self.c2(torch.relu(self.c1(x)))))
        return self.fc(h.mean((2, 3)))


def _batches(n: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(16, 4, 8, 8, generator=g) for _ in range(n)]


def _held_out() -> torch.Tensor:
    return torch.rand(256, 4, 8, 8, generator=torch.Generator().manual_seed(2))


def _quantized(bias_correction: bool, model: nn.Module | None = None):
    q = Quantizer(backend="pt2e", bias_correction=bias_correction)
    return q, q.quantize(model or Net().eval(), _batches())


def _tensors(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(m.named_parameters()), **dict(m.named_buffers())}


def test_only_biases_change_and_a_missing_one_is_added():
    model = Net().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, plain = _quantized(False, model)
    q, corrected = _quantized(True, model)
    record = q.algorithms["bias_correction"]
    assert (record["n_corrected"], record["n_added"], record["n_passes"], record["samples"]) == (3, 1, 3, 64)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the caller's model
    ours, theirs = _tensors(corrected), _tensors(plain)
    added = set(ours) - set(theirs)
    assert added == {"_quantship_corrected_bias_conv2d"} and set(theirs) <= set(ours)
    moved = {k for k in theirs if not torch.equal(ours[k], theirs[k])}
    assert moved == {"c2.bias", "fc.bias"}  # c2's bias holds the folded BatchNorm
    # every q/dq parameter, every integer weight: bit-identical
    for a, b in zip((n for n in plain.graph.nodes if n.op == "call_function"),
                    (n for n in corrected.graph.nodes if n.op == "call_function")):
        assert a.target == b.target and a.args[3:] == b.args[3:]


def test_the_mean_output_error_per_channel_shrinks():
    model = Net().eval()
    x = _held_out()
    with torch.no_grad():
        reference = model(x)
        errors = {bc: (_quantized(bc, model)[1](x) - reference).mean(0).abs().mean().item() for bc in (False, True)}
    # measured: 0.205 plain, 0.0042 corrected (49x); 5x leaves room for observer changes, not for no gain
    assert errors[True] < errors[False] / 5, errors


def test_bias_correction_needs_pt2e_static():
    with pytest.raises(SpecRefused, match="bias_correction needs backend='pt2e'"):
        Quantizer(backend="x86", bias_correction=True)
    with pytest.raises(TypeError, match="True or False"):
        Quantizer(backend="pt2e", bias_correction=1)


def test_the_exported_file_is_corrected_and_says_so(tmp_path):
    model = Net().eval()
    x = _held_out()
    with torch.no_grad():
        reference = model(x).numpy()
    errors = {}
    for bc in (False, True):
        path = export_qdq(_quantized(bc, model)[1], _batches(1)[0], tmp_path / f"bc{bc}.onnx", dynamic_batch=True)
        out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
        errors[bc] = float(np.abs((out - reference).mean(axis=0)).mean())
        meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
        assert ("quantship.algorithms" in meta) == bc
    assert meta["quantship.algorithms"].startswith("bias_correction: n_corrected 3, n_added 1, n_passes 3, samples 64")
    assert errors[True] < errors[False] / 5, errors  # as in torch


NET = """from tests.quantize.test_pt2e_bias_correction import Net
def build():
    return Net()
"""


def test_quantize_cli_equalize_and_bias_correction_end_to_end(tmp_path):
    (tmp_path / "net.py").write_text(NET)
    np.save(tmp_path / "cal.npy", torch.cat(_batches(2)).numpy())
    out = tmp_path / "m.onnx"
    assert main(["quantize", f"{tmp_path / 'net.py'}:build", "--calib", str(tmp_path / "cal.npy"), "--quiet",
                 "--out", str(out), "--equalize", "--bias-correction"]) == 0
    summary = {p.key: p.value for p in onnx.load(str(out)).metadata_props}["quantship.algorithms"]
    assert summary.startswith("equalize: pairs_changed ") and "; bias_correction: n_corrected 3" in summary


def test_the_quantized_graph_is_evaluated_once_in_all(monkeypatch):
    """Each node of the converted graph runs once over the batches (a layer twice: measured, then again with
    its corrected bias); a value dropped after its readers ran is never computed again for a deeper depth."""
    runs: dict[str, int] = {}
    original = bias_correction.Incremental._run

    def counted(self, node):
        runs[node.name] = runs.get(node.name, 0) + 1
        return original(self, node)

    monkeypatch.setattr(bias_correction.Incremental, "_run", counted)
    q, _ = _quantized(True)
    assert q.algorithms["bias_correction"]["n_passes"] == 3
    layers = {"conv2d", "conv2d_1", "linear"}
    assert {name: n for name, n in runs.items() if name in layers} == dict.fromkeys(layers, 2)
    assert {name: n for name, n in runs.items() if name not in layers and n != 1} == {}
    assert "x" in runs  # the input was read (once)
