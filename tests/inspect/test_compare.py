"""The three-way check on the reference task's float and INT8 files.

Measured (20 seeded standard-normal inputs, output LSB of the INT8 file):
  ONNX Runtime int8 vs float       : max 79.8 LSB, mean 27.7 LSB
  TiGrIS vs ONNX Runtime int8      : max 1.0 LSB,  mean 0.16 LSB
"""

from __future__ import annotations

import json

import pytest

from quantship.cli.main import main
from quantship.inspect.compare import compare_files
from quantship.inspect.consumers import tigris_executable


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


def test_compare_refuses_a_float_second_file(digits_files):
    with pytest.raises(ValueError, match="LSB"):
        compare_files(digits_files["float"], digits_files["float"])
