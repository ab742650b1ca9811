"""Hugging Face decoders (GPT-2, Llama with grouped-query attention) as static W8A8 through the onnxruntime-cpu
preset: every Conv/Gemm/MatMul of the file reads two DequantizeLinear, within 4 LSB of the torch model.

Small transformers configs with random weights (graph coverage; perplexity on the trained byte LM is
bench/lm_static.py's). The models return a ``ModelOutput``: a wrapper takes ``.logits`` (what the file
computes). Each model is quantized and exported once (module fixture) with ``target='onnxruntime-cpu'``,
so the export itself proves the preset's target check and the uint8 post-condition that refused Llama's
RoPE table and GPT-2's position embedding when they were quantized at run time.
"""

from __future__ import annotations

import onnx
import pytest
import torch
import torch.nn as nn

from quantship import Quantizer
from quantship.export.qdq import export_qdq
from quantship.inspect.run.verify import compare_logits
from tests.quantize.test_transformers import LSB_LITERAL, compute_inputs

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 64, 12


class Logits(nn.Module):
    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_inner=128, n_positions=32, **common)
        return Logits(transformers.GPT2LMHeadModel(config)).eval()
    family = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[name]
    # grouped-query attention: 4 query heads share 2 key/value heads
    config = family[0](hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=32, **common)
    return Logits(family[1](config)).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (quantizer, quantized model, sample, file), each built once on first use."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            g = torch.Generator().manual_seed(1)
            ids = [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(3)]
            quantizer = Quantizer.for_target("onnxruntime-cpu", act_observer="minmax")
            q = quantizer.quantize(_build(name), ids[:2])
            path = export_qdq(q, ids[2], tmp_path_factory.mktemp(name) / f"{name}.onnx", target="onnxruntime-cpu")
            cache[name] = (quantizer, q, ids[2], path)
        return cache[name]

    return get


def _stored_quantize_inputs(path) -> list[str]:
    """QuantizeLinear nodes that read an initializer (a constant quantized on every run)."""
    model = onnx.load(str(path), load_external_data=False)
    stored = {i.name for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in stored]


def _check(exported, name: str, n_compute: int, float_ops: set[str]) -> None:
    quantizer, q, sample, path = exported(name)
    inputs = compute_inputs(path)
    assert len(inputs) == n_compute
    assert {k: v for k, v in inputs.items() if v != ["DequantizeLinear", "DequantizeLinear"]} == {}
    assert _stored_quantize_inputs(path) == []
    assert set(quantizer.report.unannotated_ops) == float_ops
    err = compare_logits(q, path, sample)
    assert err.max_lsb <= LSB_LITERAL, str(err)
    with torch.no_grad():
        assert float(q(sample).std()) > 0, "the output is constant: the LSB comparison would be vacuous"


def test_gpt2_fully_int8(exported):
    # per layer 4 Conv1D (c_attn, attention c_proj, c_fc, MLP c_proj: addmm products, now per-channel
    # linears) and 2 attention matmuls, x 2 layers; the lm_head. gelu_new's x**3 is unruled: its
    # reader (the 0.044715 product) quantizes it
    _check(exported, "gpt2", 4 * 2 + 2 * 2 + 1, {"aten.pow.Tensor_Scalar"})
    assert exported("gpt2")[0].report.n_weighted == 4 * 2 + 1


@pytest.mark.slow
def test_llama_gqa_fully_int8(exported):
    # per layer q, k, v, o, gate, up, down and 2 attention matmuls, x 2 layers; the lm_head. RMSNorm's
    # float32 cast, square and rsqrt and RoPE's rotate_half negation are unruled (their readers quantize)
    _check(exported, "llama", 7 * 2 + 2 * 2 + 1, {"aten.to.dtype", "aten.pow.Tensor_Scalar",
                                                   "aten.rsqrt.default", "aten.neg.default"})


@pytest.mark.slow
def test_qwen2_gqa_fully_int8(exported):
    # Llama's layout with biases on q, k and v
    _check(exported, "qwen2", 7 * 2 + 2 * 2 + 1, {"aten.to.dtype", "aten.pow.Tensor_Scalar",
                                                   "aten.rsqrt.default", "aten.neg.default"})
