"""The ONNX path's ranges do not depend on how the calibration data is batched.

The same 32 samples given as one batch, as batches of 4 and one at a time must give the same file. They
did not: each batch's histogram counted a strided sample of at most 2^18 values of the whole batch (so a
larger batch was sampled more sparsely, and its tail differently), and a batch that widened a range
re-binned what was counted before (nudenet: 164 of its 284 scales differed between one batch of 32 crops and
batches of 4; docs/fidelity.md). Now the histograms are counted in a second pass on each tensor's exact range,
each sample strided alike, as the PyTorch path calibrates.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from quantship.quantize_onnx import calibrate, quantize_onnx_file

from .graphs import conv_relu_conv, save

BATCHINGS = {"one batch": lambda x: x, "batches of 4": lambda x: [x[i:i + 4] for i in range(0, len(x), 4)],
             "one at a time": lambda x: [x[i:i + 1] for i in range(len(x))]}


@pytest.fixture(scope="module")
def heavy_tailed(tmp_path_factory):
    """conv -> relu -> conv over 64x64 maps (32,768 values per sample after the first conv, so a batch of 32
    exceeds the old per-batch sample), fed heavy-tailed data whose widest samples come last."""
    m = conv_relu_conv()
    for v in [*m.graph.input, *m.graph.output]:
        for d in v.type.tensor_type.shape.dim[2:]:
            d.dim_param = "side"
    path = save(m, tmp_path_factory.mktemp("batching") / "float.onnx")
    rng = np.random.default_rng(1)
    x = rng.laplace(size=(32, 3, 64, 64)).astype(np.float32) ** 3
    x *= np.linspace(0.5, 2.0, 32, dtype=np.float32)[:, None, None, None]
    return path, x


def _scales(path) -> dict[str, np.ndarray]:
    m = onnx.load(str(path))
    return {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer if t.name.endswith(("_scale", "_zero_point"))}


def test_the_histogram_ranges_are_the_same_however_the_calibration_is_batched(heavy_tailed):
    path, x = heavy_tailed
    model = onnx.load(str(path))
    info = calibrate.probe(model, {"x": x[:1]})
    found = {}
    for name, batch in BATCHINGS.items():
        given = batch(x)
        feeds = [{"x": b} for b in (given if isinstance(given, list) else [given])]
        observers = calibrate.observe(model, feeds, ["x", "r1", "y"], info, observer="histogram", symmetric=False)
        found[name] = [observers[t].qparams(False) for t in ("x", "r1", "y")]
        # sliced by the memory budget too (one row at a time): still the same counts
        sliced = calibrate.observe(model, feeds, ["x", "r1", "y"], info, observer="histogram", symmetric=False,
                                   budget=1)
        assert [sliced[t].qparams(False) for t in ("x", "r1", "y")] == found[name], name
    assert found["one batch"] == found["batches of 4"] == found["one at a time"], found
    # the input's range is clipped in its tail (the histogram's search did its job), not the min/max
    scale, zero = found["one batch"][0]
    assert (127 - zero) * scale < 0.5 * float(x.max())


def test_the_written_file_is_the_same_however_the_calibration_is_batched(heavy_tailed, tmp_path):
    path, x = heavy_tailed
    written = {}
    for name, batch in BATCHINGS.items():
        out = tmp_path / f"{name.replace(' ', '_')}.onnx"
        quantize_onnx_file(path, out, batch(x), target="onnxruntime-cpu", run_check=False)
        written[name] = _scales(out)
    first = written["one batch"]
    assert first and any(k.startswith("r1") for k in first)
    for name, scales in written.items():
        assert scales.keys() == first.keys(), name
        for key, value in scales.items():
            assert value.dtype == first[key].dtype and np.array_equal(value, first[key]), (name, key)


def test_both_paths_count_the_same_values_of_a_large_activation():
    """One observer rule on both paths: a tensor of 81,920 values per sample (more than the 65,536 a histogram
    counts) calibrated by the PyTorch path's two passes (``quantize.calibration.run_batches``) and by the ONNX
    path's (``calibrate.TensorObserver``) ends with the same histogram and the same scale. Before, the PyTorch
    path counted every value and the ONNX path a strided sample, so one model's ranges depended on the entry
    point (the PP-OCR detector's: 15% apart on one tensor)."""
    import torch

    from quantship.calibration import OBSERVED_PER_SAMPLE
    from quantship.quantize.calibration import run_batches

    make = calibrate.observer_factory("histogram")

    class Observed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.obs = make(dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_affine)

        def forward(self, x):
            return self.obs(x)

    rng = np.random.default_rng(4)
    x = (rng.laplace(size=(6, 4, 128, 160)) ** 3).astype(np.float32)
    assert x[0].size > OBSERVED_PER_SAMPLE
    batches = [x[:2], x[2:3], x[3:]]
    torch_side = Observed()
    run_batches(torch_side, [torch.from_numpy(b) for b in batches])
    onnx_side = calibrate.TensorObserver(make, torch.per_tensor_affine)
    for b in batches:
        onnx_side(b)
    onnx_side.on_range()
    for b in batches:
        onnx_side.count(b)
    assert torch.equal(torch_side.obs.histogram, onnx_side.observer.histogram)
    assert float(torch_side.obs.histogram.sum()) < x.size  # a sample was counted, not every value
    scale, zero = torch_side.obs.calculate_qparams()
    assert (float(scale), int(zero)) == onnx_side.qparams(False)
