"""Weight-only W8A16 / W4A16 to ONNX: the DequantizeLinear form, the MatMulNBits form, and their refusals."""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
from onnx import numpy_helper

from quantship import Quantizer, export_onnx, export_qdq, quant_spec
from quantship.export import artifact, weight_only
from quantship.precision import METADATA_KEY, QuantSpec
from quantship.quantize.torchao_backend import auto_group_size
from tests.linear_models import MLP

warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    return MLP().eval()


@pytest.fixture(scope="module")
def x():
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(1))


def run(path, x, **config: str) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    for key, value in config.items():
        so.add_session_config_entry(key.replace("__", "."), value)
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def torch_out(model, x) -> np.ndarray:
    with torch.no_grad():
        return model(x).numpy()


def ops(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


# (kwargs, weight dtype in the file, block_size attribute or None for per-channel)
CASES = [
    (dict(method="int8_weight_only"), onnx.TensorProto.INT8, None),
    (dict(method="int8_weight_only", qscheme="per_group", group_size=32), onnx.TensorProto.INT8, 32),
    (dict(method="int4_weight_only", group_size=32), onnx.TensorProto.INT4, 32),
]


@pytest.mark.parametrize("kwargs, dtype, block", CASES)
def test_both_forms_match_torch_and_each_other(mlp, x, tmp_path, kwargs, dtype, block):
    q = Quantizer("torchao", **kwargs).quantize(mlp)
    spec = quant_spec(q)
    std = export_qdq(q, x, tmp_path / "std.onnx")
    nbits = export_qdq(q, x, tmp_path / "nbits.onnx", target="onnxruntime-cpu")

    model = onnx.load(str(std))
    assert {o.domain: o.version for o in model.opset_import}[""] == 21
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 2 and ops(std)["Gemm"] == 2  # both Linear layers, still read by their float Gemm
    inits = {i.name: i for i in model.graph.initializer}
    assert all(inits[n.input[0]].data_type == dtype for n in dq)
    assert all({a.name: a.i for a in n.attribute}.get("block_size") == block for n in dq)
    assert not {"fc1.weight", "fc2.weight"} & set(inits)  # the float weights are gone
    props = {p.key: p.value for p in model.metadata_props}
    assert QuantSpec.from_json(props[METADATA_KEY]) == spec
    assert props[weight_only.FORMAT_KEY] == "DequantizeLinear"

    assert ops(nbits)["MatMulNBits"] == 2 and ops(nbits)["Gemm"] == 0
    props = {p.key: p.value for p in onnx.load(str(nbits)).metadata_props}
    assert props[weight_only.FORMAT_KEY] == "MatMulNBits" and props["quantship.target"] == "onnxruntime-cpu"
    assert json.loads(props[METADATA_KEY])["method"] == spec.method
    # every compute node of both forms still names its module (MatMulNBits takes its MatMul's scopes);
    # no node carries the exporting machine's stack trace
    from quantship.export.metadata import SOURCE_NODE_KEYS
    from quantship.inspect.read.float_ops import module_path

    for path, compute in ((std, "Gemm"), (nbits, "MatMulNBits")):
        nodes = onnx.load(str(path)).graph.node
        assert sorted(module_path(n) for n in nodes if n.op_type == compute) == ["fc1", "fc2"]
        assert not any(p.key in SOURCE_NODE_KEYS for n in nodes for p in n.metadata_props)

    ref = torch_out(q, x)
    a, b = run(std, x), run(nbits, x)
    print(f"{spec.label} {kwargs}: standard {weight_only.relative_error(a, ref):.1e}, "
          f"MatMulNBits {weight_only.relative_error(b, ref):.1e} relative to torch")
    assert weight_only.relative_error(a, ref) < 1e-5  # same weights, float MatMul: rounding only
    assert weight_only.relative_error(b, ref) < weight_only.WEIGHT_ONLY_RTOL
    assert weight_only.relative_error(b, a) < weight_only.WEIGHT_ONLY_RTOL
    assert weight_only.relative_error(ref, torch_out(mlp, x)) > 1e-4  # the model really is quantized


def test_file_holds_torchaos_codes_and_scales(mlp, x, tmp_path):
    q = Quantizer("torchao", method="int4_weight_only", group_size=32).quantize(mlp)
    path = export_qdq(q, x, tmp_path / "w4.onnx")
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    for layer in ("fc1", "fc2"):  # 2-D inputs: the exporter keeps the [N, K] weight under its own name
        weight = getattr(q, layer).weight
        codes, scale = inits[f"{layer}.weight_q4"], inits[f"{layer}.weight_scale"]
        assert codes.astype(np.int8).min() >= -8 and codes.astype(np.int8).max() <= 7
        assert np.array_equal(codes.astype(np.int8), weight.qdata.numpy())
        assert np.array_equal(scale, weight.scale.numpy().reshape(scale.shape))


def test_matmul_nbits_packing_round_trips():
    rng = np.random.default_rng(0)
    for bits, group, k in [(4, 32, 64), (8, 32, 64), (8, 96, 96), (4, 16, 48)]:
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        codes = rng.integers(lo, hi + 1, size=(5, k)).astype(np.int8)
        scale = rng.random((5, k // group)).astype(np.float32) + 0.1
        w = weight_only.QuantizedWeight("fc", codes, scale, None, bits, group, np.zeros((5, k), np.float32))
        b, s, zp, block = weight_only.nbits_tensors(w)
        blocks = -(-k // block)
        assert b.shape == (5, blocks, block * bits // 8) and s.shape == (5, blocks) and zp is None
        if bits == 4:
            unpacked = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(5, -1)
        else:
            unpacked = b.reshape(5, -1)
        assert np.array_equal(unpacked[:, :k].astype(np.int16) - (1 << (bits - 1)), codes)
        assert (unpacked[:, k:] == 1 << (bits - 1)).all()  # padding sits at the zero-point
        per_code = np.repeat(s, block, axis=1)[:, :k]
        assert np.array_equal(per_code, np.repeat(scale, group, axis=1))


@pytest.mark.slow
def test_tiny_llama_is_linear_dominated_and_shrinks(tmp_path):
    pytest.importorskip("transformers")
    from quantship.examples.lm import build_model

    torch.manual_seed(0)
    lm = build_model(hidden=128, layers=2, heads=4, intermediate=384)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    fp32 = export_onnx(lm, ids, tmp_path / "fp32.onnx", dynamic_batch=False)
    q = Quantizer("torchao", method="int4_weight_only", group_size=32).quantize(lm)
    std = export_qdq(q, ids, tmp_path / "w4.onnx")
    nbits = export_qdq(q, ids, tmp_path / "w4_ort.onnx", target="onnxruntime-cpu")
    n_linear = sum(isinstance(m, nn.Linear) for m in lm.modules())
    assert ops(std)["DequantizeLinear"] == n_linear == 15 and ops(nbits)["MatMulNBits"] == n_linear
    ref = torch_out(q, ids)
    assert weight_only.relative_error(run(nbits, ids), ref) < weight_only.WEIGHT_ONLY_RTOL
    # ORT fuses the standard form's DequantizeLinear + MatMul into MatMulNBits itself, by default with
    # 8-bit activations (accuracy level 4); with float activations it matches torch like our MatMulNBits
    float_acts = run(std, ids, session__qdq_matmulnbits_accuracy_level="0")
    assert weight_only.relative_error(float_acts, ref) < weight_only.WEIGHT_ONLY_RTOL
    default = weight_only.relative_error(run(std, ids), ref)
    print(f"standard form at ORT defaults (8-bit activations): {default:.1e} relative to torch")
    assert default < 5e-2
    ratio = artifact_size(fp32) / artifact_size(nbits)
    print(f"tiny Llama: FP32 {artifact_size(fp32)} B, W4A16 g32 {artifact_size(std)} B (standard), "
          f"{artifact_size(nbits)} B (MatMulNBits): {ratio:.2f}x")
    assert ratio > 3  # small model: the embedding and the exporter's node metadata weigh more here


def artifact_size(path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def test_external_data_is_written_atomically(mlp, x, tmp_path, monkeypatch):
    monkeypatch.setattr(artifact, "EXTERNAL_DATA_THRESHOLD", 1000)
    q = Quantizer("torchao", method="int8_weight_only").quantize(mlp)
    path = export_qdq(q, x, tmp_path / "big.onnx", target="onnxruntime-cpu")
    names = sorted(p.name for p in tmp_path.iterdir())  # the graph and its uniquely named weights, nothing else
    assert len(names) == 2 and names[0] == "big.onnx" and re.fullmatch(r"big\.onnx\.[0-9a-f]+\.data", names[1])
    assert weight_only.relative_error(run(path, x), torch_out(q, x)) < weight_only.WEIGHT_ONLY_RTOL


def test_refusals_leave_nothing(mlp, x, tmp_path):
    q = Quantizer("torchao", method="int4_weight_only", group_size=8).quantize(mlp)
    with pytest.raises(ValueError, match=r"fc1.*groups of 8.*at least 16"):
        export_qdq(q, x, tmp_path / "a.onnx", target="onnxruntime-cpu")
    with pytest.raises(ValueError, match=r"target='tensorrt'.*'onnxruntime-cpu'"):
        export_qdq(q, x, tmp_path / "b.onnx", target="tensorrt")
    tagged = quant_spec(q)
    from quantship.precision import tag_model

    with pytest.raises(ValueError, match="no torchao-quantized Linear"):
        export_qdq(tag_model(nn.Linear(4, 2), tagged), torch.randn(1, 4), tmp_path / "c.onnx")
    assert list(tmp_path.iterdir()) == []


def test_export_onnx_refuses_a_quantized_model_in_one_line(mlp, x, tmp_path):
    q = Quantizer("torchao", method="int8_weight_only").quantize(mlp)
    with pytest.raises(ValueError) as info:
        export_onnx(q, x, tmp_path / "f.onnx")
    message = str(info.value)
    assert "export_qdq" in message and "\n" not in message and "\x1b" not in message
    assert list(tmp_path.iterdir()) == []


def test_group_size_choice_and_refusal():
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 8))
    assert auto_group_size(model) == 32
    assert auto_group_size(model, ["0", "2"]) == 64
    assert auto_group_size(nn.Sequential(nn.Linear(256, 8))) == 128
    assert auto_group_size(nn.Sequential(nn.Linear(48, 8))) is None
    with pytest.raises(ValueError) as info:
        Quantizer("torchao", method="int4_weight_only").quantize(model)
    message = str(info.value)
    assert "'2': 64" in message and "'4': 96" in message and "'0'" not in message and "group_size=32" in message
    with pytest.raises(ValueError, match="no nn.Linear"):
        Quantizer("torchao", method="int4_weight_only").quantize(nn.Sequential(nn.Conv2d(1, 2, 3)))


def test_backend_chooses_the_group_when_the_spec_leaves_it_open():
    import dataclasses

    from quantship.precision import resolve_spec
    from quantship.quantize import torchao_backend

    spec = dataclasses.replace(resolve_spec("torchao", method="int4_weight_only"), group_size=None)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 8))
    said: list[str] = []
    q = torchao_backend.quantize(model, spec, None, log=said.append)
    assert quant_spec(q).group_size == 32 and any("group_size=32" in s for s in said)
    assert tuple(q[2].weight.block_size) == (1, 32)


@pytest.mark.parametrize("target", [None, "onnxruntime-cpu"])
def test_a_model_output_forward_exports_with_its_field_names(tmp_path, target):
    """A Hugging Face classifier returns a ``ModelOutput``: each field becomes a graph output named after it, as
    on the static path (``named_outputs``), and the file matches torch's ``logits``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=32, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    nn.init.normal_(model.classifier.weight, std=0.5)  # small at init: the logits would hardly vary
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    q = Quantizer("torchao", method="int8_weight_only").quantize(model)
    with torch.no_grad():
        expected = q(ids)
    assert type(expected).__name__ == "SequenceClassifierOutput"
    path = export_qdq(q, ids, tmp_path / "cls.onnx", target=target)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["logits"]
    (logits,) = session.run(None, {session.get_inputs()[0].name: ids.numpy()})
    assert weight_only.relative_error(logits, expected.logits.numpy()) < weight_only.WEIGHT_ONLY_RTOL


def test_accuracy_level_is_written_after_the_level_0_check_and_before_commit_sees_the_float_export(mlp, x, tmp_path):
    from quantship import targets

    q = Quantizer("torchao", method="int8_weight_only").quantize(mlp)
    seen = {}

    def before_commit(staged, float_file):  # the staged file and the float export of the same graph, beside it
        seen["names"] = sorted(p.name for p in staged.parent.iterdir())
        seen["float_ops"] = {n.op_type for n in onnx.load(str(float_file)).graph.node}
        assert not (tmp_path / "w8.onnx").exists()  # not in place yet

    path = weight_only.export_weight_only(q, x, tmp_path / "w8.onnx", quant_spec(q),
                                          target=targets.get("onnxruntime-cpu"), accuracy_level=4,
                                          before_commit=before_commit)
    levels = [{a.name: a.i for a in n.attribute}["accuracy_level"]
              for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits"]
    assert levels == [4, 4] and "MatMulNBits" not in seen["float_ops"] and seen["float_ops"] & {"MatMul", "Gemm"}
    assert seen["names"] == sorted(["w8.onnx", weight_only.FLOAT_REFERENCE])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w8.onnx"]  # the float export left with the scratch
    # int8 activations: measurably off the torch model, within what ONNX Runtime's int8 kernels give
    error = np.abs(run(path, x) - torch_out(q, x)).max() / np.abs(torch_out(q, x)).max()
    assert 2e-4 < error < 5e-2
    with pytest.raises(ValueError, match="accuracy_level=4 is MatMulNBits' attribute"):
        weight_only.export_weight_only(q, x, tmp_path / "std.onnx", quant_spec(q), accuracy_level=4)
    assert not (tmp_path / "std.onnx").exists()
