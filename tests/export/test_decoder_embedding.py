"""The token embedding table in low bits (``quantize_embedding``; ``export.embedding``): written as
GatherBlockQuantized (MatMulNBits form) or as integer rows + DequantizeLinear (standard form), no float copy left,
greedy decoding token for token equal to the torch weight-only model that reads the same quantized table, one
stored table for a tied LM head, and the file smaller by the table's share.

The trained byte-level Llama (``quantship.examples.lm``, head untied): INT8 per channel (its embedding quantized by
default) in the standard form, INT4 groups of 32 with ``quantize_embedding=True`` as MatMulNBits, and both at
their default (INT8 quantized, INT4 float) for the size. A tied Llama config with random weights for the tie.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from quantship import Quantizer, quant_spec, targets
from quantship.errors import SpecRefused
from quantship.export.decoder import export_decoder
from quantship.export.decoder_check import check_greedy, onnx_session
from quantship.inspect.judge.check import check_file
from quantship.inspect.read.graph import inspect_file

transformers = pytest.importorskip("transformers")
PROMPTS = [list(b"import os\nimport sys\n\n\ndef main(argv):\n    "), list(b"class Reader:\n    def ")]
NEW_TOKENS = 64
VOCAB = HIDDEN = 256  # the byte Llama's table: 256 bytes x hidden 256
NBITS = targets.get("onnxruntime-cpu")


def _quantized(model, method: str, **kwargs):
    if method == "int4_weight_only":
        kwargs.setdefault("group_size", 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Quantizer("torchao", method=method, **kwargs).quantize(model, None)


@pytest.fixture(scope="module")
def byte_lm():
    from quantship.examples import lm

    return lm.trained_model()


@pytest.fixture(scope="module")
def byte_files(byte_lm, tmp_path_factory):
    """name -> (torch weight-only model, decoder file)."""
    folder = tmp_path_factory.mktemp("embedding")
    cases = {"int8_standard": ("int8_weight_only", {}, None),  # the INT8 default: embedding quantized
             "int8_standard_float": ("int8_weight_only", {"quantize_embedding": False}, None),
             "int4_nbits": ("int4_weight_only", {"quantize_embedding": True}, NBITS),
             "int4_nbits_float": ("int4_weight_only", {}, NBITS)}  # the INT4 default: embedding float
    out = {}
    for name, (method, kwargs, target) in cases.items():
        model = _quantized(byte_lm, method, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[name] = (model, export_decoder(model, folder / f"{name}.onnx", spec=quant_spec(model), target=target))
    return out


def _float_tables(model: onnx.ModelProto, rows: int, width: int) -> list[str]:
    """Float initializers of the table's shape, either orientation."""
    return [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT
            and tuple(t.dims) in ((rows, width), (width, rows))]


def test_rule_by_bits_and_the_spec_records_it(byte_files):
    assert quant_spec(byte_files["int8_standard"][0]).quantize_embedding is True
    assert quant_spec(byte_files["int4_nbits_float"][0]).quantize_embedding is False
    assert quant_spec(byte_files["int4_nbits"][0]).quantize_embedding is True
    with pytest.raises(SpecRefused, match="quantize_embedding=True"):
        Quantizer("pt2e", method="static", quantize_embedding=True)


