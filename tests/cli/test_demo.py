"""`quantship demo`: the main job on the built-in reference task, every figure read off the artifacts."""

import json
from pathlib import Path

import pytest

from quantship.cli.main import main


@pytest.mark.slow
def test_demo_table(tmp_path, capsys):
    assert main(["demo", "--out-dir", str(tmp_path), "--runs", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    k_fp32, n = report["accuracy"]["fp32_torch"]
    k_file, n_file = report["accuracy"]["int8_onnxruntime"]
    assert n == n_file == 360
    # the trained reference model is accurate, and the INT8 file (run by ONNX Runtime with its fused
    # kernels) loses at most a couple of images: 7-bit weights keep AVX2's u8s8 kernels exact enough
    assert k_fp32 >= 350 and k_file >= k_fp32 - 3, report["accuracy"]
    assert report["agreement_int8_file_vs_torch"] >= 0.99
    assert report["logit_error_vs_torch"]["max_lsb"] <= 2.0 + 1e-4
    # figures read off the artifacts: the sizes are the files' own, the ratios follow from them
    sizes = report["size_bytes"]
    on_disk = {k: sum(p.stat().st_size for p in tmp_path.iterdir() if p.name.startswith(Path(report["files"][k]).name))
               for k in ("fp32", "int8")}
    assert (sizes["fp32"], sizes["int8"]) == (on_disk["fp32"], on_disk["int8"])
    assert sizes["ratio"] == pytest.approx(sizes["fp32"] / sizes["int8"]) and sizes["ratio"] > 1.0
    assert report["qdq_stats"]["n_uint8"] > 0 and report["qdq_stats"]["n_per_channel"] == 7
    assert report["checks"]["onnxruntime-cpu"]["ok"] and report["checks"]["tigris"]["ok"]
    assert not report["checks"]["tensorrt"]["ok"]  # uint8 zero-point 128: the ORT preset is not for TensorRT
    latency = report["latency_ms"]
    assert latency["runs"] == 5 and latency["batch"] == 40
    assert 0 < latency["fp32"] < 10_000 and 0 < latency["int8"] < 10_000  # milliseconds, measured
    assert latency["speedup"] == pytest.approx(latency["fp32"] / latency["int8"])
    assert (tmp_path / "digits_int8_onnxruntime-cpu.onnx").is_file()
