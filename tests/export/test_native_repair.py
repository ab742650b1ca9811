"""A file that keeps the fidelity budget read in ONNX Runtime literally (how each repair step is read) but not in
its target's own runtime (TiGrIS's host runtime here) is repaired again, each step judged in that runtime, instead
of refused (``repair_loop.native_repair``). PP-OCRv4's detector on the PyTorch path: 15.7 dB read literally,
9.7 dB in TiGrIS, refused with the repair never tried there."""

from __future__ import annotations

import pytest
import torch

from quantship import Budget, Quantizer
from quantship.errors import FidelityMissed
from quantship.export import quantize_export_judged
from quantship.export.judged import judge_file
from quantship.targets import get


class ResidualNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.c = torch.nn.Conv2d(8, 4, 3, padding=1)
        with torch.no_grad():
            for conv in (self.a, self.b, self.c):
                conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * 0.3)
                conv.bias.copy_(torch.randn(conv.bias.shape, generator=g) * 0.1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        return self.c(torch.relu(y + self.b(y)))


def test_a_file_missed_in_its_runtime_is_repaired_again_judged_there(tmp_path):
    target = get("tigris")
    g = torch.Generator().manual_seed(3)
    data = torch.randn(16, 3, 12, 12, generator=g)
    batches, held, model = [data[:8], data[8:13]], [data[13:]], ResidualNet().eval()

    def run(budget, out, log=lambda _: None):
        return quantize_export_judged(model, batches, data[:1], tmp_path / out, target=target, overrides={},
                                      held=held, held_label="held", budget=budget,
                                      make_quantizer=Quantizer.for_target, log=log)

    plain = run(None, "plain.onnx")  # measured, not judged: the file as asked, read both ways
    literal = judge_file(plain.path, model, held, target, None, "held").sqnr_db
    native = judge_file(plain.path, model, held, target, None, "held", native=True).sqnr_db
    if literal - native < 0.02:
        pytest.skip(f"the two readings of this file are within 0.02 dB here ({literal:.3f} / {native:.3f} dB): no "
                    "budget keeps one and misses the other")
    budget = Budget(min_sqnr_db=(literal + native) / 2, min_agreement=0.0)
    said: list[str] = []
    try:
        judged = run(budget, "judged.onnx", said.append)
    except FidelityMissed:
        judged = None  # no step keeps it in TiGrIS either: refused, after trying there
        assert not (tmp_path / "judged.onnx").exists()
    assert any("repairing again, each step judged in the target's own runtime" in s for s in said), said
    steps = [s for s in said if s.startswith("fidelity: step 0")]
    assert len(steps) == 2  # step 0 read literally, then again in TiGrIS
    if judged is not None:
        assert "TiGrIS" in judged.fidelity.runtime and judged.fidelity.sqnr_db >= budget.min_sqnr_db


def test_the_onnx_path_repairs_again_in_the_runtime_too(tmp_path):
    """The same on ``quantize_onnx``: the float file read literally by each step, then by TiGrIS."""
    import numpy as np

    from quantship.quantize_onnx.quantizer import fidelity_in_runtime, quantize_onnx_file
    from quantship.quantize_onnx.repair import quantize_onnx

    g = torch.Generator().manual_seed(3)
    data = torch.randn(16, 3, 12, 12, generator=g)
    torch.onnx.export(ResidualNet().eval(), (data[:1],), tmp_path / "float.onnx", dynamo=True,
                      dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    cal, held = data[:13].numpy(), data[13:].numpy().astype(np.float32)
    plain = quantize_onnx_file(tmp_path / "float.onnx", tmp_path / "plain.onnx", cal, target="tigris",
                               fidelity_data=held)
    literal = plain.fp32.sqnr_db
    native = fidelity_in_runtime(plain.path, tmp_path / "float.onnx", "tigris", cal, held).sqnr_db
    if literal - native < 0.02:
        pytest.skip(f"the two readings of this file are within 0.02 dB here ({literal:.3f} / {native:.3f} dB): no "
                    "budget keeps one and misses the other")
    said: list[str] = []
    budget = Budget(min_sqnr_db=(literal + native) / 2, min_agreement=0.0)
    try:
        done, _ = quantize_onnx(tmp_path / "float.onnx", tmp_path / "judged.onnx", cal, target="tigris",
                                budget=budget, fidelity_data=held, log=said.append)
    except FidelityMissed:
        done = None
        assert not (tmp_path / "judged.onnx").exists()
    assert any("repairing again, each step judged in the target's own runtime" in s for s in said), said
    if done is not None:
        assert "TiGrIS" in done.fp32.runtime and done.fp32.sqnr_db >= budget.min_sqnr_db
