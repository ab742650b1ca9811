"""Per-layer SQNR report on the reference task: ordered rows, worst layer named, PNG, skip advice."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from quantship import Quantizer
from quantship.quantize.layer_error import layer_error, sqnr_db, suggest_skip
from quantship.quantize.skip_effect import measure_skip


@pytest.fixture(scope="module")
def reference():
    from quantship.examples import digits

    model, split = digits.trained_model(), digits.load_split()
    calib = [split.x_train[i:i + 32] for i in range(0, 128, 32)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = Quantizer(backend="pt2e").quantize(model, calib)
    evals = [split.x_test[i:i + 32] for i in range(0, 128, 32)]
    return model, split, calib, q, layer_error(model, q, evals)


def test_sqnr_db():
    assert sqnr_db(100.0, 1.0) == pytest.approx(20.0)
    assert sqnr_db(1.0, 0.0) == math.inf


def test_report_rows_cover_quantized_layers(reference):
    model, _, _, q, report = reference
    assert report.n_samples == 128 and not report.unmatched
    # one row per quantized non-input tensor of the converted graph, in graph order
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    expected = [n.args[0].name for n in q.graph.nodes
                if n.op == "call_function" and n.target == quantize and n.args[0].op != "placeholder"]
    assert [r.node for r in report.rows] == expected
    assert [r.order for r in report.rows] == list(range(len(expected)))
    # every weighted layer of the model shows up under its own module name
    modules = {r.module for r in report.rows}
    assert {"stem.0", "block1.conv1", "block1.conv2", "down.0", "block2.conv1", "block2.conv2", "head"} <= modules
    # int8 on a trained model: finite, and neither lossless nor noise
    assert all(10.0 < r.sqnr_db < 80.0 for r in report.rows)
    assert 10.0 < report.output_sqnr_db < 80.0


def test_worst_layer_named_in_table_and_dict(reference):
    report = reference[-1]
    worst = report.worst(1)[0]
    assert worst.sqnr_db == min(r.sqnr_db for r in report.rows)
    table = report.to_markdown(worst=1)
    line = next(li for li in table.splitlines() if f"| {worst.node} |" in li)
    assert "**worst**" in line and table.count("**worst**") == 1
    data = report.as_dict()
    assert data["worst"][0] == worst.node and len(data["rows"]) == len(report.rows)
    print(f"\nworst layer: {worst.node} ({worst.module}) {worst.sqnr_db:.1f} dB; "
          f"output {report.output_sqnr_db:.1f} dB")


def test_plot_png_opens(reference, tmp_path):
    from PIL import Image

    path = reference[-1].plot(tmp_path / "layer_error.png")
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size[0] > 0 and image.size[1] > 0


@pytest.mark.slow
def test_suggest_and_measure_skip(reference):
    model, split, calib, _, report = reference
    names = suggest_skip(report, 2)
    assert len(names) == 2
    assert names[0] == report.worst(1)[0].unit
    known = {n for n, _ in model.named_modules()} | {r.node for r in report.rows}
    assert set(names) <= known  # usable as skip_activations: modules, or ops of the captured graph
    evals = [(split.x_test[i:i + 32], split.y_test[i:i + 32]) for i in range(0, 128, 32)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        effect = measure_skip(model, calib, evals, names)
    assert effect.n == 128 and effect.names == tuple(names)
    assert 0 <= effect.correct_before <= 128 and 0 <= effect.correct_after <= 128
    # the same quantization as the report's, so the "before" figure is the report's output SQNR
    assert effect.sqnr_before_db == pytest.approx(report.output_sqnr_db, abs=0.01)
    # keeping layers in float changes the arithmetic, so the output must move
    assert effect.sqnr_after_db != effect.sqnr_before_db
    print(f"\nskip {names}: output SQNR {effect.sqnr_before_db:.2f} -> {effect.sqnr_after_db:.2f} dB, "
          f"correct {effect.correct_before} -> {effect.correct_after} / {effect.n}")


def test_refusals(reference):
    model, split, _, _, _ = reference
    with pytest.raises(ValueError, match="quantized_model"):
        layer_error(model, model, split.x_test[:32])
    with pytest.raises(ValueError, match="k=0"):
        suggest_skip(reference[-1], 0)
