"""verify_qdq and compare_logits on the reference task: a trained model whose predictions vary."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from quantship import Quantizer, export_qdq
from quantship.cli.common import format_accuracy
from quantship.examples import digits
from quantship.inspect.run.verify import (
    DRIFT_LSB,
    FusedKernelDrift,
    Readings,
    Verification,
    compare_logits,
    ort_session,
    readings_of,
    run_session,
    split_batches,
    verify_qdq,
    warn_if_drift,
)
from quantship.intervals import wilson_interval

BATCH = 40  # divides the 360 held-out inputs: the pt2e graph runs at one batch size


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The trained digits model, its pt2e quantization, and the exported QDQ file."""
    split = digits.load_split()
    model = digits.trained_model()
    calib = [split.x_train[i:i + BATCH] for i in range(0, 4 * BATCH, BATCH)]
    quantized = Quantizer(backend="pt2e").quantize(model, calib, max_calibration_samples=4 * BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = export_qdq(quantized, split.x_test[:BATCH], tmp_path_factory.mktemp("digits") / "digits_qdq.onnx")
    path.drift_warnings = [w for w in caught if issubclass(w.category, FusedKernelDrift)]
    return split, model, quantized, path


@pytest.mark.slow
def test_agreement_on_the_held_out_split(task):
    split, model, quantized, path = task
    n_batches = len(split.y_test) // BATCH
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        agreement = verify_qdq(quantized, path, split.x_test, n_batches=n_batches)
    # predictions vary: no vacuity warning may fire (FusedKernelDrift may, on a CPU without VNNI)
    assert not [w for w in caught if "vacuous" in str(w.message)]
    assert len(split.y_test) >= 300
    print(f"verify_qdq agreement on {len(split.y_test)} held-out digits: {agreement:.4f}")
    assert agreement >= 0.99

    # accuracy of the float model and of the INT8 file, each k/n with its Wilson interval
    k_fp32, n = digits.evaluate(model, split.x_test, split.y_test)
    session = ort_session(path)
    preds = np.concatenate([run_session(session, [b.numpy()])[0].argmax(-1)
                            for b in split_batches(split.x_test, n_batches)])
    k_int8 = int((preds == split.y_test.numpy()).sum())
    assert np.unique(preds).size == 10  # the agreement is informative: every class is predicted
    print("FP32 torch:", format_accuracy(k_fp32, n))
    print("INT8 file (ORT):", format_accuracy(k_int8, n))
    lo, _ = wilson_interval(k_int8, n)
    assert lo >= 0.9  # a trained model: the file is accurate, not just agreeing on noise

    error = compare_logits(quantized, path, split.x_test, n_batches=n_batches)
    print("compare_logits:", error)
    assert error.max_lsb <= 2.0 + 1e-4 and error.n_values == 3600


def test_the_probe_may_be_a_tensor_an_array_a_list_of_batches_or_nothing(task):
    """A list of batches ended in AttributeError, a numpy array in a torch-internal RuntimeError (issue 38):
    every form is read by the one loader, and gives the tensor's figures."""
    split, _, quantized, path = task
    probe = split.x_test[:2 * BATCH]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FusedKernelDrift)
        tensor = verify_qdq(quantized, path, probe, n_batches=2)
        array = verify_qdq(quantized, path, probe.numpy(), n_batches=2)
        batches = verify_qdq(quantized, path, [probe[:BATCH], probe[BATCH:].numpy()])
        keyed = verify_qdq(quantized, path, [{"x": probe[:BATCH]}, {"x": probe[BATCH:]}])
        generated = verify_qdq(quantized, path)
    assert float(tensor) == float(array) == float(batches) == float(keyed)
    assert tensor.readings.literal_lsb == batches.readings.literal_lsb
    assert generated.readings.n_values > 0 and generated.readings.literal_lsb is not None


def test_unequal_batches_are_refused(task):
    split, _, quantized, path = task
    with pytest.raises(ValueError, match="divisors of 360"):
        verify_qdq(quantized, path, split.x_test, n_batches=7)
    with pytest.raises(ValueError, match="exported at batch size 40"):
        verify_qdq(quantized, path, split.x_test, n_batches=4)


