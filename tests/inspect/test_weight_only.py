"""Weight-only files read and judged: quantship's own (int4 / int8, DequantizeLinear and MatMulNBits forms) and
the ones ONNX Runtime's ``MatMulNBitsQuantizer`` writes (MatMulNBits, blocked DequantizeLinear,
GatherBlockQuantized), each named with its format, bits and groups, its float weights counted, and run in
both of ONNX Runtime's readings."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from onnx import TensorProto, helper, numpy_helper

from quantship import Quantizer, export_qdq
from quantship.inspect.judge.check import check_file
from quantship.inspect.read.graph import inspect_file
from quantship.inspect.run.weight_only import WEIGHT_ONLY_RTOL

warnings.filterwarnings("ignore")
VOCAB, WIDTH, HIDDEN = 64, 64, 96


class TokenMLP(nn.Module):
    """An embedding table (left float by torchao's Linear-only configs) and two Linear layers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.embed(ids))))


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """(method, form) -> a file quantship wrote for TokenMLP."""
    torch.manual_seed(0)
    model = TokenMLP().eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    folder = tmp_path_factory.mktemp("weight_only")
    files = {}
    for method, kwargs in (("int4", dict(method="int4_weight_only", group_size=32)),
                           ("int8", dict(method="int8_weight_only"))):
        q = Quantizer("torchao", **kwargs).quantize(model)
        files[method, "standard"] = export_qdq(q, ids, folder / f"{method}.onnx")
        files[method, "nbits"] = export_qdq(q, ids, folder / f"{method}_nbits.onnx", target="onnxruntime-cpu")
    return files


@pytest.mark.parametrize("method, form, description, kind", [
    ("int4", "standard", "weight-only int4, DequantizeLinear, group 32", "MatMul"),
    ("int4", "nbits", "weight-only int4, MatMulNBits, group 32", "MatMul"),
    ("int8", "standard", "weight-only int8, DequantizeLinear, per channel", "MatMul"),
    # one scale per row, written as blocks of the next power of two >= K (64, 96 -> 128) that repeat it
    ("int8", "nbits", "weight-only int8, MatMulNBits, groups 64/128", "MatMul"),
])
def test_our_files_are_read_as_weight_only(ours, method, form, description, kind):
    report = inspect_file(ours[method, form])
    low_bit = report.weight_only
    assert report.format == "weight-only" and low_bit["description"] == description
    assert low_bit["quantized"] == {kind: 2} and low_bit["bits"] == [int(method[-1])]
    assert low_bit["float"] == {"Gather": 1} and low_bit["float_weights"][0]["tensor"] == "embed.weight"
    assert report.float_tensors == [] and report.float_ops == {}  # float activations are the design, not leftovers
    assert low_bit["accuracy_levels"] == ({"0": 2} if form == "nbits" else {})


def test_check_never_says_no_quantization_and_runs_both_readings(ours):
    for path in ours.values():
        report = check_file(path, "onnxruntime-cpu", run=True, n_inputs=4)
        assert report.format == "weight-only" and report.verdict == "accepted", report.summary()
        # nothing to say: no "no quantization", no float-activation or 7-bit-weight remark (no u8s8 kernel reads it)
        assert report.findings == [], [f.rule for f in report.findings]
        (run,) = report.runs
        assert set(run.readings) == {"default", "exact"} and run.readings["exact"] < WEIGHT_ONLY_RTOL
        assert run.as_dict()["readings"] == run.readings  # the JSON report carries both figures
    # int4 DequantizeLinear form: ONNX Runtime's default session fuses it into MatMulNBits with int8
    # activations; the exact reading (session.qdq_matmulnbits_accuracy_level=0) keeps them float
    run = check_file(ours["int4", "standard"], "onnxruntime-cpu", run=True, n_inputs=4).runs[0]
    print(f"int4 DequantizeLinear form vs literal: default {run.readings['default']:.1e}, "
          f"exact {run.readings['exact']:.1e}")
    assert run.readings["default"] > 100 * run.readings["exact"]
    assert "session.qdq_matmulnbits_accuracy_level=0" in str(run)
    nbits = check_file(ours["int4", "nbits"], "onnxruntime-cpu", run=True, n_inputs=4).runs[0]
    assert nbits.readings["default"] == pytest.approx(nbits.readings["exact"])  # no accuracy_level: float in both


def test_integer_only_targets_refuse_float_activations_in_their_words(ours):
    report = check_file(ours["int8", "standard"], "tigris")
    finding = next(f for f in report.findings if f.rule == "fully_quantized")
    assert report.verdict == "refused" and "quantizes weights only" in finding.message
    nbits = check_file(ours["int4", "nbits"], "tensorrt")
    assert {f.rule for f in nbits.errors} >= {"op_domains", "fully_quantized"}


def _float_token_model(path) -> None:
    """ids -> Gather(table) -> MatMul -> Relu -> MatMul: the float graph ONNX Runtime's quantizer starts from."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("table", (VOCAB, WIDTH)), ("w1", (WIDTH, HIDDEN)), ("w2", (HIDDEN, WIDTH)))]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["x"], name="embed"),
             helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")]
    graph = helper.make_graph(nodes, "token_mlp", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, WIDTH])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.parametrize("kwargs, description, quantized, floats, levels", [
    (dict(), "weight-only int4, MatMulNBits, group 32", {"MatMul": 2}, {"Gather": 1}, {"0": 2}),
    (dict(bits=8, accuracy_level=4), "weight-only int8, MatMulNBits, group 32", {"MatMul": 2}, {"Gather": 1}, {"4": 2}),
    (dict(quant_format="QDQ"), "weight-only int4, DequantizeLinear, group 32", {"MatMul": 2}, {"Gather": 1}, {}),
    (dict(op_types_to_quantize=("MatMul", "Gather")), "weight-only int4, GatherBlockQuantized + MatMulNBits, group 32",
     {"Gather": 1, "MatMul": 2}, {}, {"0": 2}),
])
def test_files_onnxruntimes_quantizer_writes(tmp_path, kwargs, description, quantized, floats, levels):
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    source, path = tmp_path / "fp32.onnx", tmp_path / "w.onnx"
    _float_token_model(source)
    if kwargs.get("quant_format") == "QDQ":
        kwargs = {**kwargs, "quant_format": QuantFormat.QDQ}
    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), block_size=32, **kwargs)
    quantizer.process()
    quantizer.model.save_model_to_file(str(path))

    low_bit = inspect_file(path).weight_only
    assert low_bit["description"] == description and low_bit["quantized"] == quantized
    assert low_bit["float"] == floats and low_bit["accuracy_levels"] == levels
    report = check_file(path, "onnxruntime-cpu", run=True, n_inputs=4)
    assert report.verdict == "accepted" and not any(f.rule == "quantized" for f in report.findings), report.summary()
    assert report.as_dict()["weight_only"]["description"] == description
    if levels.get("4"):  # int8 activations written into the file: every reading quantizes them, and says so
        assert "carry accuracy_level 4" in report.runs[0].detail


def test_openvino_run_measures_its_two_readings(ours):
    """OpenVINO's CPU plugin quantizes a compressed weight's activations to int8 at run time unless
    DYNAMIC_QUANTIZATION_GROUP_SIZE is 0: both readings measured, the exact one judged."""
    pytest.importorskip("openvino")
    report = check_file(ours["int4", "standard"], "openvino", run=True, n_inputs=2)
    (run,) = report.runs
    print(f"OpenVINO, int4 DequantizeLinear form vs ONNX Runtime literal: default {run.readings['default']:.1e}, "
          f"exact {run.readings['exact']:.1e}")
    assert report.verdict == "accepted" and run.readings["exact"] < WEIGHT_ONLY_RTOL
    assert run.readings["default"] > 100 * run.readings["exact"]
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE=0" in run.detail
