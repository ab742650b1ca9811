"""Placements made for ONNX Runtime's QDQ fusions: Add/Mul constants beside uint8 activations are
stored uint8 (QLinearAdd / QLinearMul), batched-matmul einsums become MatMul (QLinearMatMul).

Each test exports one small hand-built module with the onnxruntime-cpu preset and reads both the
file and the graph ONNX Runtime optimizes from it (real ORT, default optimizations)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from onnx import numpy_helper

from quantship import Quantizer, export_qdq
from quantship.inspect.run.consumers import ort_optimized_ops
from quantship.quantize.decompose import batched_matmul_form


class PositionAdd(nn.Module):
    """ViT's pattern: a learned position embedding added to the patch tokens."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.pos = nn.Parameter(torch.randn(1, 4, 16) * 0.5)
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        return self.head(self.proj(x) + self.pos)


class LayerScale(nn.Module):
    """ConvNeXt's pattern: a per-channel learned scale multiplying the block's output."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.gamma = nn.Parameter(torch.rand(8, 1, 1) + 0.1)
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.out(self.gamma * self.conv(x))


class EinsumAttention(nn.Module):
    """MaxViT's pattern: both attention products written as einsums."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x):  # x: (batch, heads, tokens, 8)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = torch.einsum("b h i d, b h j d -> b h i j", q, k).softmax(dim=-1)
        return self.out(torch.einsum("bhij,bhjd->bhid", scores, v))


class DenseStem(nn.Module):
    """DenseNet's stem: conv -> ReLU -> max-pool, whose output joins a concatenation with a conv
    output that goes negative (so the ReLU's shared scale has a zero-point above the minimum)."""

    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu0 = nn.ReLU()
        self.pool0 = nn.MaxPool2d(2)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(16, 4, 1)

    def forward(self, x):
        y = self.pool0(self.relu0(self.conv0(x)))
        return self.head(torch.cat([y, self.conv1(y)], dim=1))


class ScaledAttention(nn.Module):
    """Fused attention, decomposed before annotation: its 1/sqrt(d) scale is a stored constant."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):  # x: (batch, heads, tokens, 8)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _export(module: nn.Module, shape: tuple, tmp_path, target: str = "onnxruntime-cpu"):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(*shape, generator=gen) for _ in range(2)]
    qmodel = Quantizer.for_target(target, act_observer="minmax").quantize(module.eval(), calib)
    path = export_qdq(qmodel, calib[0], tmp_path / "m.onnx", target=target)
    return path, onnx.load(str(path))


def _constant_dq_of(model: onnx.ModelProto, op_type: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(stored tensor, zero-point) of each DequantizeLinear reading an initializer and feeding ``op_type``."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    found = []
    for node in model.graph.node:
        if node.op_type != op_type:
            continue
        for name in node.input:
            dq = producer.get(name)
            if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in inits:
                found.append((inits[dq.input[0]], inits[dq.input[2]]))
    return found


@pytest.mark.parametrize(("module", "shape", "op", "fused"), [
    (PositionAdd, (2, 4, 16), "Add", "QLinearAdd"),
    (LayerScale, (2, 4, 6, 6), "Mul", "QLinearMul"),
])
def test_binary_constant_is_stored_uint8_and_fused(module, shape, op, fused, tmp_path):
    torch.manual_seed(0)
    path, model = _export(module(), shape, tmp_path)
    (stored, zero_point), = _constant_dq_of(model, op)
    assert stored.dtype == np.uint8 and zero_point.dtype == np.uint8
    assert zero_point.reshape(-1).tolist() == [128]  # the symmetric int8 constant, shifted by 128
    assert np.abs(stored.astype(int) - 128).max() <= 63  # still inside reduce_range's 7 bits
    ops = ort_optimized_ops(path)
    assert ops[fused] == 1 and ops[op] == 0, ops
    assert path.readings.literal_lsb <= 1


def test_attention_scale_is_a_quantized_constant(tmp_path):
    torch.manual_seed(0)
    path, model = _export(ScaledAttention(), (1, 2, 5, 8), tmp_path)
    (stored, zero_point), = _constant_dq_of(model, "Mul")
    assert stored.shape == () and stored.dtype == np.uint8 and zero_point.dtype == np.uint8
    ops = ort_optimized_ops(path)
    assert ops["QLinearMul"] == 1 and ops["Mul"] == 0 and ops["QLinearMatMul"] == 2, ops
    assert path.readings.literal_lsb <= 1


class ScaledProduct(nn.Module):
    """MaxViT's and Swin's attention: the query multiplied by a Python number, then a bias added."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.fc(x) * 0.25 + 1)


