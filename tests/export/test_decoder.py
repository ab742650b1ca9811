"""Decoder files for generation (export/decoder.py) and their greedy check (export/decoder_check.py).

The trained byte-level Llama (quantship.examples.lm, cached weights) as INT8 (standard DequantizeLinear form)
and INT4 (MatMulNBits, groups of 32): each exported once, then greedy-decoded for 64 tokens on two prompts
of different lengths (left padding through the attention mask) in ONNX Runtime, token for token against
Hugging Face's ``generate`` on the torch weight-only model. GPT-2 and Qwen2 configs with random weights
cover the other attention layouts. onnxruntime-genai, where installed, loads the folder and generates.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
import torch

from quantship import Quantizer, quant_spec, targets
from quantship.errors import DataRefused, ModelRefused
from quantship.export.decoder import (
    GENAI_CONFIG,
    cached_decoder,
    export_decoder,
    layout_of,
    read_layout,
    write_genai_config,
)
from quantship.export.decoder_check import check_greedy, left_padded, onnx_greedy, onnx_session

transformers = pytest.importorskip("transformers")
PROMPTS = [list(b"import os\nimport sys\n\n\ndef main(argv):\n    "), list(b"class Reader:\n    def ")]
NEW_TOKENS = 64


def _quantized(method: str, model=None):
    from quantship.examples import lm

    kwargs = {"group_size": 32} if method == "int4_weight_only" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Quantizer("torchao", method=method, **kwargs).quantize(model or lm.trained_model(), None)


@pytest.fixture(scope="module")
def byte_files(tmp_path_factory):
    """method -> (torch weight-only model, decoder file): INT8 standard form, INT4 MatMulNBits."""
    folder = tmp_path_factory.mktemp("decoders")
    out = {}
    for method, target in (("int8_weight_only", None), ("int4_weight_only", targets.get("onnxruntime-cpu"))):
        model = _quantized(method)
        (folder / method).mkdir()
        path = export_decoder(model, folder / method / "model.onnx", spec=quant_spec(model), target=target)
        out[method] = (model, path)
    return out


@pytest.mark.parametrize("method", ["int8_weight_only", "int4_weight_only"])
def test_greedy_64_tokens_match_torch_with_a_padded_batch(byte_files, method):
    model, path = byte_files[method]
    layout = read_layout(path)
    ids, mask = left_padded(PROMPTS, layout, NEW_TOKENS)
    assert mask[1].sum() < mask[0].sum() and mask[1, 0] == 0  # the second prompt is shorter: left-padded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check = check_greedy(path, model, PROMPTS, NEW_TOKENS)
    assert check.matches, check.as_dict()
    assert len(check.onnx_tokens) == 2 and all(len(t) == NEW_TOKENS for t in check.onnx_tokens)
    assert check.onnx_tokens[0] != check.onnx_tokens[1]  # the rows are decoded apart, not one row twice


def test_layout_names_and_symbolic_axes(byte_files):
    _, path = byte_files["int8_weight_only"]
    model = onnx.load(str(path))
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}
    assert dims["input_ids"] == ["batch", "sequence_length"]
    assert dims["attention_mask"] == ["batch", "total_sequence_length"]
    assert dims["past_key_values.3.value"] == ["batch", 4, "past_sequence_length", 64]
    assert dims["logits"] == ["batch", "sequence_length", 256]
    assert dims["present.0.key"] == ["batch", 4, "total_sequence_length", 64]
    assert len(model.graph.input) == 2 + 2 * 4 and len(model.graph.output) == 1 + 2 * 4


def test_weights_are_stored_as_integers(byte_files):
    int8 = onnx.load(str(byte_files["int8_weight_only"][1]))
    int4 = onnx.load(str(byte_files["int4_weight_only"][1]))
    dequantize = [n.name for n in int8.graph.node if n.op_type == "DequantizeLinear"]
    assert sum(name.startswith("weight_") for name in dequantize) == 29  # 7 Linear x 4 layers + lm_head
    assert len(dequantize) == 30  # and the token embedding's rows (INT8 quantizes it: test_decoder_embedding.py)
    assert not any(n.op_type == "MatMul" and n.input[1].endswith("weight") for n in int8.graph.node)
    nbits = [n for n in int4.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 29
    assert {a.i for n in nbits for a in n.attribute if a.name in ("bits", "block_size")} == {4, 32}


def test_any_batch_and_length_against_torch(byte_files):
    """Batch 3, a 200-token prefill then 3 cached steps: none of these sizes is the trace's (2, 5, past 3).

    Accuracy level 0 keeps activations float where ORT fuses DequantizeLinear + MatMul (its default reads them
    in 8 bits: about 1e-2 here), so the file is held to the exporter's 2e-3.
    """
    model, path = byte_files["int8_weight_only"]
    layout = read_layout(path)
    session = onnx_session(path, options={"session.qdq_matmulnbits_accuracy_level": "0"})
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (3, 200), generator=g)
    mask = torch.ones(3, 200, dtype=torch.long)
    mask[2, :50] = 0
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
            **{f"past_key_values.{i}.{kv}": np.zeros((3, 4, 0, 64), np.float32) for i in range(4) for kv in ("key", "value")}}
    got = session.run(None, feed)
    decoder = cached_decoder(model)
    past = [torch.zeros(3, 4, 0, 64) for _ in range(8)]
    with torch.no_grad():
        expected = decoder(ids, mask, *past)
    valid = mask.bool().numpy()
    scale = np.abs(expected[0].numpy()[valid]).max()
    assert np.abs(got[0][valid] - expected[0].numpy()[valid]).max() / scale < 2e-3
    assert got[1].shape == (3, 4, 200, 64)
    step = onnx_greedy(session, layout, ids.numpy(), mask.numpy(), 3)
    assert step.shape == (3, 3)


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_other_families_int8_greedy(family, tmp_path):
    torch.manual_seed(0)
    common = dict(vocab_size=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "gpt2":
        lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_inner=128,
                                                                  n_positions=48, **common))
    else:  # grouped-query attention: 4 query heads share 2 key/value heads
        lm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=48, **common))
    model = _quantized("int8_weight_only", lm.eval())
    path = export_decoder(model, tmp_path / "m.onnx", spec=quant_spec(model))
    layout = read_layout(path)
    assert (layout.model_type, layout.kv_heads, layout.context) == (family, 2, 48)
    prompts = [[5, 9, 2, 33, 17, 40, 1], [7, 7, 3]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check = check_greedy(path, model, prompts, 12)
    assert check.matches, check.as_dict()


def test_divergence_is_reported_with_the_margin(tmp_path):
    """A file checked against another model: the first differing token, with torch's logit margin there."""
    def llama(seed):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
        return transformers.LlamaForCausalLM(config).eval()

    path = export_decoder(llama(0), tmp_path / "f.onnx")
    check = check_greedy(path, llama(1), [[3, 4, 5, 6]], 8)
    d = check.divergence
    assert d is not None and not check.matches
    assert check.onnx_tokens[0][:d.step] == check.torch_tokens[0][:d.step]
    assert check.onnx_tokens[0][d.step] == d.onnx_token != d.torch_token == check.torch_tokens[0][d.step]
    assert d.torch_margin > 0  # torch preferred its own token by that much


