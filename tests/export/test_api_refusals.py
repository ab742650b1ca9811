"""The Python API refuses, in one line, what it cannot use (issue 38, the Python API): a sample with
NaN or infinite values before export_qdq does any work, and verify_qdq's sample given as a list of
batches or a numpy array (it takes one tensor), instead of a torch-internal traceback."""

import pytest
import torch

from quantship import DataRefused, Quantizer, export_qdq, verify_qdq
from tests.export.test_names import Classifier


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    sample = torch.randn(4, 3, 8, 8)
    return Quantizer().quantize(Classifier().eval(), [sample]), sample


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_export_qdq_refuses_a_non_finite_sample_before_any_work(quantized, bad, tmp_path, monkeypatch):
    import quantship.export.qdq as qdq

    qmodel, sample = quantized
    monkeypatch.setattr(qdq, "reference_outputs", lambda *a, **k: pytest.fail("work began on a bad sample"))
    poisoned = sample.clone()
    poisoned[0, 0, 0, 0] = bad
    with pytest.raises(DataRefused, match=r"the sample holds 1 NaN or infinite value\(s\) of 768"):
        export_qdq(qmodel, poisoned, tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_verify_qdq_takes_every_container_alike(quantized, tmp_path):
    """A list of batches or a numpy array (what docs/pytorch.md's `probe` suggests) gives the tensor's answer,
    never a traceback (inspect.read.feeds reads every form)."""
    qmodel, sample = quantized
    path = export_qdq(qmodel, sample, tmp_path / "m.onnx")
    expected = verify_qdq(qmodel, path, sample)
    assert 0.0 <= expected <= 1.0  # the one tensor (a batch-4 file)
    for given in (list(sample.split(4)), sample.numpy()):
        assert verify_qdq(qmodel, path, given) == expected
