"""INT4 weight-only of a float ONNX file (``quantize_onnx.weight_only_file``), read from external data."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from quantship.errors import ExportRefused
from quantship.quantize_onnx.weight_only_file import quantize_rows, quantize_weight_only_file
from tests.quantize_onnx import graphs

WIDTH, TOKENS = 64, 6


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_rows_round_to_the_nearest_code_of_their_group():
    w = np.random.default_rng(0).standard_normal((64, 3), dtype=np.float32)  # K=64, N=3
    q = quantize_rows(w, 4, 32)
    assert q.codes.shape == (3, 64) and q.scale.shape == (3, 2) and q.codes.min() >= -8 and q.codes.max() <= 7
    back = (q.codes.reshape(3, 2, 32) * q.scale[:, :, None]).reshape(3, 64).T
    # each weight is within half a step of its group's grid, and each group's largest magnitude is exact
    assert np.all(np.abs(back - w) <= np.repeat(q.scale.T, 32, axis=0) / 2 + 1e-7)
    assert np.allclose(np.abs(back).reshape(2, 32, 3).max(axis=1), np.abs(w).reshape(2, 32, 3).max(axis=1))


def test_an_external_data_file_becomes_matmul_nbits_that_onnx_runtime_runs(tmp_path):
    (tmp_path / "in").mkdir()
    float_path = tmp_path / "in" / "float.onnx"
    onnx.save_model(graphs.encoder_block(WIDTH, TOKENS), str(float_path), save_as_external_data=True,
                    location="float.onnx.data", size_threshold=0)
    before = _digest(tmp_path / "in")
    x = np.random.default_rng(1).standard_normal((8, TOKENS, WIDTH), dtype=np.float32)
    out = tmp_path / "w4.onnx"
    done = quantize_weight_only_file(float_path, out, x, bits=4, group=32)
    assert _digest(tmp_path / "in") == before
    written = onnx.load(str(out))
    ops = [n.op_type for n in written.graph.node]
    # six weighted MatMuls (q, k, v, o, the two of the feed-forward); the head is a Gemm and stays float
    assert done.n_matmul_nbits == 6 and ops.count("MatMulNBits") == 6 and ops.count("MatMul") == 2
    assert done.kept_float == []  # the two attention MatMuls read no weight: nothing was left float
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = ort.InferenceSession(str(float_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    sqnr = 10 * np.log10(np.sum(ref ** 2) / np.sum((ref - got) ** 2))
    assert abs(sqnr - done.fp32.sqnr_db) < 1e-3 and 10 < sqnr < 40  # 4 bits: a real loss, not a broken file


def test_a_file_with_no_matmul_weight_is_refused_and_nothing_is_written(tmp_path):
    path = graphs.save(graphs.conv_relu_conv(), tmp_path / "conv.onnx")
    with pytest.raises(ExportRefused, match="nothing to store in 4 bits"):
        quantize_weight_only_file(path, tmp_path / "w4.onnx", graphs.images(2))
    assert not (tmp_path / "w4.onnx").exists()