def test_refusals_leave_nothing(tmp_path):
    bert = transformers.BertLMHeadModel(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)).eval()
    with pytest.raises(ModelRefused, match="does not run with a key/value cache"):
        export_decoder(bert, tmp_path / "bert.onnx")
    vit = transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=64)).eval()
    with pytest.raises(ModelRefused, match="not a Hugging Face causal language model"):
        export_decoder(vit, tmp_path / "vit.onnx")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=32)).eval()
    with pytest.raises(ModelRefused, match="takes at most 32 positions"):
        layout_of(llama, 33)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataRefused, match="exceeds the file's context of 32"):
        left_padded([[1] * 30], layout_of(llama), 3)


def test_genai_config_names_the_files_layout(byte_files):
    _, path = byte_files["int4_weight_only"]
    config = json.loads(write_genai_config(path).read_text())
    decoder = config["model"]["decoder"]
    assert decoder["filename"] == "model.onnx" and decoder["num_hidden_layers"] == 4
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert decoder["outputs"]["present_value_names"] == "present.%d.value"
    assert config["model"]["context_length"] == 512 and config["model"]["vocab_size"] == 256


def test_onnxruntime_genai_generates_the_same_tokens(byte_files):
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (the test extra pins "
                             "onnxruntime-genai==0.18.0)")
    model, path = byte_files["int4_weight_only"]
    write_genai_config(path)
    assert (path.parent / GENAI_CONFIG).is_file()
    layout = read_layout(path)
    prompt = PROMPTS[0]
    generator_model = og.Model(str(path.parent))
    params = og.GeneratorParams(generator_model)
    params.set_search_options(max_length=len(prompt) + 32, do_sample=False)
    generator = og.Generator(generator_model, params)
    generator.append_tokens([prompt])
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    ids, mask = left_padded([prompt], layout, 32)
    expected = onnx_greedy(onnx_session(path), layout, ids, mask, 32)[0].tolist()
    assert tokens == expected  # and expected equals torch's: test_greedy_64_tokens_match_torch_with_a_padded_batch