def test_number_operands_are_quantized_constants(tmp_path):
    torch.manual_seed(0)
    path, model = _export(ScaledProduct(), (2, 8), tmp_path)
    for op in ("Mul", "Add"):
        (stored, zero_point), = _constant_dq_of(model, op)
        assert stored.shape == () and stored.dtype == np.uint8 and zero_point.dtype == np.uint8
    ops = ort_optimized_ops(path)
    assert ops["QLinearMul"] == ops["QLinearAdd"] == 1 and ops["Mul"] == ops["Add"] == 0, ops
    assert path.readings.literal_lsb <= 1


def test_symmetric_int8_keeps_number_operands_literal(tmp_path):
    # TiGrIS's runtime misreads a stored 0-d Mul/Add operand: symmetric specs keep the literal
    torch.manual_seed(0)
    path, model = _export(ScaledProduct(), (2, 8), tmp_path, target="tigris")
    assert _constant_dq_of(model, "Mul") == [] and _constant_dq_of(model, "Add") == []


class LearnableAffine(nn.Module):
    """PP-OCRv4's learnable affine block: a conv's result times a learned scale of shape [1], plus a bias [1]."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.scale = nn.Parameter(torch.tensor([0.476]))
        self.bias = nn.Parameter(torch.tensor([0.1]))
        self.out = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.out(torch.relu(self.conv(x)) * self.scale + self.bias)


def test_symmetric_int8_keeps_one_value_parameters_float_and_tigris_reads_them(tmp_path):
    """A stored one-value operand is misread by TiGrIS's runtime as a 0-d one is (PP-OCRv4's detector: 67 LSB off
    ONNX Runtime, its output lost); it stays a float initializer, as a number literal does, and TiGrIS runs the file
    as ONNX Runtime does. ONNX Runtime's file keeps it stored uint8 (QLinearMul / QLinearAdd)."""
    from quantship.inspect.judge.check import check_file

    torch.manual_seed(0)
    path, model = _export(LearnableAffine(), (2, 3, 8, 8), tmp_path, target="tigris")
    assert _constant_dq_of(model, "Mul") == [] and _constant_dq_of(model, "Add") == []
    inputs = torch.randn(4, 1, 3, 8, 8, generator=torch.Generator().manual_seed(2)).numpy()
    report = check_file(path, "tigris", run=True, inputs=list(inputs))
    assert report.verdict == "accepted", report.summary()
    (tmp_path / "ort").mkdir()
    _, ort_model = _export(LearnableAffine(), (2, 3, 8, 8), tmp_path / "ort", target="onnxruntime-cpu")
    assert len(_constant_dq_of(ort_model, "Mul")) == 1 and len(_constant_dq_of(ort_model, "Add")) == 1


def test_int8_target_keeps_its_constants_int8(tmp_path):
    torch.manual_seed(0)
    path, model = _export(PositionAdd(), (2, 4, 16), tmp_path, target="tensorrt")
    (stored, zero_point), = _constant_dq_of(model, "Add")
    assert stored.dtype == np.int8 and zero_point.dtype == np.int8


def test_batched_matmul_einsum_runs_as_qlinearmatmul(tmp_path):
    torch.manual_seed(0)
    path, model = _export(EinsumAttention(), (1, 2, 5, 8), tmp_path)
    assert not [n for n in model.graph.node if n.op_type == "Einsum"]
    ops = ort_optimized_ops(path)
    assert ops["QLinearMatMul"] == 2 and ops["Einsum"] == 0 and ops["MatMul"] == 0, ops
    assert path.readings.literal_lsb <= 1


def test_relu_with_shared_scale_is_requantized_so_the_conv_fuses(tmp_path):
    torch.manual_seed(0)
    path, model = _export(DenseStem(), (2, 3, 8, 8), tmp_path)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    (relu,) = [n for n in model.graph.node if n.op_type == "Relu"]
    dq = producer[relu.input[0]]
    q = producer[dq.input[0]]
    assert (dq.op_type, q.op_type, producer[q.input[0]].op_type) == ("DequantizeLinear", "QuantizeLinear", "Conv")
    assert inits[q.input[2]].dtype == np.uint8 and int(inits[q.input[2]]) > 0  # why ORT keeps the Relu
    ops = ort_optimized_ops(path)
    assert ops["QLinearConv"] == 3 and ops["Conv"] == ops["FusedConv"] == 0, ops
    assert path.readings.literal_lsb <= 1


@pytest.mark.parametrize(("equation", "transposed"), [
    ("B G H I D, B G H J D -> B G H I J", True),
    ("bhij,bhjd->bhid", False),
    ("ik,jk->ij", True),
    ("bik,bkj->bji", None),  # output transposed
    ("bij,cjk->bik", None),  # batch labels differ
    ("...ik,...kj->...ij", None),  # ellipsis
    ("bik,bkj,bjl->bil", None),  # three operands
    ("bii,bij->bij", None),  # repeated label
])
def test_batched_matmul_form(equation, transposed):
    assert batched_matmul_form(equation) is transposed