def test_nbits_form_writes_gather_block_quantized(byte_files):
    model = onnx.load(str(byte_files["int4_nbits"][1]))
    (gather,) = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    attrs = {a.name: a.i for a in gather.attribute}
    assert gather.domain == "com.microsoft" and attrs == {"bits": 4, "block_size": 32, "gather_axis": 0,
                                                          "quantize_axis": 1}
    data = {t.name: t for t in model.graph.initializer}[gather.input[0]]
    assert data.data_type == onnx.TensorProto.UINT8 and tuple(data.dims) == (VOCAB, HIDDEN // 2)
    assert not any(n.op_type == "Gather" for n in model.graph.node)
    assert _float_tables(model, VOCAB, HIDDEN) == []  # the float table is gone, no copy beside the codes
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 29  # and the LM head is MatMulNBits too
    floats = onnx.load(str(byte_files["int4_nbits_float"][1]))
    assert _float_tables(floats, VOCAB, HIDDEN) == ["lm.model.embed_tokens.weight"]  # what the option changes


def test_standard_form_gathers_integer_rows(byte_files):
    model = onnx.load(str(byte_files["int8_standard"][1]))
    stored = {t.name: t for t in model.graph.initializer}
    (dq,) = [n for n in model.graph.node if n.name.startswith("table_dequantize")]
    rows = next(n for n in model.graph.node if dq.input[0] in n.output)
    scales = next(n for n in model.graph.node if dq.input[1] in n.output)
    assert rows.op_type == scales.op_type == "Gather"
    assert stored[rows.input[0]].data_type == onnx.TensorProto.INT8 and tuple(stored[rows.input[0]].dims) == (VOCAB, HIDDEN)
    assert tuple(stored[scales.input[0]].dims) == (VOCAB, 1)  # one scale per row: INT8 per channel
    assert {a.name: a.i for a in dq.attribute} == {"axis": -1, "block_size": HIDDEN}
    assert _float_tables(model, VOCAB, HIDDEN) == []


@pytest.mark.parametrize("name", ["int8_standard", "int4_nbits"])
def test_greedy_64_tokens_match_torch_reading_the_same_table(byte_files, name):
    """The torch model reads torchao's quantized table (nn.Embedding on the quantized tensor), so both sides
    compute with the same table; the float-embedding file of the same weights decodes differently from it."""
    model, path = byte_files[name]
    assert type(model.lm.model.embed_tokens.weight).__name__ != "Parameter"  # torchao's tensor, not float
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check = check_greedy(path, model, PROMPTS, NEW_TOKENS)
    assert check.matches, check.as_dict()


def test_file_smaller_by_the_tables_share(byte_files):
    """Quantizing the table saves its float bytes less its codes and scales, to within the names' bytes."""
    for quantized, floated, bits, scales_per_row in (("int8_standard", "int8_standard_float", 8, 1),
                                                     ("int4_nbits", "int4_nbits_float", 4, HIDDEN // 32)):
        saved = os.path.getsize(byte_files[floated][1]) - os.path.getsize(byte_files[quantized][1])
        expected = VOCAB * HIDDEN * 4 - VOCAB * HIDDEN * bits // 8 - VOCAB * scales_per_row * 4
        print(f"{quantized}: {saved} bytes saved, table share {expected}")
        assert abs(saved - expected) < 2048, (saved, expected)


@pytest.mark.parametrize("name, form", [("int8_standard", "DequantizeLinear"),
                                        ("int4_nbits", "GatherBlockQuantized + MatMulNBits")])
def test_inspect_counts_the_table_and_check_runs_it(byte_files, name, form):
    path = byte_files[name][1]
    low_bit = inspect_file(path).weight_only
    assert low_bit["quantized"] == {"Gather": 1, "MatMul": 29} and low_bit["float"] == {}
    assert form in low_bit["description"]
    report = check_file(path, "onnxruntime-cpu", run=True, n_inputs=2)
    assert report.format == "weight-only" and report.verdict == "accepted", report.summary()


@pytest.fixture(scope="module")
def tied_lm():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    lm = transformers.LlamaForCausalLM(config).eval()
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    return lm


def _tied_gpt2():
    """Tied by default; at vocabulary 96 the exporter folds the head's Transpose into a second initializer (a larger
    table it leaves as a Transpose, as for Llama)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, n_inner=128, n_positions=64, vocab_size=96,
                                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("target", [None, NBITS], ids=["standard", "nbits"])
def test_tied_head_and_embedding_read_one_stored_table(tied_lm, tmp_path, target, family):
    """Llama's export keeps the tied head's Transpose; GPT-2's folds it into a second initializer, which the
    writer turns back into a Transpose of the one stored table."""
    model = _quantized(tied_lm if family == "llama" else _tied_gpt2(), "int4_weight_only", quantize_embedding=True)
    assert model.get_input_embeddings().weight is model.lm_head.weight  # one quantized tensor in torch too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = export_decoder(model, tmp_path / "tied.onnx", spec=quant_spec(model), target=target)
        check = check_greedy(path, model, [[5, 9, 2, 33, 17, 40, 1], [7, 7, 3]], 12,
                             session=onnx_session(path, options={"session.qdq_matmulnbits_accuracy_level": "0"}))
    assert check.matches, check.as_dict()
    graph = onnx.load(str(path)).graph
    vocab = model.config.vocab_size
    tables = [t for t in graph.initializer if vocab in t.dims and t.data_type != onnx.TensorProto.FLOAT]
    assert len(tables) == 1, [t.name for t in tables]  # one copy of the codes, in either orientation ...
    assert _float_tables(onnx.load(str(path)), vocab, 64) == []  # ... and no float one
    readers = {}  # stored tensor -> op types reading it, through the ops that only move or recast it
    producers = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        if node.op_type in ("Reshape", "Transpose", "Cast"):
            continue
        for name in node.input:
            while name in producers and producers[name].op_type in ("Reshape", "Transpose", "Cast"):
                name = producers[name].input[0]
            readers.setdefault(name, set()).add(node.op_type)
    expected = {"GatherBlockQuantized", "MatMulNBits"} if target else {"Gather", "DequantizeLinear"}
    assert readers[tables[0].name] == expected


def test_tied_embedding_float_at_int4_by_default_beside_the_quantized_head(tied_lm, tmp_path):
    """INT4's default keeps the table float (docs/decoder.md: the tied byte Llama lost 0.62% at g128): the float
    table for the Gather and the head's int4 codes are then both stored."""
    model = _quantized(tied_lm, "int4_weight_only")
    assert quant_spec(model).quantize_embedding is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = export_decoder(model, tmp_path / "tied.onnx", spec=quant_spec(model), target=NBITS)
    model_file = onnx.load(str(path))
    assert _float_tables(model_file, 512, 64) == ["lm.model.embed_tokens.weight"]
    assert sum(n.op_type == "MatMulNBits" for n in model_file.graph.node) == 8


def test_tied_embedding_needs_its_head_quantized(tied_lm):
    with pytest.raises(SpecRefused, match="tied to the LM head"):
        Quantizer("torchao", method="int8_weight_only", weight_bits={"lm_head": 16},
                  quantize_embedding=True).quantize(tied_lm, None)
    kept = Quantizer("torchao", method="int8_weight_only", weight_bits={"lm_head": 16}).quantize(tied_lm, None)
    assert quant_spec(kept).quantize_embedding is False  # the rule leaves a float head's table float


def test_gather_block_quantized_is_exact_against_the_tables_rows(byte_files):
    """The rows GatherBlockQuantized returns are torchao's dequantized rows, bit for bit."""
    model, path = byte_files["int4_nbits"]
    table = model.lm.model.embed_tokens.weight.dequantize().detach().numpy()
    graph = onnx.load(str(path))
    gather = next(n for n in graph.graph.node if n.op_type == "GatherBlockQuantized")
    stored = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    ids = np.array([[0, 7, 255, 65]], np.int64)
    probe = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("GatherBlockQuantized", ["data", "ids", "scale"], ["rows"], domain="com.microsoft",
                               **{a.name: a.i for a in gather.attribute})], "probe",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 4])],
        [onnx.helper.make_tensor_value_info("rows", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(stored[gather.input[0]], "data"), numpy_helper.from_array(stored[gather.input[2]], "scale")]),
        opset_imports=[onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid("com.microsoft", 1)])
    import onnxruntime as ort

    rows = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    assert np.array_equal(rows, table[ids])


def test_onnxruntime_genai_reads_the_quantized_table(byte_files):
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (the test extra pins "
                             "onnxruntime-genai==0.18.0)")
    from quantship.export.decoder import read_layout, write_genai_config
    from quantship.export.decoder_check import left_padded, onnx_greedy

    _, path = byte_files["int4_nbits"]
    write_genai_config(path)
    generator_model = og.Model(str(path.parent))
    params = og.GeneratorParams(generator_model)
    params.set_search_options(max_length=len(PROMPTS[0]) + 32, do_sample=False)
    generator = og.Generator(generator_model, params)
    generator.append_tokens([PROMPTS[0]])
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    layout = read_layout(path)
    ids, mask = left_padded([PROMPTS[0]], layout, 32)
    assert tokens == onnx_greedy(onnx_session(path), layout, ids, mask, 32)[0].tolist()
