"""Fidelity to FP32 read in the target's own runtime (issue 37, item 1): an openvino file is judged in
OpenVINO, a tigris file in TiGrIS's host runtime, where they run here; the repair's steps are read in ONNX
Runtime literally and the chosen file is confirmed in the runtime, which then is the file's fidelity."""

from __future__ import annotations

import json

import onnx
import pytest

from quantship.errors import FidelityMissed
from quantship.fidelity import METADATA_KEY, Budget
from quantship.inspect.run.consumers import native_runtime
from quantship.quantize_onnx import quantize_onnx
from quantship.quantize_onnx.repair import confirm_in_runtime
from quantship.targets import get
from tests.quantize_onnx import graphs

RUNTIMES = {"openvino": "OpenVINO", "tigris": "TiGrIS", "onnxruntime-cpu": "ONNX Runtime (default optimizations)"}


@pytest.fixture(scope="module")
def float_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rt") / "f.onnx"
    onnx.save(graphs.conv_relu_conv(), path)
    return path


@pytest.mark.parametrize("target", sorted(RUNTIMES))
def test_the_file_is_judged_in_its_targets_runtime(float_file, tmp_path, target):
    if target != "onnxruntime-cpu" and native_runtime(get(target)) is None:
        pytest.skip(f"{target}'s runtime is not installed here")
    x = graphs.images(40)
    result, _ = quantize_onnx(float_file, tmp_path / "q.onnx", x[:32], target=target, fidelity_data=x[32:])
    assert RUNTIMES[target] in result.fp32.runtime and result.fp32.status == "met"
    assert "8 sample(s) held out" in result.fp32.data
    stored = json.loads({p.key: p.value for p in onnx.load(tmp_path / "q.onnx").metadata_props}[METADATA_KEY])
    assert RUNTIMES[target] in stored["runtime"]


def test_a_file_that_misses_in_its_runtime_is_refused(float_file, tmp_path):
    """The confirmation itself: a budget the runtime's reading cannot keep is a refusal naming the runtime."""
    if native_runtime(get("openvino")) is None:
        pytest.skip("OpenVINO is not installed here")
    x = graphs.images(40)
    result, _ = quantize_onnx(float_file, tmp_path / "q.onnx", x[:32], target="openvino", fidelity_data=x[32:])
    with pytest.raises(FidelityMissed, match="not in OpenVINO"):
        confirm_in_runtime(result, float_file, x[:32], x[32:], Budget(min_sqnr_db=result.fp32.sqnr_db + 20))


@pytest.mark.parametrize("target", ["openvino", "tigris"])
def test_the_pytorch_path_confirms_in_the_runtime_too(tmp_path, monkeypatch, capsys, target):
    if native_runtime(get(target)) is None:
        pytest.skip(f"{target}'s runtime is not installed here")
    import numpy as np

    from quantship.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(
        "import torch\n\ndef build():\n    torch.manual_seed(0)\n    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), "
        "torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), "
        "torch.nn.Linear(8, 4))\n")
    np.save(tmp_path / "cal.npy", np.random.default_rng(0).standard_normal((40, 3, 16, 16)).astype(np.float32))
    code = main(["quantize", "net.py:build", "--calib", "cal.npy", "--target", target, "--out", "q.onnx", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    stored = json.loads({p.key: p.value for p in onnx.load(tmp_path / "q.onnx").metadata_props}[METADATA_KEY])
    assert RUNTIMES[target] in stored["runtime"], stored


def test_tigris_compiles_the_written_file_once_and_its_plan_runs_the_same(float_file, tmp_path, monkeypatch):
    """The runtime check and the fidelity confirmation read the same bytes: one ``tigris compile`` for both
    (the confirmation cost a second compile, about a quarter of an MTCNN ONet quantize); a file whose bytes
    differ (the confirmation's record added to the written file) is compiled again, and a reused plan gives the
    outputs its compile gave."""
    if native_runtime(get("tigris")) is None:
        pytest.skip("TiGrIS is not installed here")
    import numpy as np

    from quantship.inspect.run import consumers

    compiled = []
    real = consumers._tigris

    def counting(*args):  # the real CLI, counted
        compiled.extend(args[:1])
        return real(*args)

    monkeypatch.setattr(consumers, "_tigris", counting)
    x = graphs.images(40)
    quantize_onnx(float_file, tmp_path / "q.onnx", x[:32], target="tigris", fidelity_data=x[32:])
    assert compiled.count("compile") == 1
    model = onnx.load(tmp_path / "q.onnx")
    feeds = [{model.graph.input[0].name: x[k:k + 1]} for k in range(4)]
    fresh = consumers.run_tigris(tmp_path / "q.onnx", feeds, model)  # the confirmation's reading is in its metadata
    assert compiled.count("compile") == 2
    reused = consumers.run_tigris(tmp_path / "q.onnx", feeds, model)
    assert compiled.count("compile") == 2
    model.metadata_props.add(key="other", value="bytes")
    onnx.save(model, tmp_path / "other.onnx")
    consumers.run_tigris(tmp_path / "other.onnx", feeds, model)
    assert compiled.count("compile") == 3
    for a, b in zip(reused, fresh):
        np.testing.assert_array_equal(a[0], b[0])
