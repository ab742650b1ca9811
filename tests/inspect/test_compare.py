"""The three-way check on the reference task's float and INT8 files.

Measured (20 seeded standard-normal inputs, output LSB of the INT8 file):
  ONNX Runtime int8 vs float       : max 79.8 LSB, mean 27.7 LSB
  TiGrIS vs ONNX Runtime int8      : max 1.0 LSB,  mean 0.16 LSB
"""

from __future__ import annotations

import json

import pytest

from quantship.cli.main import main
from quantship.inspect.judge.compare import compare_files
from quantship.inspect.run.consumers import tigris_executable


@pytest.mark.slow
def test_compare_rows(digits_files):
    if tigris_executable() is None:
        pytest.skip("tigris CLI not installed")
    report = compare_files(digits_files["float"], digits_files["int8"], target="tigris", n_inputs=20)
    quant, runtime = report.rows
    assert quant.label == "ONNX Runtime int8 vs float" and runtime.label == "TiGrIS vs ONNX Runtime int8"
    assert quant.max_lsb > 0 and 0 <= quant.mean_lsb <= quant.max_lsb
    # the runtime adds far less than quantization costs (the seed document's expectation)
    assert runtime.max_lsb is not None and runtime.max_lsb < quant.max_lsb


def test_compare_cli_prints_two_rows(digits_files, capsys):
    assert main(["compare", str(digits_files["float"]), str(digits_files["int8"]),
                 "--target", "onnxruntime", "--n", "4"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "LSB" in ln and ":" in ln]
    assert len(lines) == 2 and "vs float" in lines[0] and "max" in lines[1]
    assert main(["compare", str(digits_files["float"]), str(digits_files["int8"]), "--target", "tensorrt",
                 "--n", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["version"] == 1 and data["rows"][1]["max_lsb"] is None
    # counts say what they count: runs (one batch each) and the inputs in them (a batch-1 file: equal)
    assert data["n_batches"] == 2 and data["n_samples"] == 2 and "n_inputs" not in data


def test_compare_refuses_a_float_second_file(digits_files):
    with pytest.raises(ValueError, match="LSB"):
        compare_files(digits_files["float"], digits_files["float"])


def test_compare_on_real_inputs_is_far_smaller_than_on_noise(digits_files, tmp_path, capsys):
    """Random inputs overstate what quantization costs a model calibrated on real data."""
    import numpy as np

    from quantship.examples.digits import load_split

    real = load_split().x_test[:24].numpy()
    on_real = compare_files(digits_files["float"], digits_files["int8"], target="onnxruntime", inputs=real)
    on_noise = compare_files(digits_files["float"], digits_files["int8"], target="onnxruntime", n_inputs=24)
    assert on_real.n_batches == 24 and on_real.n_samples == 24  # batch 1 file: one feed per image
    assert on_real.rows[0].max_lsb < on_noise.rows[0].max_lsb
    np.save(tmp_path / "x.npy", real)
    assert main(["compare", str(digits_files["float"]), str(digits_files["int8"]), "--target", "onnxruntime",
                 "--inputs", str(tmp_path / "x.npy")]) == 0
    assert "24 from " in (out := capsys.readouterr().out) and "input(s) in 24 batch(es)" in out
    with pytest.raises(ValueError, match="dimension 1 is 3, not 1"):
        compare_files(digits_files["float"], digits_files["int8"], inputs=np.zeros((4, 3, 32, 32), np.float32))
