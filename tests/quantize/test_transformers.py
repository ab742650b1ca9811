"""Transformers through the onnxruntime-cpu preset: fully INT8 files, close to torch, fused by ORT.

Each model is quantized and exported once (module fixture) with ``target='onnxruntime-cpu'``, so
the export itself proves the preset's own target check and the reduce_range post-condition.
Untrained models: their zero-initialised heads and tiny layer scales are re-drawn so that the
outputs vary and an LSB comparison means something.
"""

from __future__ import annotations

import onnx
import pytest
import torch
import torch.nn as nn

from quantship import Quantizer
from quantship.export.qdq import export_qdq
from quantship.inspect.run.consumers import ort_optimized_ops
from quantship.inspect.run.verify import compare_logits

COMPUTE_OPS = {"Conv", "Gemm", "MatMul"}
LSB_LITERAL = 4  # ORT with optimizations off vs the torch quantized model (rounding ties amplified by depth)


def compute_inputs(path) -> dict[str, list[str]]:
    """For every Conv/Gemm/MatMul of the file, the op types that produce its first two inputs."""
    model = onnx.load(str(path), load_external_data=False)
    producer = {out: node.op_type for node in model.graph.node for out in node.output}
    return {n.name: [producer.get(i, "initializer/input") for i in n.input[:2]]
            for n in model.graph.node if n.op_type in COMPUTE_OPS}


def _build(name: str):
    """(model, calibration batches, sample) for one of the models under test."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "bert":
        from transformers import BertConfig, BertModel

        config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=128, max_position_embeddings=32)

        class Encoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.bert = BertModel(config, add_pooling_layer=False)

            def forward(self, input_ids):
                return self.bert(input_ids=input_ids).last_hidden_state

        def ids():
            return torch.randint(0, 128, (2, 16), generator=g)

        return Encoder().eval(), [ids() for _ in range(2)], ids()
    if name == "vit":
        from torchvision.models.vision_transformer import VisionTransformer

        model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64,
                                  mlp_dim=128, num_classes=10)
        nn.init.normal_(model.heads.head.weight, std=0.5)  # zero at init: every logit would be 0
        size = 32
    else:
        # torchvision's ConvNeXt at ConvNeXt-T's widths with 1 block per stage, and its Swin at a third of
        # Swin-T's width with two stages of 2 blocks: every block kind of the full models, at a fraction of
        # their export time (the full models are bench/zoo.py's). At 32 px the first stage's 8x8 map is
        # padded to two 7x7 windows and its second block shifts them (the attention mask); the second
        # stage's 4x4 map is one window, no shift, as in Swin-T's last stages
        from torchvision.models.convnext import CNBlockConfig, ConvNeXt
        from torchvision.models.swin_transformer import SwinTransformer

        if name == "convnext":
            model = ConvNeXt([CNBlockConfig(96, 192, 1), CNBlockConfig(192, 384, 1), CNBlockConfig(384, 768, 1),
                              CNBlockConfig(768, None, 1)])
        elif name == "swin_v2":
            # two Swin V2 blocks (cosine attention, position-bias MLP on a constant table, post-norm) at 16 px
            # with 3x3 windows: a 4x4 map padded to 6x6, a V2 merge, a 2x2 map padded to one window. Keys of
            # padding tokens are 0: F.normalize divides by its eps clamp. (Shifted, masked windows: swin_v2_t
            # in bench/zoo.py; a third block doubles this test's export time.)
            from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformerBlockV2

            model = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                    window_size=[3, 3], block=SwinTransformerBlockV2,
                                    downsample_layer=PatchMergingV2, num_classes=10)
            nn.init.normal_(model.head.weight, std=0.5)
        else:
            model = SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[1, 2],
                                    window_size=[7, 7])
        for p_name, p in model.named_parameters():
            if p_name.endswith("layer_scale"):  # ConvNeXt starts them at 1e-6: blocks would not count
                nn.init.constant_(p, 0.1)
        size = 16 if name == "swin_v2" else 32
    return (model.eval(), [torch.randn(1, 3, size, size, generator=g) for _ in range(2)],
            torch.randn(1, 3, size, size, generator=g))


@pytest.fixture(scope="module")
def exported(request, tmp_path_factory):
    """name -> (quantizer, quantized model, sample, file), each built once on first use."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            model, calib, sample = _build(name)
            quantizer = Quantizer.for_target("onnxruntime-cpu", act_observer="minmax")
            q = quantizer.quantize(model, calib)
            path = export_qdq(q, sample, tmp_path_factory.mktemp(name) / f"{name}.onnx", target="onnxruntime-cpu")
            cache[name] = (quantizer, q, sample, path)
        return cache[name]

    return get


