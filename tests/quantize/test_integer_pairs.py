"""For a target that runs float ops between integer ones, the PyTorch path writes a Q/DQ pair only where an
integer kernel reads or writes it (the ONNX path's ``integer`` placement): data movement (a MaxPool) moves
integers only when an integer kernel reads its output, an Add runs on integers only when both its inputs
already carry pairs and an integer kernel reads its result, and a float op (a hard swish, a mean) neither reads
nor writes a pair of its own. A target that needs a fully integer graph keeps every pair."""

from __future__ import annotations

import onnx
import torch
import torch.nn as nn

from quantship import Quantizer, export_qdq


class Mixed(nn.Module):
    """Two paths: conv -> relu -> maxpool -> conv (+ the pooled value: a residual Add) -> conv, integer
    throughout; and conv -> hard swish -> maxpool -> mean -> linear, whose pool and mean only float ops read."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.d, self.fc = nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, 4)

    def forward(self, x):
        p = nn.functional.max_pool2d(torch.relu(self.a(x)), 2)
        y = self.c(self.b(p) + p)
        q = nn.functional.max_pool2d(nn.functional.hardswish(self.d(y)), 2)
        return self.fc(q.mean(dim=(2, 3)))


def _file(target: str, tmp_path):
    x = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    qmodel = Quantizer.for_target(target).quantize(Mixed().eval(), calibration_dl=[x[:8], x[8:]])
    return onnx.load(str(export_qdq(qmodel, x[:2], tmp_path / f"{target}.onnx", target=target)))


def _reads_dq(model: onnx.ModelProto, op_type: str) -> list[bool]:
    """For each node of ``op_type`` in order: does its first input come through a DequantizeLinear?"""
    producer = {o: n for n in model.graph.node for o in n.output}
    return [n.input[0] in producer and producer[n.input[0]].op_type == "DequantizeLinear"
            for n in model.graph.node if n.op_type == op_type]


def _quantized_outputs(model: onnx.ModelProto, op_type: str) -> list[bool]:
    """For each node of ``op_type`` in order: does a QuantizeLinear read its output?"""
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n.op_type)
    return [any(r == "QuantizeLinear" for r in readers.get(n.output[0], ())) for n in model.graph.node
            if n.op_type == op_type]


def test_pairs_only_where_an_integer_kernel_reads_them_for_onnx_runtime(tmp_path):
    model = _file("onnxruntime-cpu", tmp_path)
    # the first pool feeds a conv and the residual Add: integer; the second feeds a mean: float, and so is what
    # the hard swish wrote (no pair between two float ops)
    assert _reads_dq(model, "MaxPool") == [True, False]
    assert _quantized_outputs(model, "MaxPool") == [True, False]
    assert _quantized_outputs(model, "HardSwish") == [False]
    assert _reads_dq(model, "ReduceMean") == [False] and _quantized_outputs(model, "ReduceMean") == [True]
    # the residual Add reads two quantized values and a conv reads its result: an integer Add
    assert _reads_dq(model, "Add") == [True] and _quantized_outputs(model, "Add") == [True]
    assert all(_reads_dq(model, "Conv")), "every conv still reads its input quantized"


def test_a_fully_integer_target_keeps_every_pair(tmp_path):
    model = _file("tensorrt", tmp_path)
    assert _reads_dq(model, "MaxPool") == [True, True]
    assert _quantized_outputs(model, "HardSwish") == [True]
    assert _reads_dq(model, "ReduceMean") == [True]


class AffineAfterAFloatOp(nn.Module):
    """PP-LCNetV3's pattern: conv -> hard swish -> learnable affine ``x * a + b`` -> conv; and a squeeze-excitation
    whose input the mean also reads: ``y * sigmoid-gate(mean(y))`` -> conv."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.gate = nn.Conv2d(8, 8, 1)
        self.scale, self.shift = nn.Parameter(torch.tensor(1.3)), nn.Parameter(torch.tensor(0.2))

    def forward(self, x):
        y = nn.functional.hardswish(self.a(x)) * self.scale + self.shift
        y = nn.functional.hardswish(self.b(y))
        gate = nn.functional.hardsigmoid(self.gate(y.mean(dim=(2, 3), keepdim=True)))
        return self.c(y * gate)


def test_an_integer_op_gets_its_float_input_paired_unless_another_float_reader_pays_for_it(tmp_path):
    x = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(AffineAfterAFloatOp().eval(), calibration_dl=[x])
    model = onnx.load(str(export_qdq(qmodel, x[:2], tmp_path / "q.onnx", target="onnxruntime-cpu")))
    # the affine pair runs on integers: the first hard swish's output gets a pair (the conv reads the Add's
    # result quantized anyway), the Mul and the Add read and write quantized values
    assert _quantized_outputs(model, "HardSwish") == [True, False]
    assert _reads_dq(model, "Mul")[0] and _quantized_outputs(model, "Mul")[0]
    assert _reads_dq(model, "Add") == [True] and _quantized_outputs(model, "Add") == [True]
    # the second hard swish's output is also read by the mean: no pair for the gating Mul's sake, it is float
    assert _reads_dq(model, "Mul")[-1] is False
