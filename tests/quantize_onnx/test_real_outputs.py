"""facenet-pytorch's MTCNN RNet as its own file: two outputs (box regression, face probability), both
read in their own LSB against the FP32 file and both compared in the check --run verdict."""

from __future__ import annotations

import pytest

from quantship.examples import real
from quantship.quantize_onnx import quantize_onnx_file

pytestmark = pytest.mark.slow

OUTPUTS = ["box_regression", "face_probability"]  # RNet's forward returns (b, a): boxes, then the softmax


@pytest.fixture(scope="module")
def rnet(tmp_path_factory):
    try:
        real.require("facenet_pytorch")
    except real.MissingPackage as exc:
        pytest.skip(str(exc))
    import torch

    from quantship import export_onnx
    from quantship.examples.real import mtcnn

    x = mtcnn.make_crops(16, seed=1).x["rnet"]  # the bench's calibration draw (seed 1), 24 x 24 crops
    d = tmp_path_factory.mktemp("rnet")
    fp32 = export_onnx(mtcnn.load_net("rnet"), torch.from_numpy(x[:1]), d / "rnet_fp32.onnx", dynamic_batch=True,
                       input_names=["x"], output_names=OUTPUTS)
    return fp32, [x[:8], x[8:]], d


def test_onnxruntime_file_reads_the_box_output_and_the_float_probability(rnet):
    fp32, calib, d = rnet
    r = quantize_onnx_file(fp32, d / "rnet_ort.onnx", calib, target="onnxruntime-cpu")
    each = r.readings.per_output
    assert list(each) == OUTPUTS
    # the box Gemm's output is quantized (its own step); the softmax stays float here (no step: n/a)
    assert each["box_regression"].scale is not None and each["face_probability"].scale is None
    assert each["box_regression"].literal_lsb <= 16  # measured 10.3 LSB (shared Intel Xeon)
    assert r.readings.literal_lsb == each["box_regression"].literal_lsb
    fidelity = r.fidelity["per_output"]
    assert fidelity["face_probability"]["fused"]["argmax_agreement"] >= 0.9  # measured 16/16
    assert fidelity["face_probability"]["fused"]["max_abs_error"] < 0.05  # measured 0.008
    run = r.verdict.runs[0]
    assert r.verdict.verdict == "accepted" and list(run.per_output) == OUTPUTS
    # the float softmax output, judged in the LSB of the logits feeding it carried through Softmax (x1/2)
    assert 0 <= run.per_output["face_probability"] <= run.per_output["box_regression"]


def test_tensorrt_file_reads_both_outputs_in_their_own_lsb(rnet):
    fp32, calib, d = rnet
    r = quantize_onnx_file(fp32, d / "rnet_trt.onnx", calib, target="tensorrt", run_check=False)
    each = r.readings.per_output
    assert list(each) == OUTPUTS and all(each[name].scale is not None for name in OUTPUTS)
    assert each["box_regression"].scale != each["face_probability"].scale
    assert each["face_probability"].literal_lsb <= 8  # measured 4.4 LSB
    assert each["box_regression"].literal_lsb <= 16  # measured 10.1 LSB
    assert r.readings.literal_lsb == max(each[name].literal_lsb for name in OUTPUTS)
