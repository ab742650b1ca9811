"""``quantship quantize --method int4_weight_only``: an hf: model to a weight-only ONNX file, and its bad input."""

from __future__ import annotations

import json

import onnx
import pytest

from quantship.cli.main import main


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False).save_pretrained(folder)
    return folder


def test_int4_chooses_the_group_and_writes_matmul_nbits(hf_config, tmp_path, capsys):
    out = tmp_path / "lm.onnx"
    code = main(["quantize", f"hf:{hf_config}", "--method", "int4_weight_only", "--seq-len", "16", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and out.is_file() and "ORT vs torch" in text
    assert "group size: 32" in text and "[64, 96]" in text  # widths 64 and 96: 32 is the largest dividing both
    assert sum(n.op_type == "MatMulNBits" for n in onnx.load(str(out)).graph.node) == 8  # 7 per layer + lm_head
    # both readings, each with the session option it ran with (the file's MatMulNBits carry no accuracy_level)
    assert "default session" in text and "exact session" in text
    assert "session.qdq_matmulnbits_accuracy_level=0" in text

    # the file read back as a new user would: its format named, never "no quantization"
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "weight-only int4, MatMulNBits, group 32" in text and "8 of 9: 8 MatMul" in text
    assert "lm.model.embed_tokens.weight" in text  # the one weight left float: the embedding table
    assert main(["check", str(out), "--target", "onnxruntime-cpu"]) == 0
    text = capsys.readouterr().out
    assert "weight-only int4, MatMulNBits, group 32 file" in text and "no quantization" not in text


def test_int8_standard_form_as_json(hf_config, tmp_path, capsys):
    out = tmp_path / "lm8.onnx"
    code = main(["quantize", f"hf:{hf_config}", "--method", "int8_weight_only", "--weight-format", "standard",
                 "--seq-len", "16", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["label"] == "W8A16" and report["spec"]["qscheme"] == "per_channel"
    assert report["relative_error_vs_torch_float_activations"] < 2e-3 and report["size_bytes"] == out.stat().st_size
    assert report["relative_error_vs_torch"] < 5e-2  # ORT's own fusion runs the activations in 8 bits
    default, exact = report["readings"]  # both measured, each named with its session options
    assert default["reading"] == "default" and default["session_options"] == {}
    assert exact["session_options"] == {"session.qdq_matmulnbits_accuracy_level": "0"}
    assert default["relative_error_vs_torch"] == report["relative_error_vs_torch"]
    assert exact["relative_error_vs_torch"] == report["relative_error_vs_torch_float_activations"]
    # int8 activations in the default reading: measurably further from torch than the exact one
    assert default["relative_error_vs_torch"] > 10 * exact["relative_error_vs_torch"]

    assert main(["check", str(out), "--target", "onnxruntime-cpu", "--run", "--n", "2", "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert checked["format"] == "weight-only" and checked["verdict"] == "accepted"
    assert checked["weight_only"]["description"] == "weight-only int8, DequantizeLinear, per channel"
    (run,) = checked["runs"]
    assert set(run["readings"]) == {"default", "exact"} and run["readings"]["exact"] < 2e-3


def test_group_size_that_does_not_divide_lists_the_layers(hf_config, tmp_path, capsys):
    out = tmp_path / "bad.onnx"
    code = main(["quantize", f"hf:{hf_config}", "--method", "int4_weight_only", "--group-size", "64",
                 "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the line before notes the random weights
    assert code == 2 and not out.exists() and err.startswith("quantship quantize: error:")
    assert "lm.model.layers.0.mlp.down_proj': 96" in err and "group_size=32 divides every one" in err


def test_hf_source_and_target_refusals(tmp_path, capsys):
    assert main(["quantize", f"hf:{tmp_path / 'nowhere'}", "--method", "int4_weight_only",
                 "--out", str(tmp_path / "x.onnx")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["quantize", "hf:reference", "--method", "int4_weight_only", "--target", "tensorrt",
                 "--out", str(tmp_path / "y.onnx")]) == 2
    assert "a weight-only file is written for onnxruntime-cpu" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_gptq_flag_writes_the_gptq_file(hf_config, tmp_path, capsys):
    import numpy as np

    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 256, size=(16, 16)).astype(np.int64))
    out = tmp_path / "gptq.onnx"
    code = main(["quantize", f"hf:{hf_config}", "--method", "int4_weight_only", "--gptq", "--calib", str(ids),
                 "--seq-len", "16", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["spec"]["weight_algorithm"] == "gptq" and report["spec"]["group_size"] == 32
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert json.loads(meta["quantship.spec"])["weight_algorithm"] == "gptq"  # the file's provenance


@pytest.mark.parametrize("extra, words", [
    (["--method", "int8_weight_only"], "--gptq applies to --method int4_weight_only"),
    (["--method", "static", "--calib", "x.npy"], "--gptq applies to --method int4_weight_only"),
    (["--method", "int4_weight_only"], "--gptq needs --calib"),
])
def test_gptq_refused_where_it_does_not_apply(tmp_path, capsys, extra, words):
    out = tmp_path / "no.onnx"
    (tmp_path / "x.npy").touch()  # paths are checked before options: this one exists, so the option speaks
    extra = [str(tmp_path / e) if e == "x.npy" else e for e in extra]
    code = main(["quantize", "hf:reference", "--gptq", *extra, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0] and not out.exists()