def _check_model(exported, name: str, n_compute: int) -> None:
    quantizer, q, sample, path = exported(name)
    inputs = compute_inputs(path)
    assert len(inputs) == n_compute
    float_fed = {k: v for k, v in inputs.items() if v != ["DequantizeLinear", "DequantizeLinear"]}
    # integer everywhere but the convs the target's float rules keep float (the ONNX path keeps the same ones):
    # their weight stays a float initializer, one per rule the annotator recorded
    assert len(float_fed) == len(quantizer.report.kept_float)
    assert all(v[1] == "initializer/input" for v in float_fed.values()), float_fed
    assert quantizer.report.float_ops == []
    err = compare_logits(q, path, sample)
    assert err.max_lsb <= LSB_LITERAL, str(err)
    with torch.no_grad():
        out = q(sample)
    assert float(out.std()) > 0, "the output is constant: the LSB comparison would be vacuous"


def test_vit_fully_int8(exported):
    # patch conv + 4 linears per layer (in-projection, out-projection, 2 MLP) x 2 + head,
    # and 2 attention matmuls per layer
    _check_model(exported, "vit", 1 + 9 + 4)
    census = ort_optimized_ops(exported("vit")[3])
    assert (census["QLinearConv"], census["QGemm"], census["QLinearMatMul"]) == (1, 9, 4)


def test_bert_fully_int8(exported):
    # 6 linears per layer (q, k, v, attention output, intermediate, output) x 2, 2 matmuls per layer
    _check_model(exported, "bert", 12 + 4)
    census = ort_optimized_ops(exported("bert")[3])
    assert (census["QGemm"], census["QLinearMatMul"]) == (12, 4)


@pytest.mark.slow
def test_convnext_fully_int8(exported):
    _check_model(exported, "convnext", 17)  # 8 conv (stem, 4 depthwise, 3 downsample) + 8 block linears + head


@pytest.mark.slow
def test_swin_fully_int8(exported):
    _check_model(exported, "swin", 27)  # patch conv, 18 linears (4 x 4 blocks, 1 merge, head) + 8 attention matmuls


@pytest.mark.slow
def test_swin_v2_fully_int8(exported):
    # patch conv, 4 linears x 2 blocks, 1 merge, head; 2 attention matmuls x 2 blocks. The position-bias
    # MLPs compute on constants only: folded into the stored bias each attention adds, no Gemm left
    quantizer, q, sample, path = exported("swin_v2")
    inputs = compute_inputs(path)
    assert len(inputs) == 1 + 8 + 1 + 1 + 4
    assert {k: v for k, v in inputs.items() if v != ["DequantizeLinear", "DequantizeLinear"]} == {}
    # F.normalize of q and k (cosine attention): norm, eps clamp and broadcast run in float, unruled
    assert set(quantizer.report.unannotated_ops) == {"aten.linalg_vector_norm.default", "aten.clamp_min.default",
                                                     "aten.expand_as.default"}
    err = compare_logits(q, path, sample)
    assert err.max_lsb <= LSB_LITERAL, str(err)
    with torch.no_grad():
        assert float(q(sample).std()) > 0
    census = ort_optimized_ops(path)
    assert (census["QLinearConv"], census["QGemm"], census["QLinearMatMul"]) == (1, 10, 4)


def test_strict_accepts_vit_blocks():
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=32,
                              mlp_dim=64, num_classes=4).eval()
    quantizer = Quantizer(strict=True, act_observer="minmax")
    quantizer.quantize(model, [torch.randn(2, 3, 16, 16)])
    assert quantizer.report.float_ops == []
    assert quantizer.report.n_weighted == 1 + 4 + 1
