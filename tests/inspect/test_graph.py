"""inspect_file: census, format, boundaries, naive peak (against TiGrIS), and refusals of bad files."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from quantship.inspect.read.graph import inspect_file
from quantship.inspect.read.memory import naive_peak
from quantship.inspect.read.view import GraphView
from quantship.inspect.run.consumers import tigris_analyze, tigris_executable
from tests.inspect.conftest import with_external_data

# Measured on this machine (pt2e, batch 1): both tools report the same unscheduled peak.
#   MobileNetV2 96x96: inspect 276,480 B, tigris analyze 276,480 B
#   ResNet-18 224x224: inspect 1,003,520 B, tigris analyze 1,003,520 B (980.00 KiB)
PEAK_TOLERANCE = 0.05


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mobilenetv2", "resnet18"])
def test_naive_peak_agrees_with_tigris_unscheduled(files, name):
    if tigris_executable() is None:
        pytest.skip("tigris CLI not installed")
    report = inspect_file(files[name])
    theirs = tigris_analyze(files[name])["model"]
    ours = report.memory.naive_peak_bytes_int8
    assert abs(ours - theirs["unscheduled_peak_bytes"]) <= PEAK_TOLERANCE * theirs["unscheduled_peak_bytes"]
    assert report.memory.largest_tensor_int8.bytes == theirs["largest_tensor"]["bytes"]
    assert "x".join(map(str, report.memory.largest_tensor_int8.shape)) == theirs["largest_tensor"]["shape"]


def test_resnet18_report_reads_the_file(files):
    report = inspect_file(files["resnet18"])
    model = onnx.load(str(files["resnet18"]), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert report.format == "QDQ" and report.float_tensors == []
    assert report.operators["Conv"] == ops.count("Conv") == 20
    assert report.n_quantize == ops.count("QuantizeLinear") and report.n_dequantize == ops.count("DequantizeLinear")
    assert report.n_per_channel == 21  # 20 convs + fc (SPEC §6)
    assert report.activation_dtypes == ["int8"]
    assert report.quant_spec is not None and report.quant_spec["backend"] == "pt2e"  # export_qdq's metadata
    (inp,), (out,) = report.inputs, report.outputs
    assert inp.dtype == "float32" and inp.stored_as == "int8" and inp.zero_point == 0 and inp.scale > 0
    assert out.shape == [1, 1000] and out.stored_as == "int8" and out.scale > 0
    # weights: ~11.7M int8 parameters plus float biases and scales
    assert 11_000_000 < report.weight_bytes < 12_500_000
    # the file holds float32 between Q/DQ pairs: the largest tensor is 4 bytes per element there
    assert report.memory.largest_tensor.bytes == 4 * report.memory.largest_tensor_int8.bytes
    assert report.memory.naive_peak_bytes > report.memory.naive_peak_bytes_int8


def test_json_is_versioned(files):
    data = json.loads(inspect_file(files["resnet18"]).to_json())
    assert data["report"] == "quantship-inspect" and data["version"] == 1
    assert data["memory"]["naive_peak_bytes_int8"] > 0


@pytest.mark.parametrize("name,expected", [
    ("float", "float"), ("uint8", "QDQ"), ("qoperator", "QOperator"), ("dynamic", "dynamic"), ("partial", "mixed"),
])
def test_formats_of_onnxruntime_quantizer_files(ort_files, name, expected):
    report = inspect_file(ort_files[name])
    assert report.format == expected
    if name == "uint8":
        assert report.activation_dtypes == ["uint8"] and report.inputs[0].stored_as == "uint8"


def _chain(ops: list[str], shape=(1, 8, 4, 4)) -> onnx.ModelProto:
    """x -> op -> op ... -> y with float32 tensors of ``shape`` (shape-only ops keep it)."""
    nodes, prev, inits = [], "x", []
    for i, op in enumerate(ops):
        out = "y" if i == len(ops) - 1 else f"t{i}"
        inputs = [prev]
        if op == "Reshape":
            inits.append(onnx.numpy_helper.from_array(np.array(shape, np.int64), f"s{i}"))
            inputs.append(f"s{i}")
        nodes.append(helper.make_node(op, inputs, [out]))
        prev = out
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_liveness_by_hand():
    size = 1 * 8 * 4 * 4 * 4  # 512 bytes per float32 tensor
    # x live from step 0 until its consumer; at each step one input and one output are live
    assert naive_peak(GraphView.of(_chain(["Relu", "Relu", "Relu"]))).peak_bytes == 2 * size
    # a Reshape shares its input's storage: no extra tensor
    assert naive_peak(GraphView.of(_chain(["Relu", "Reshape", "Relu"]))).peak_bytes == 2 * size
    # sizes round up to 32 bytes, and at one byte per element
    odd = naive_peak(GraphView.of(_chain(["Relu"], shape=(1, 3, 3, 3))), one_byte=True)
    assert odd.peak_bytes == 2 * 32 and odd.largest.bytes == 32


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text.strip()
    return text


def test_not_onnx_is_refused(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("this is a text file, not a model\n" * 20)
    with pytest.raises(ValueError, match="not an ONNX model"):
        inspect_file(path)


def test_truncated_file_is_refused(files, tmp_path):
    data = files["resnet18"].read_bytes()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as info:
        inspect_file(path)
    assert "truncated" in _one_line(info.value)


def test_truncated_external_data_is_refused(files, tmp_path):
    path = with_external_data(files["resnet18"], tmp_path / "ext.onnx")
    data_file = tmp_path / "ext.onnx.data"
    data_file.write_bytes(data_file.read_bytes()[:1000])
    with pytest.raises(ValueError, match="truncated") as info:
        inspect_file(path)
    _one_line(info.value)


def test_missing_external_data_is_refused(files, tmp_path):
    path = with_external_data(files["resnet18"], tmp_path / "ext.onnx")
    (tmp_path / "ext.onnx.data").unlink()
    with pytest.raises(FileNotFoundError, match="external data") as info:
        inspect_file(path)
    _one_line(info.value)


def test_empty_graph_is_refused(tmp_path):
    graph = helper.make_graph([], "empty", [], [])
    path = tmp_path / "empty.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    with pytest.raises(ValueError, match="empty") as info:
        inspect_file(path)
    _one_line(info.value)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        inspect_file(tmp_path / "nope.onnx")
