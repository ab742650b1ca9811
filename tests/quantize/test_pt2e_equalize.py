"""Cross-layer equalization on the pt2e path: conv pairs (through a BatchNorm, ReLU, PReLU, pooling)
rescaled on a copy before capture, the float function kept, only the pairs' weights and biases moved,
the pair's per-channel ranges equal after, ReLU6 left alone, recorded in the file's provenance."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn

from quantship import Quantizer, export_qdq
from quantship.cli.main import main
from quantship.errors import SpecRefused
from quantship.quantize import equalize as eq


class Net(nn.Module):
    """c1 -> bn -> relu -> maxpool -> c2 -> prelu -> c3 (grouped) -> relu6 -> c4 -> mean -> fc; c1's output
    channels have ranges 100x apart, so the pairs have something to balance."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.bn, self.relu, self.pool = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)
        self.c2, self.prelu = nn.Conv2d(8, 8, 3, padding=1), nn.PReLU(8)
        self.c3, self.relu6 = nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ReLU6()
        self.c4, self.fc = nn.Conv2d(8, 6, 1), nn.Linear(6, 4)
        with torch.no_grad():
            self.c1.weight.mul_(torch.logspace(-1, 1, 8).reshape(-1, 1, 1, 1))
            self.bn.running_mean.normal_(0, 0.1)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.normal_(0, 0.1)
            self.prelu.weight.uniform_(0.05, 0.3)

    def forward(self, x):
        h = self.c2(self.pool(self.relu(self.bn(self.c1(x)))))
        h = self.relu6(self.c3(self.prelu(h)))
        return self.fc(self.c4(h).mean((2, 3)))


def _batches(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 3, 16, 16, generator=g) for _ in range(n)]


def test_the_float_function_is_kept_and_only_the_pairs_move():
    model = Net().eval()
    original = copy.deepcopy(model.state_dict())
    equalized, record = eq.equalize(model, _batches(1))
    assert set(record.pairs) == {"c1", "c2"} and record.pairs["c1"] == "c1 -> bn -> relu -> max_pool2d -> c2"
    assert "hardtanh" in record.skipped["c3"]  # ReLU6 is not homogeneous
    assert record.pairs_changed == 2 and record.sweeps > 1
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in original.items())  # the caller's model
    moved = {k for k, v in equalized.state_dict().items() if not torch.equal(v, original[k])}
    # c1 itself is untouched (its BatchNorm carries the division); c2 is second of one pair, first of the next
    assert moved == {"bn.weight", "bn.bias", "c2.weight", "c2.bias", "c3.weight"}
    x = torch.randn(32, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before, after = model(x), equalized(x)
    assert (before - after).abs().max() <= 1e-5 * before.abs().max()
    assert 0 < record.max_abs_diff <= 1e-5 * float(before.abs().max()) * 10


def test_the_pair_s_channel_ranges_agree_after():
    model = Net().eval()
    equalized, _ = eq.equalize(model, _batches(1))
    pairs, _ = eq.find_pairs(equalized, _batches(1)[0])
    r1, r2 = eq.channel_ranges(model, pairs[0])
    assert pairs[0].first == "c1" and np.abs(np.log(r1 / r2)).max() > 1.0  # far apart before (c1's 100x spread)
    for pair in pairs:
        r1, r2 = eq.channel_ranges(equalized, pair)
        np.testing.assert_allclose(r1, r2, rtol=1e-2)  # the sweep stops when every scale is within 1e-3


def test_a_conv_read_twice_is_skipped():
    class TwoReaders(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(h) + self.c(h)

    model = TwoReaders().eval()
    equalized, record = eq.equalize(model, _batches(1))
    assert record.pairs == {} and "more than one reader" in record.skipped["a"]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in equalized.state_dict().items())


def test_equalize_needs_pt2e_static_and_a_bool():
    with pytest.raises(SpecRefused, match="equalize needs backend='pt2e'"):
        Quantizer(backend="torchao", method="int8_weight_only", equalize=True)
    with pytest.raises(TypeError, match="True or False"):
        Quantizer(backend="pt2e", equalize="yes")


def test_the_exported_file_carries_the_equalization(tmp_path):
    model = Net().eval()
    q = Quantizer(backend="pt2e", equalize=True)
    quantized = q.quantize(model, _batches(2), max_calibration_samples=16)
    assert q.algorithms["equalize"]["pairs_changed"] == 2
    path = export_qdq(quantized, _batches(1)[0], tmp_path / "equalized.onnx")
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert meta["quantship.algorithms"].startswith("equalize: pairs_changed 2, sweeps ")


NET = """from tests.quantize.test_pt2e_equalize import Net
def build():
    return Net()
"""


def test_quantize_cli_equalize_end_to_end(tmp_path):
    (tmp_path / "net.py").write_text(NET)
    np.save(tmp_path / "cal.npy", torch.cat(_batches(2)).numpy())
    out = tmp_path / "m.onnx"
    assert main(["quantize", f"{tmp_path / 'net.py'}:build", "--calib", str(tmp_path / "cal.npy"), "--quiet",
                 "--out", str(out), "--equalize"]) == 0
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert meta["quantship.algorithms"].startswith("equalize: pairs_changed 2")


def test_sensitivity_refuses_equalize_in_one_line(tmp_path, capsys):
    (tmp_path / "net.py").write_text(NET)
    np.save(tmp_path / "cal.npy", torch.cat(_batches(1)).numpy())
    code = main(["sensitivity", f"{tmp_path / 'net.py'}:build", "--calib", str(tmp_path / "cal.npy"),
                 "--out-dir", str(tmp_path / "report"), "--equalize"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--equalize" in err[0] and not (tmp_path / "report").exists()


def test_the_per_layer_report_of_an_equalized_step_compares_against_the_model_it_captured():
    """The fidelity repair ranks layers by their own loss, comparing the quantized model's inner activations
    with the float model's. An equalized step's inner activations are rescaled per channel: compared with the
    caller's model every pair's inner layer looked like a collapse and the ranking named the wrong layers (an
    untrained MNASNet: the repair's 17 candidates were each block's first conv, and keeping all of them float
    still missed the budget). ``Quantizer.prepared_float`` gives the float model as that step captured it."""
    from quantship.quantize.layer_error import layer_error

    model, batches = Net().eval(), _batches(2)
    quantizer = Quantizer.for_target("onnxruntime-cpu", equalize=True)
    qmodel = quantizer.quantize(model, batches)
    reference = quantizer.prepared_float(model, batches)
    assert reference is not model and quantizer.prepared_float(model, batches).state_dict().keys() == model.state_dict().keys()
    against_caller = {r.module: r.sqnr_db for r in layer_error(model, qmodel, batches).rows}
    against_captured = {r.module: r.sqnr_db for r in layer_error(reference, qmodel, batches).rows}
    assert against_captured["c1"] > 25 > against_caller["c1"] + 10  # the rescaled pair: garbage before
    assert abs(against_captured["fc"] - against_caller["fc"]) < 1.0  # the output: the same function either way
    plain = Quantizer.for_target("onnxruntime-cpu")
    assert plain.prepared_float(model, batches) is model  # nothing asked: the caller's model itself
