"""16-bit activations on the PyTorch path (``Quantizer(int16=[...])``, ``quantize --int16``, the fidelity repair).

The ONNX path's 16-bit form, on the PyTorch path: the named modules' activations (read and written) are observed
over their exact range and stored in 16 bits, weights int8; the file is opset 21 and says which values are 16-bit.
The repair tries a ranked module in 16 bits before keeping it float where the runtime computes on 16-bit activations
(``tests.sixteen``); on onnxruntime-cpu, which runs an op between 16-bit pairs in float, it keeps the module float.
``Collapsing`` (a filter bank whose channels span 60 dB, then power and log) loses its output at 8 bits (about
-4 dB SQNR against FP32); its bank in 16 bits keeps it."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from quantship import Budget, Quantizer, export_qdq
from quantship.errors import SpecRefused
from quantship.export import quantize_export_judged
from quantship.export.metadata import INT16_KEY
from quantship.fidelity import sqnr_db
from quantship.inspect.judge.check import check_file
from quantship.inspect.read.facts import read_file
from quantship.targets import get
from tests.quantize_onnx.test_fidelity_repair import Collapsing
from tests.sixteen import INT16_KERNELS

# The elements' minimum agreement (0.9), not the default 0.96 of argmax decisions: this model's class scores are
# near-ties on random inputs (its 16-bit file keeps 40 dB and agrees 0.925), and the test is about which repair
# the loop reaches first, not about where the default budget stops it.
MECHANISM = Budget(min_agreement=0.9)


class ConvLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 8, 3)
        self.b = torch.nn.Conv2d(8, 8, 3)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.b(torch.relu(self.a(x)))).mean((2, 3)))


@pytest.fixture(scope="module")
def data():
    return torch.from_numpy(np.random.default_rng(0).standard_normal((40, 3, 16, 16)).astype(np.float32))


def _props(path) -> dict:
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def _sqnr(reference: np.ndarray, out: np.ndarray) -> float:
    ref, out = reference.astype(np.float64), out.astype(np.float64)
    return sqnr_db(float(np.sum(ref * ref)), float(np.sum((ref - out) ** 2)))


def _run(path, x: np.ndarray, optimized: bool) -> np.ndarray:
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_the_named_module_reads_and_writes_16_bits_and_the_file_says_so(tmp_path, data):
    torch.manual_seed(0)
    q = Quantizer.for_target("onnxruntime-cpu", int16=["b"])
    path = export_qdq(q.quantize(ConvLinear().eval(), [data[:16]]), data[:2], tmp_path / "m.onnx")
    assert q.spec.int16 == ("b",) and q.report.int16_values == ["relu", "relu_1"]  # b's input and its fused ReLU
    model = onnx.load(str(path))
    assert model.opset_import[0].version == 21  # 16-bit zero-points need opset 21
    facts = read_file(path)
    wide = [q.tensor for q in facts.quant.of_role("activation") if q.op_type == "QuantizeLinear" and q.dtype == "uint16"]
    assert wide and _props(path)[INT16_KEY] == ", ".join(wide)
    assert {q.dtype for q in facts.quant.of_role("activation")} == {"uint8", "uint16"}  # the preset's uint8 elsewhere
    assert [q.dtype for q in facts.quant.of_role("weight")] == ["int8", "int8", "int8"]  # b's weight stays int8
    assert check_file(path, "onnxruntime-cpu").ok
    x = data[16:24].numpy()
    assert np.array_equal(_run(path, x, optimized=False), _run(path, x, optimized=True))  # b runs as written


def test_16_bits_where_8_lose_the_signal_bring_it_back_in_both_readings(tmp_path, data):
    model, x = Collapsing().eval(), data[32:].numpy()
    reference = model(data[32:]).detach().numpy()
    got = {}
    for wide in ((), ("front",)):
        q = Quantizer.for_target("onnxruntime-cpu", int16=list(wide) or None)
        path = export_qdq(q.quantize(model, [data[:32]]), data[:2], tmp_path / f"{len(wide)}.onnx")
        got[wide] = [_sqnr(reference, _run(path, x, optimized)) for optimized in (False, True)]
    assert max(got[()]) < 0.0 < 20.0 < min(got[("front",)]), got  # measured: -4.0 dB, then 29.3 dB both ways


def test_the_repair_tries_16_bits_before_float_where_the_runtime_computes_on_them(tmp_path, data):
    said: list[str] = []
    judged = quantize_export_judged(Collapsing().eval(), [data[:32]], data[:1], tmp_path / "r.onnx",
                                    target=INT16_KERNELS, overrides={}, held=[data[32:]], held_label="held",
                                    budget=MECHANISM, make_quantizer=Quantizer.for_target, log=said.append, speed=False)
    chosen = judged.repair.steps[judged.repair.chosen]
    assert judged.repair.steps[0].status == "missed" and chosen.status == "met"
    assert chosen.int16 == ("front",) and chosen.excluded == ()  # 16 bits kept the budget: nothing kept float
    assert _props(judged.path)[INT16_KEY] and json.loads(_props(judged.path)["quantship.repair"])["met"]


def test_on_onnx_runtime_cpu_the_repair_keeps_float_what_16_bits_would_run_in_float(tmp_path, data):
    judged = quantize_export_judged(Collapsing().eval(), [data[:32]], data[:1], tmp_path / "r.onnx",
                                    target=get("onnxruntime-cpu"), overrides={}, held=[data[32:]], held_label="held",
                                    budget=MECHANISM, make_quantizer=Quantizer.for_target, speed=False)
    steps = judged.repair.steps
    assert steps[judged.repair.chosen].excluded == ("front",) and steps[judged.repair.chosen].status == "met"
    assert not any(s.int16 for s in steps) and INT16_KEY not in _props(judged.path)  # no 16-bit step tried


@pytest.mark.parametrize("target", ["tensorrt", "tigris"])
def test_a_target_without_16_bit_activations_refuses_them_in_one_line(target):
    with pytest.raises(SpecRefused, match="does not run int16 activations") as caught:
        Quantizer.for_target(target, int16=["b"])
    assert "\n" not in str(caught.value)


def test_names_that_cover_no_quantized_activation_are_refused(data):
    with pytest.raises(ValueError, match="int16 names \\['nosuch'\\]: neither modules of the model nor ops"):
        Quantizer(backend="pt2e", int16=["nosuch"]).quantize(ConvLinear().eval(), [data[:8]])
    depthwise = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), torch.nn.Conv2d(8, 8, 5, groups=8)).eval()
    with pytest.raises(SpecRefused, match="'1', which reads and writes no quantized activation"):
        Quantizer.for_target("onnxruntime-cpu", int16=["1"]).quantize(depthwise, [data[:8]])  # its float rule
    with pytest.raises(SpecRefused, match="skip_activations keeps it float"):
        Quantizer(backend="pt2e", int16=["b"], skip_activations=["b"])


def test_16_bits_need_static_pt2e():
    with pytest.raises(SpecRefused, match="int16"):
        Quantizer(backend="x86", int16=["b"])
    with pytest.raises(SpecRefused, match="static"):
        Quantizer(backend="pt2e", method="qat", int16=["b"])


def test_a_16_bit_module_the_profile_keeps_float_is_float(tmp_path, data):
    """The placement by profile keeps float the modules whose integer form runs slower; a module the repair put
    in 16 bits is one of them when its float conv beats its 16-bit pairs (measured on the notes example: 8 such
    modules, the file 0.91x FP32 at batch 1 with the placement refused, 1.14x with them float)."""
    judged = quantize_export_judged(Collapsing().eval(), [data[:32]], data[:1], tmp_path / "p.onnx",
                                    target=INT16_KERNELS, overrides={}, held=[data[32:]], held_label="held",
                                    budget=MECHANISM, make_quantizer=Quantizer.for_target)
    profile = judged.profile
    assert judged.repair.steps[judged.repair.chosen].int16 == ("front",)
    if "front" not in profile.as_dict()["candidates"] and "node_conv2d" not in profile.as_dict()["candidates"]:
        pytest.skip(f"this CPU's profile found the 16-bit front no slower than float: {profile.as_dict()}")
    assert profile.not_run is None and profile.as_dict()["verified_ms"], profile.as_dict()
