"""``quantship quantize`` (the PyTorch path) on models with several inputs and integer inputs: an ``.npz``
keyed by the forward's argument names, each input in its dtype; the file keeps those names; a missing
input is one line, exit 2, nothing written; an ``hf:`` decoder from its config alone, calibrated on
generated token ids (issue 38, item 4)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from quantship.cli.main import main

TWO_INPUTS = '''
import torch
import torch.nn as nn


class Tagger(nn.Module):
    """Token ids and float features: an embedding and a Linear, summed, then a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.features_in = nn.Linear(4, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids, features):
        return self.head(torch.relu(self.embed(input_ids).mean(1) + self.features_in(features)))


class Ids(nn.Module):
    """Token ids only: a tiny embedding and a Linear over each token."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.out = nn.Linear(8, 30)

    def forward(self, input_ids):
        return self.out(self.embed(input_ids))


def build():
    torch.manual_seed(0)
    return Tagger()


def ids():
    torch.manual_seed(0)
    return Ids()
'''


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    (tmp_path / "net.py").write_text(TWO_INPUTS)
    rng = np.random.default_rng(0)
    # int32 ids: cast exactly to the int64 the embedding takes, by the one loader's rules
    np.savez(tmp_path / "two.npz", input_ids=rng.integers(0, 50, (24, 6)).astype(np.int32),
             features=rng.standard_normal((24, 4)).astype(np.float32))
    np.savez(tmp_path / "ids.npz", input_ids=rng.integers(0, 30, (24, 5)))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _inputs(path) -> dict[str, int]:
    return {i.name: i.type.tensor_type.elem_type for i in onnx.load(str(path)).graph.input}


def test_two_inputs_from_an_npz_keyed_by_argument_name(folder, capsys):
    code = main(["quantize", "net.py:build", "--calib", "two.npz", "--out", "two.onnx", "--no-speed", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["inputs"] == ["input_ids", "features"] and report["verdict"] == "accepted"
    assert _inputs(folder / "two.onnx") == {"input_ids": onnx.TensorProto.INT64, "features": onnx.TensorProto.FLOAT}
    (run,) = report["check"]["runs"]
    assert run["ran"] and run["inputs"] == "given"
    session = ort.InferenceSession(str(folder / "two.onnx"))
    (logits,) = session.run(None, {"input_ids": np.arange(18, dtype=np.int64).reshape(3, 6),
                                   "features": np.ones((3, 4), np.float32)})
    assert logits.shape == (3, 3) and np.isfinite(logits).all()


def test_token_ids_of_a_text_model(folder, capsys):
    code = main(["quantize", "net.py:ids", "--calib", "ids.npz", "--out", "ids.onnx", "--no-speed", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert _inputs(folder / "ids.onnx") == {"input_ids": onnx.TensorProto.INT64}
    assert report["fidelity_fp32"]["status"] == "met"
    (out,) = ort.InferenceSession(str(folder / "ids.onnx")).run(None, {"input_ids": np.zeros((2, 5), np.int64)})
    assert out.shape == (2, 5, 30)


@pytest.mark.parametrize("argv, message", [
    (["--calib", "ids.npz"], "no array for argument(s) ['features']"),
    (["--calib", "two.npz", "--bias-correction"], "bias_correction run on models with one input"),
])
def test_a_missing_input_or_a_one_input_algorithm_is_one_line(folder, capsys, argv, message):
    assert main(["quantize", "net.py:build", *argv, "--out", "x.onnx", "--no-speed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    left = sorted(p.name for p in folder.iterdir() if p.name != "__pycache__")
    assert left == ["ids.npz", "net.py", "two.npz"]  # no file, no scratch folder


@pytest.mark.slow
def test_hf_decoder_from_its_config_on_generated_token_ids(tmp_path, capsys):
    """A Llama from a config.json alone (random weights, no hub): static W8A8, calibrated on generated ids."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                             bos_token_id=None, eos_token_id=None, pad_token_id=None).save_pretrained(tmp_path)
    out = tmp_path / "llama.onnx"
    code = main(["quantize", f"hf:{tmp_path / 'config.json'}", "--out", str(out), "--seq-len", "8",
                 "--max-samples", "16", "--no-speed", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["inputs"] == ["input_ids"] and report["calibration"].startswith("generated token ids")
    assert report["weights"].startswith("random initial weights")
    assert _inputs(out) == {"input_ids": onnx.TensorProto.INT64}
    (logits,) = ort.InferenceSession(str(out)).run(None, {"input_ids": np.zeros((2, 8), np.int64)})
    assert logits.shape == (2, 8, 64)
