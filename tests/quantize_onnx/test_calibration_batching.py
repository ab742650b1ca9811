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
