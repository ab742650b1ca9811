"""The real PP-OCR orientation classifier (0.6 MB, in rapidocr-onnxruntime): check reads it as ONNX
Runtime does, and quantize-onnx turns it into an INT8 file ORT runs on integer kernels."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import onnx
import pytest

from quantship.inspect.judge.check import check_file
from tests.quantize_onnx import graphs


def _package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        pytest.skip(f"{package} is not installed (pip install the 'real' extra)")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        pytest.skip(f"{path} is not in this {package} release")
    return path


@pytest.fixture(scope="module")
def classifier() -> Path:
    return _package_file("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx")


def rendered_lines(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` text lines rendered with matplotlib's DejaVu fonts, every other one turned 180 degrees,
    preprocessed as rapidocr's classifier does (48 x 192, (x / 255 - 0.5) / 0.5, right padding)."""
    from PIL import Image, ImageDraw, ImageFont

    fonts = sorted((_package_file("matplotlib", "mpl-data/fonts/ttf/DejaVuSans.ttf").parent).glob("DejaVu*.ttf"))
    words = "invoice total amount date number price model layer batch result text page value 42 3.14".split()
    rng = random.Random(seed)
    xs, ys = [], []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 5)))
        font = ImageFont.truetype(str(rng.choice(fonts)), rng.randint(18, 32))
        left, top, right, bottom = font.getbbox(text)
        img = Image.new("RGB", (right - left + 16, bottom - top + 12), (rng.randint(180, 255),) * 3)
        ImageDraw.Draw(img).text((8 - left, 6 - top), text, font=font, fill=(rng.randint(0, 80),) * 3)
        if i % 2:
            img = img.rotate(180)
        width = min(192, max(1, round(img.width * 48 / img.height)))
        arr = np.asarray(img.resize((width, 48), Image.BILINEAR), dtype=np.float32) / 255
        x = np.zeros((3, 48, 192), np.float32)
        x[:, :, :width] = ((arr - 0.5) / 0.5).transpose(2, 0, 1)
        xs.append(x)
        ys.append(i % 2)
    return np.stack(xs), np.array(ys)


def test_check_reads_a_minus_one_batch_as_dynamic_like_onnx_runtime(classifier):
    declared = onnx.load(str(classifier)).graph.input[0].type.tensor_type.shape.dim[0].dim_value
    assert declared == -1  # the file as Paddle wrote it
    static = check_file(classifier, "onnxruntime")
    assert static.ok and not [f for f in static.findings if f.rule == "valid_parameters"]
    ran = check_file(classifier, "onnxruntime", run=True, n_inputs=2)
    assert ran.ok == static.ok  # check never contradicts its own --run


def test_negative_dims_are_dynamic_and_zero_is_refused(tmp_path):
    for dim, ok in ((-5, True), (0, False)):
        m = graphs.conv_relu_conv()
        m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = dim
        report = check_file(graphs.save(m, tmp_path / f"dim{dim}.onnx"), "onnxruntime")
        assert report.ok is ok, report.summary()


def test_the_real_classifier_quantizes_on_integer_kernels_and_keeps_its_answers(classifier, tmp_path):
    import onnxruntime as ort

    from quantship.quantize_onnx import quantize_onnx_file

    calibration, _ = rendered_lines(16, seed=1)
    result = quantize_onnx_file(classifier, tmp_path / "cls_int8.onnx", [calibration[:8], calibration[8:]],
                                target="onnxruntime-cpu")
    done = {r.name: r.changes for r in result.normalised}
    assert done["lift_constants"] == 308 and done["upgrade_opset"] == 1 and done["fold_batch_norm"] == 35
    # every Conv runs as QLinearConv except the 5x5 depthwise ones, kept float on purpose (and said so)
    assert result.census["integer"]["QLinearConv"] == 53 - len(result.plan["kept_float"]) >= 45
    assert result.census["float"].get("Conv", 0) == len(result.plan["kept_float"])
    assert result.verdict.ok
    q = onnx.load(str(result.path))
    assert [d.dim_param for d in q.graph.input[0].type.tensor_type.shape.dim][0]  # the batch stays dynamic
    assert [o.name for o in q.graph.output] == ["save_infer_model/scale_0.tmp_1"]
    x, y = rendered_lines(48, seed=2)

    def predict(path):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {"x": x})[0].argmax(-1)

    fp32, int8 = predict(classifier), predict(result.path)
    assert (fp32 == int8).mean() >= 0.85  # measured 0.91 on 600 lines
    assert (int8 == y).mean() >= (fp32 == y).mean() - 0.1
