"""The per-node SQNR report and the accuracy search on a real pretrained file: the PP-OCR orientation
classifier inside rapidocr-onnxruntime (0.6 MB, ``quantship.examples.real.ocr_cls``), on text lines
rendered here (cached under the cache folder)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from quantship.examples import real
from quantship.quantize.layer_error import sqnr_db
from quantship.quantize_onnx import quantize_onnx_file
from quantship.quantize_onnx.search import OnnxBudgetMissed, search_onnx
from quantship.quantize_onnx.sensitivity import node_sqnr

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cls():
    try:
        real.require("rapidocr_onnxruntime")
    except real.MissingPackage as exc:
        pytest.skip(str(exc))
    from quantship.examples.real import ocr_cls

    calibration = ocr_cls.make_lines(32, seed=1).x
    return ocr_cls, [calibration[:16], calibration[16:]], ocr_cls.make_lines(96, seed=0)


def test_every_quantized_node_of_the_real_classifier_has_a_row_and_the_output_figure_is_the_file_s(cls, tmp_path):
    ocr_cls, calibration, _ = cls
    q = quantize_onnx_file(ocr_cls.model_path(), tmp_path / "q.onnx", calibration, target="onnxruntime-cpu")
    report = node_sqnr(ocr_cls.model_path(), calibration, target="onnxruntime-cpu", quantized_path=q.path)
    assert report.unmatched == [] and report.n_samples == 32
    assert sum(r.role == "weighted" for r in report.rows) == q.plan["n_weighted"]
    assert not any(r.node in q.plan["kept_float"] for r in report.rows)  # the depthwise 5x5 kept float: no row
    x = np.concatenate(calibration)

    def out(path):  # as the report reads a file: its Q/DQ arithmetic as written (no fused kernel)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    ref, got = out(ocr_cls.model_path()).astype(np.float64), out(q.path).astype(np.float64)
    assert report.output_sqnr_db == pytest.approx(sqnr_db(float((ref ** 2).sum()), float(((ref - got) ** 2).sum())),
                                                  abs=0.05)  # the normalised float file vs the original: 1e-4
    worst = report.worst(3)
    assert len(worst) == 3 and worst[0].sqnr_db <= np.median([r.sqnr_db for r in report.rows])


def test_the_search_on_the_real_classifier_builds_its_own_premise(cls, tmp_path):
    ocr_cls, calibration, lines = cls

    def orientation_mass(run) -> float:
        """Mean probability the file gives the true orientation, in percent (its output is a softmax)."""
        p = np.concatenate([run(lines.x[i:i + 48])[0] for i in range(0, len(lines.y), 48)]).astype(np.float64)
        return 100.0 * float(p[np.arange(len(lines.y)), lines.y].mean())

    kwargs = dict(target="onnxruntime-cpu", metric=orientation_mass, try_int16=False)  # the float form alone
    # (16-bit before float: tests/test_onnx_int16.py)
    with pytest.raises(OnnxBudgetMissed) as missed:  # a budget nothing meets: steps 0 and 1 both measured
        search_onnx(ocr_cls.model_path(), tmp_path / "q.onnx", calibration, max_drop=0.0, max_steps=1, **kwargs)
    measured = missed.value.search
    assert not (tmp_path / "q.onnx").exists() and len(measured.steps) == 2
    d0, d1 = (measured.drop(s) for s in measured.steps)
    assert measured.steps[1].excluded == (measured.order[0],) and d0 > 0
    print(f"orientation mass drop: step 0 {d0:.4f}, step 1 {d1:.4f} points")
    if d1 < d0:
        budget = (d0 + d1) / 2  # keeping the worst-SQNR node float helped: a budget between the two is met at step 1
        result, search = search_onnx(ocr_cls.model_path(), tmp_path / "q.onnx", calibration, max_drop=budget,
                                     max_steps=1, **kwargs)
        assert [s.excluded for s in search.steps] == [(), (measured.order[0],)] and result.path.is_file()
        assert result.excluded == [measured.order[0]] and result.verdict.ok
    else:  # it did not: a budget just under step 0's drop is refused after the same two steps, and said so
        budget = 0.99 * d0
        with pytest.raises(OnnxBudgetMissed, match=r"step 0 \[nothing\].*step 1"):
            search_onnx(ocr_cls.model_path(), tmp_path / "q.onnx", calibration, max_drop=budget, max_steps=1,
                        **kwargs)
