"""A small classifier whose hidden activation carries one outlier channel: with min/max ranges its
per-tensor int8 scale rounds every other channel to a few levels, so top-1 falls unless the reader of
that activation (``fc2``) stays float. Labels are the float file's own predictions (top-1 100%)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tests.quantize_onnx import graphs

FEATURES, HIDDEN, CLASSES = 16, 16, 10


def model() -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    w1 = rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32) * 0.5
    w1[:, 0] *= 400.0  # the outlier channel: the range of h is set by it alone
    w2 = rng.standard_normal((HIDDEN, CLASSES)).astype(np.float32)
    w2[0, :] = 0.0  # and the classes do not read it
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("MatMul", ["h", "w2"], ["logits"], name="fc2")]
    return graphs.model(nodes, [graphs.value("x", ["n", FEATURES])], [graphs.value("logits", ["n", CLASSES])],
                        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])


def files(folder: Path, n: int = 256) -> dict[str, Path]:
    """The float file, calibration data and labelled data (y = the float file's argmax) in ``folder``."""
    import onnxruntime as ort

    path = graphs.save(model(), folder / "outlier.onnx")
    x = np.random.default_rng(3).standard_normal((n, FEATURES)).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y = session.run(None, {"x": x})[0].argmax(-1)
    np.save(folder / "outlier_cal.npy", x[: n // 2])
    np.savez(folder / "outlier_eval.npz", x=x[n // 2:], y=y[n // 2:])
    return {"float": path, "calib": folder / "outlier_cal.npy", "eval": folder / "outlier_eval.npz"}