def test_constant_predictions_warn_that_the_check_is_vacuous(task):
    split, _, _, path = task

    class Constant(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.one_hot(torch.full((x.shape[0],), 3), 10).float()

    with pytest.warns(UserWarning, match="vacuous"):
        verify_qdq(Constant(), path, split.x_test[:2 * BATCH], n_batches=2)


def test_compare_logits_needs_a_quantized_output(task, tmp_path):
    from quantship import export_onnx

    split, model, _, _ = task
    float_path = export_onnx(model, split.x_test[:BATCH], tmp_path / "f.onnx", dynamic_batch=False)
    with pytest.raises(ValueError, match="no quantization step"):
        compare_logits(model, float_path, split.x_test[:BATCH])


def _finite(x) -> bool:
    return x is not None and np.isfinite(x)


def test_export_qdq_returns_a_path_with_both_readings(task):
    """export_qdq ran the written file literally and fused on its sample: both figures are there,
    and FusedKernelDrift was warned exactly when they differ by more than 2 LSB."""
    from pathlib import Path

    *_, path = task
    assert isinstance(path, Path) and path.is_file()
    r = path.readings
    assert _finite(r.literal_lsb) and _finite(r.fused_lsb) and _finite(r.gap_lsb), r
    assert r.literal_lsb <= 2.0 + 1e-4  # the literal reading is the file's own arithmetic
    assert r.n_values == BATCH * 10 and r.scale > 0
    assert len(path.drift_warnings) == int(r.drifts) and r.drifts == (r.gap_lsb > DRIFT_LSB + 1e-3), r
    print("export_qdq readings on this CPU:", r)


def test_verify_qdq_result_is_a_float_carrying_both_readings(task):
    split, _, quantized, path = task
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = verify_qdq(quantized, path, split.x_test[:2 * BATCH], n_batches=2)
    assert isinstance(result, Verification) and isinstance(result, float)
    r = result.readings
    assert float(result) == r.literal_agreement and 0.0 <= r.fused_agreement <= 1.0
    assert f"{result:.2f}" == f"{r.literal_agreement:.2f}" and str(result) == repr(float(result))
    assert _finite(r.literal_lsb) and _finite(r.fused_lsb) and _finite(r.gap_lsb)
    drifted = [w for w in caught if issubclass(w.category, FusedKernelDrift)]
    assert len(drifted) == int(r.drifts) and r.drifts == (r.gap_lsb > DRIFT_LSB + 1e-3), (r, drifted)
    optimized = verify_qdq(quantized, path, split.x_test[:2 * BATCH], n_batches=2, optimized=True)
    assert float(optimized) == optimized.readings.fused_agreement


def test_drift_warning_fires_only_beyond_2_lsb():
    """The warning logic on synthetic readings: 3 LSB apart warns once, naming cause and fixes; 2 does not."""
    scale = 0.05
    literal = np.zeros((4, 10), np.float32)
    reference = literal.copy()
    far = readings_of(literal, literal + 3 * scale, scale, reference)
    near = readings_of(literal, literal + 2 * scale, scale, reference)
    assert abs(far.gap_lsb - 3.0) < 1e-4 and abs(near.gap_lsb - 2.0) < 1e-4
    assert far.literal_lsb == 0.0 and abs(far.fused_lsb - 3.0) < 1e-4 and far.drifts and not near.drifts
    with pytest.warns(FusedKernelDrift) as record:
        assert warn_if_drift(far, "model.onnx")
    assert len(record) == 1
    message = str(record[0].message)
    for words in ("3.0 LSB", "VNNI", "u8 x s8", "target='onnxruntime-cpu'", "reduce_range=True"):
        assert words in message, message
    with pytest.warns(FusedKernelDrift) as record:  # a 7-bit file is not told to use 7 bits
        assert warn_if_drift(far, "model.onnx", seven_bit=True)
    message = str(record[0].message)
    assert "already use 7 bits" in message and "requantize" in message and "reduce_range=True" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_drift(near, "model.onnx")
        # no output scale (a float output): no LSB figure, no warning
        assert not warn_if_drift(readings_of(literal, literal + 1.0, None, reference), "model.onnx")
    assert issubclass(FusedKernelDrift, UserWarning)
    assert Readings(None, None, None, None, 0).drifts is False
