"""``quantship quantize hf:... --method ..._weight_only --decoder``: a decoder file, genai_config.json, the greedy
check in the report; and the bad input it refuses in one line, exit 2, with nothing written."""

from __future__ import annotations

import json

import onnx
import pytest

from quantship.cli.main import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                             tie_word_embeddings=False).save_pretrained(folder / "llama")
    transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64).save_pretrained(folder / "vit")
    transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64).save_pretrained(folder / "bert")
    return folder


def test_decoder_folder_and_report(configs, tmp_path, capsys):
    out = tmp_path / "model.onnx"
    code = main(["quantize", f"hf:{configs / 'llama'}", "--method", "int4_weight_only", "--decoder",
                 "--context", "80", "--check-tokens", "8", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["greedy_check"]["matches"] and report["greedy_check"]["rows"] == 2
    # a decoder file is for decoding: ONNX Runtime's fast kernel (int8 activations) unless another level is named
    assert "accuracy_level 4" in report["form"]
    assert {a.i for n in onnx.load(str(out)).graph.node if n.op_type == "MatMulNBits"
            for a in n.attribute if a.name == "accuracy_level"} == {4}
    assert report["layout"]["context"] == 80 and report["layout"]["kv_heads"] == 2
    config = json.loads((tmp_path / "genai_config.json").read_text())
    assert config["model"]["context_length"] == 80 and config["model"]["decoder"]["filename"] == "model.onnx"
    assert [i.name for i in onnx.load(str(out)).graph.input][:3] == ["input_ids", "attention_mask",
                                                                    "past_key_values.0.key"]


def test_int8_matmulnbits_decoder_defaults_to_the_fast_accuracy_level(configs, tmp_path, capsys):
    """ONNX Runtime's 8-bit MatMulNBits kernel at accuracy_level 0 decodes slower than FP32 (docs/decoder.md):
    the INT8 file is written at level 4 unless the user names a level, and the report says which."""
    out = tmp_path / "model.onnx"
    code = main(["quantize", f"hf:{configs / 'llama'}", "--method", "int8_weight_only", "--decoder",
                 "--check-tokens", "4", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and "accuracy_level 4" in report["form"]
    levels = [a.i for n in onnx.load(str(out)).graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "accuracy_level"]
    assert levels and set(levels) == {4}
    named = tmp_path / "named.onnx"
    assert main(["quantize", f"hf:{configs / 'llama'}", "--method", "int8_weight_only", "--decoder",
                 "--accuracy-level", "0", "--check-tokens", "0", "--out", str(named), "--json"]) == 0
    capsys.readouterr()
    assert {a.i for n in onnx.load(str(named)).graph.node if n.op_type == "MatMulNBits"
            for a in n.attribute if a.name == "accuracy_level"} == {0}


@pytest.mark.parametrize("model, extra, message", [
    ("vit", [], "Unrecognized configuration class"),
    ("bert", [], "does not run with a key/value cache"),
    ("llama", ["--context", "97"], "takes at most 96 positions"),
    ("llama", ["--check-tokens", "90"], "exceed the context of 96"),
    ("llama", ["--method", "static", "--equalize"], "--equalize belong(s) to the PyTorch path"),
    ("llama", ["--method", "static", "--seq-len", "200"], "exceed the context of 96"),
    ("llama", ["--accuracy-level", "4", "--weight-format", "standard"], "--accuracy-level is a MatMulNBits attribute"),
])
def test_bad_input_one_line_exit_2_nothing_written(configs, tmp_path, capsys, model, extra, message):
    args = ["quantize", f"hf:{configs / model}", "--method", "int8_weight_only", "--decoder",
            "--out", str(tmp_path / "m.onnx")]
    code = main(args + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("quantship quantize: error:") and message in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert list(tmp_path.iterdir()) == []


def test_decoder_with_gptq_rounds_against_the_calibration_and_matches_its_torch_model(configs, tmp_path, capsys):
    """``--decoder --gptq``: the weights GPTQ rounds on ``--calib`` (not to nearest: the file's int4 codes differ
    from the round-to-nearest file's), the greedy check run against that GPTQ torch model, and the report says so."""
    import numpy as np

    calib = tmp_path / "ids.npy"
    np.save(calib, np.random.default_rng(0).integers(0, 256, size=(8, 32)).astype(np.int64))
    files = {}
    for name, extra in {"gptq": ["--gptq", "--calib", str(calib)], "nearest": []}.items():
        files[name] = tmp_path / name / "model.onnx"
        files[name].parent.mkdir()
        code = main(["quantize", f"hf:{configs / 'llama'}", "--method", "int4_weight_only", "--decoder",
                     "--group-size", "32", "--check-tokens", "8", "--out", str(files[name]), "--json", *extra])
        report = json.loads(capsys.readouterr().out)
        assert code == 0 and report["greedy_check"]["matches"], report["greedy_check"]
        assert (report["spec"]["weight_algorithm"] == "gptq") == (name == "gptq")

    def codes(path):
        model = onnx.load(str(path))
        return {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in model.graph.initializer
                if t.data_type == onnx.TensorProto.UINT8}

    gptq, nearest = codes(files["gptq"]), codes(files["nearest"])
    assert gptq.keys() == nearest.keys() and gptq
    assert sum(gptq[k] != nearest[k] for k in gptq) >= len(gptq) // 2  # most layers' codes moved


def test_static_w8a8_decoder_through_the_onnx_engine(configs, tmp_path, capsys):
    """``--decoder --method static``: the float decoder file quantized W8A8 by the ONNX engine, calibrated on
    prefills (an empty cache): Q/DQ on the activations, the cache inputs and outputs float, the layout kept
    (any batch and length), fidelity judged and the greedy check run against the float model."""
    import numpy as np

    calib = tmp_path / "ids.npy"
    np.save(calib, np.random.default_rng(0).integers(0, 256, size=(24, 32)).astype(np.int64))
    out = tmp_path / "model.onnx"
    code = main(["quantize", f"hf:{configs / 'llama'}", "--method", "static", "--decoder", "--calib", str(calib),
                 "--seq-len", "32", "--check-tokens", "8", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["label"] == "W8A8" and report["greedy_check"]["rows"] == 2
    assert report["fidelity_fp32"]["status"] == "met" and report["greedy_reference"] == "the float model"
    model = onnx.load(str(out))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") > 5 and "MatMulNBits" not in ops
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["input_ids"] == ["batch", "sequence_length"] and dims["past_key_values.0.key"][2] == "past_sequence_length"
    assert json.loads((tmp_path / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "model.onnx"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["genai_config.json", "ids.npy", "model.onnx"]
