"""A function of one tensor written out as several arithmetic ops, one a clamp or a division (a hard swish as
``x * clamp(x + 3, 0, 6) / 6``, as a model converted from ONNX has it), is quantized at its output only for a
target that runs float ops between integer ones: its inner values get no Q/DQ pair. Found by the graph's
shape: an inner value that something else reads, or a second tensor in the arithmetic, leaves the ops as
they were; an affine ``x * a + b`` keeps its pairs (tests/export/test_ort_fusion.py: QLinearMul, QLinearAdd).
For ONNX Runtime a written-out hard swish becomes one HardSwish."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

from quantship import Quantizer, export_qdq


class WrittenOut(nn.Module):
    """conv -> hard swish written out -> conv -> hard sigmoid written out gating the features (SE-style)."""

    def __init__(self, leak: bool = False):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.leak = leak

    def forward(self, x):
        y = self.a(x)
        inner = y + 3.0
        y = y * torch.clamp(inner, 0.0, 6.0) / 6.0
        gate = torch.clip(self.b(y) * 0.2 + 0.5, 0.0, 1.0)
        out = y * gate  # two tensors: not a function of one
        return (out, inner) if self.leak else out


def _pairs_inside(path) -> dict[str, int]:
    """For each arithmetic op type, how many of its outputs are quantized (read by a QuantizeLinear)."""
    model = onnx.load(str(path))
    producer = {o: n for n in model.graph.node for o in n.output}
    counts: collections.Counter = collections.Counter()
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] in producer:
            counts[producer[n.input[0]].op_type] += 1
    return dict(counts)


def _quantize(model, target, tmp_path):
    x = torch.randn(16, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    quantizer = Quantizer.for_target(target)
    qmodel = quantizer.quantize(model.eval(), calibration_dl=[x[:8], x[8:]])
    path = export_qdq(qmodel, x[:2], tmp_path / f"{target}.onnx", target=target)
    quantizer.literal_gap = _literal_gap(path, qmodel, x)
    return quantizer, path


def _literal_gap(path, qmodel, x) -> float:
    """The file read literally by ONNX Runtime against the quantized torch model, relative to the output's
    range (the model's output is float, read by no integer kernel: no LSB to count it in)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    rows = x[:first.shape[0]] if isinstance(first.shape[0], int) else x  # a file of a fixed batch: that many
    got = session.run(None, {first.name: rows.numpy()})[0]
    with torch.no_grad():
        out = qmodel(rows)
    want = (out[0] if isinstance(out, tuple) else out).numpy()
    return float(np.abs(got - want).max() / (np.abs(want).max() or 1.0))


def test_a_written_out_function_is_quantized_at_its_output_only(tmp_path):
    """OpenVINO runs float ops between integer ones; it gets the hard swish as written (no one-op rewrite)."""
    quantizer, path = _quantize(WrittenOut(), "openvino", tmp_path)
    functions = quantizer.report.functions
    assert sorted(functions.values()) == [3, 4], functions  # the hard swish (add, clamp, mul, div), the sigmoid's
    pairs = _pairs_inside(path)
    # the hard swish's output, read by the second conv; the gate's exit and the product feed only a float Mul and
    # the model's output, which no integer kernel reads: no pair (``_pairs_where_integer_kernels_read``)
    assert pairs == {"Conv": 2, "Div": 1}, pairs
    assert quantizer.literal_gap < 1e-5  # the file reproduces the quantized model, read literally


def test_for_onnx_runtime_the_hard_swish_is_one_op(tmp_path):
    """ONNX Runtime runs one HardSwish faster than four float ops (``Target.hard_swish_faster_as_one_op``): the
    written-out hard swish becomes ``aten.hardswish`` (PyTorch computes the two alike, bit for bit), quantized
    as the one op; the hard sigmoid's arithmetic is still a function quantized at its output only."""
    model = WrittenOut().eval()
    x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    y = model.a(x)
    assert torch.equal(torch.nn.functional.hardswish(y), y * torch.clamp(y + 3.0, 0.0, 6.0) / 6.0)
    quantizer, path = _quantize(model, "onnxruntime-cpu", tmp_path)
    assert quantizer.report.hard_swishes == 1 and sorted(quantizer.report.functions.values()) == [3]
    ops = collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    assert ops["HardSwish"] == 1 and ops["Div"] == 0, ops
    assert quantizer.literal_gap < 1e-5


def test_a_fully_integer_target_keeps_every_pair(tmp_path):
    """TiGrIS runs no float op: the same model gets a pair on every arithmetic op, no function found."""
    quantizer, path = _quantize(WrittenOut(), "tigris", tmp_path)
    assert quantizer.report.functions == {}
    assert _pairs_inside(path).get("Add", 0) >= 2


def test_an_inner_value_read_elsewhere_is_not_an_inner_value(tmp_path):
    """``inner`` (x + 3) is also an output of the model: the hard swish is not a function of one tensor whose
    inner values nobody sees, so its ops are quantized as before; the gate still is one."""
    quantizer, _ = _quantize(WrittenOut(leak=True), "openvino", tmp_path)
    assert sorted(quantizer.report.functions.values()) == [3], quantizer.report.functions


@pytest.mark.parametrize("target", ["onnxruntime-cpu"])
def test_the_report_records_the_functions(tmp_path, target):
    quantizer, _ = _quantize(WrittenOut(), target, tmp_path)
    assert quantizer.report.as_dict()["functions_of_one_tensor"] == quantizer.report.functions


class IntoAFloatConv(nn.Module):
    """conv -> hard swish written out -> depthwise 5x5 conv (kept float by onnxruntime-cpu's float rules) -> conv."""

    def __init__(self):
        super().__init__()
        self.a, self.dw, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 5, padding=2, groups=8), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.a(x)
        y = y * torch.clamp(y + 3.0, 0.0, 6.0) / 6.0
        return self.b(self.dw(y))


def test_an_output_only_float_convs_read_gets_no_pair(tmp_path):
    """The hard swish's output (one HardSwish for ONNX Runtime) feeds only a conv the target keeps float: no pair
    rounds it (the ONNX path writes none there either); the float conv's own output is quantized for the
    integer conv after it."""
    quantizer, path = _quantize(IntoAFloatConv(), "onnxruntime-cpu", tmp_path)
    report = quantizer.report
    assert len(report.kept_float) == 1 and report.hard_swishes == 1 and len(report.float_outputs) == 1
    pairs = _pairs_inside(path)
    assert pairs == {"Conv": 3}, pairs  # each conv's output (the float one's too), the hard swish's not
    assert path.readings.literal_lsb <= 1.0


class ConvIntoAFloatConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.dw, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 5, padding=2, groups=8), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.b(self.dw(torch.relu(self.a(x))))


def test_an_integer_conv_read_only_by_a_float_conv_keeps_its_output_pair(tmp_path):
    """An integer conv writes its output through its own QuantizeLinear (QLinearConv): without that pair ONNX
    Runtime would run it in float. So a conv's output keeps its pair even when only a float conv reads it."""
    from quantship.inspect.run.consumers import ort_optimized_ops

    quantizer, path = _quantize(ConvIntoAFloatConv(), "onnxruntime-cpu", tmp_path)
    assert len(quantizer.report.kept_float) == 1 and quantizer.report.float_outputs == []
    ops = ort_optimized_ops(path)
    assert ops["QLinearConv"] >= 2 and ops.get("FusedConv", 0) == 0, ops  # the 3x3 conv and its ReLU not in float
