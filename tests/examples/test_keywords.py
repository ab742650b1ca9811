"""The recurrent example (issue 39): log mel frames -> LSTM -> Linear, its float file and the default INT8 file
with the LSTM as ONNX Runtime's DynamicQuantizeLSTM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantship.examples import keywords
from quantship.export import export_onnx
from quantship.inspect.run.consumers import ort_session
from quantship.quantize_onnx.quantizer import quantize_onnx_file


def test_clips_are_deterministic_and_cover_every_class():
    (a, ya), (b, yb) = keywords.synthesize(64, seed=5), keywords.synthesize(64, seed=5)
    assert np.array_equal(a, b) and np.array_equal(ya, yb) and a.shape == (64, keywords.CLIP_SAMPLES)
    assert set(ya.tolist()) == set(range(keywords.N_CLASSES))
    assert not np.array_equal(a, keywords.synthesize(64, seed=6)[0])


def test_features_are_log_mel_frames_relative_to_the_clip_level():
    clips, _ = keywords.synthesize(8, seed=1)
    f = keywords.features(clips)
    assert f.shape == (8, keywords.N_FRAMES, keywords.N_MELS) and f.dtype == np.float32
    assert np.allclose(f.max(axis=(1, 2)), 0.0) and f.min() >= keywords.FLOOR
    quieter = keywords.features(clips * 0.1)  # 20 dB down: the same frames, except near the floor (its 1e-10)
    assert np.abs(quieter - f)[f > keywords.FLOOR + 3].max() < 1e-2  # measured 7e-4


def test_a_tiny_model_exports_and_its_lstm_runs_as_an_integer_kernel(tmp_path):
    model = keywords.train(hidden=64, epochs=1, n_train=64)
    again = keywords.train(hidden=64, epochs=1, n_train=64)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    calib = keywords.calibration().x[:16]
    path = export_onnx(model, torch.from_numpy(calib[:8]), tmp_path / "kw.onnx")
    result = quantize_onnx_file(path, tmp_path / "kw_int8.onnx", calib, target="onnxruntime-cpu", run_check=False)
    assert result.census["integer"].get("DynamicQuantizeLSTM") == 1 and "LSTM" not in result.census["float"]
    with torch.no_grad():
        expected = model(torch.from_numpy(calib)).numpy()
    got = ort_session(result.path, optimized=True).run(None, {"x": calib})[0]
    assert got.shape == expected.shape and (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.9


@pytest.mark.slow
def test_the_integer_lstm_file_keeps_the_task(tmp_path):
    """The cached hidden-128 model on the 1,000 held-out clips: the INT8 file (integer LSTM) within one point of
    the FP32 file's top-1 (bench/recurrent.py has the figures and the speed)."""
    files = keywords.write_files(tmp_path)
    held = np.load(files.held_out)
    result = quantize_onnx_file(files.float_onnx, tmp_path / "int8.onnx", np.load(files.calibration),
                                target="onnxruntime-cpu")
    assert result.census["integer"].get("DynamicQuantizeLSTM") == 1
    fp32 = ort_session(files.float_onnx, optimized=True).run(None, {"x": held["x"]})[0]
    int8 = ort_session(result.path, optimized=True).run(None, {"x": held["x"]})[0]
    (k_fp32, n), (k_int8, _) = keywords.accuracy(fp32, held["y"]), keywords.accuracy(int8, held["y"])
    assert k_fp32 / n >= 0.85 and abs(k_int8 - k_fp32) <= 0.01 * n
