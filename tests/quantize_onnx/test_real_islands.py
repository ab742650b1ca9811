"""Issue 27 on the real models: the tensorrt preset's file (full placement) keeps the task of magika and
nudenet, where one int8 scale on every activation collapsed it (REAL.md before the float islands: magika
66/2000 against FP32's 1849; nudenet 0/118 FP32 detections reproduced)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from quantship.examples import real
from quantship.quantize_onnx import quantize_onnx_file

pytestmark = pytest.mark.slow


def _need(module: str) -> None:
    try:
        real.require(module)
    except real.MissingPackage as exc:
        pytest.skip(str(exc))


def _run(path, x: np.ndarray, batch: int = 16) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i:i + batch]})[0] for i in range(0, len(x), batch)])


def test_magika_tensorrt_file_keeps_fp32_accuracy(tmp_path):
    _need("magika")
    from quantship.examples.real import magika_files

    calib = magika_files.make_files(300, seed=0, skip=0).x[:64]  # the bench's calibration draw, first 64
    files = magika_files.make_files(2000, seed=0, skip=300)  # the bench's evaluation draw (disjoint)
    x, y = files.x[:200], files.y[:200]
    r = quantize_onnx_file(magika_files.model_path(), tmp_path / "magika_tensorrt.onnx",
                           [calib[i:i + 16] for i in range(0, len(calib), 16)], target="tensorrt", run_check=False)
    assert r.placement.mode == "full"
    assert {"normalisation_statistics", "polynomial_interior"} <= set(r.plan["float_islands"])
    fp32 = magika_files.accuracy(_run(magika_files.model_path(), x), y)
    scores = _run(r.path, x)
    mine = magika_files.accuracy(scores, y)
    agree = magika_files.agreement(scores, _run(magika_files.model_path(), x))
    # measured here: FP32 186/200, this file 185/200, 196/200 agreeing with FP32 (before: ~3%); the
    # bounds leave 4 points for another calibration draw and fail the collapse by a factor of 20
    assert mine.k >= fp32.k - 8, (mine, fp32)
    assert agree.k >= 0.93 * agree.n, agree


def test_nudenet_tensorrt_file_reproduces_fp32_detections(tmp_path):
    _need("nudenet")
    from quantship.examples.real import nudenet_yolo

    calib = nudenet_yolo.make_images(32, seed=1).x[:16]  # the bench's calibration draw, first 16
    images = nudenet_yolo.make_images(200, seed=0)
    n = 40
    r = quantize_onnx_file(nudenet_yolo.model_path(), tmp_path / "nudenet_tensorrt.onnx",
                           [calib[i:i + 8] for i in range(0, len(calib), 8)], target="tensorrt", run_check=False)
    assert r.plan["float_islands"]["split_range_output_concat"]["tensors"] == ["output0"]
    ref, out = _run(nudenet_yolo.model_path(), images.x[:n], 8), _run(r.path, images.x[:n], 8)
    theirs = [nudenet_yolo.detect(ref[i:i + 1], images.meta[i]) for i in range(n)]
    mine = [nudenet_yolo.detect(out[i:i + 1], images.meta[i]) for i in range(n)]
    reproduced, kept = nudenet_yolo.reproduced(theirs, mine)
    # measured here: 18 of FP32's 23 detections reproduced, 18 of this file's 19 are FP32's (onnxruntime-cpu's
    # file: 51/60 on the first 100 images, this preset's with 32 calibration images 50/60; before: 0/118,
    # every score rounded to 0). 0.6 leaves room for two or three detections more or less
    assert reproduced.n >= 10 and reproduced.k >= 0.6 * reproduced.n, (reproduced, kept)
    assert kept.k >= 0.6 * kept.n, (reproduced, kept)
