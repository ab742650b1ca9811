"""check_file: the rule tables per target, on our files and on ONNX Runtime's quantizer's files."""

from __future__ import annotations

import json

import onnx
import pytest

from quantship import targets
from quantship.inspect.judge.check import check_file
from quantship.inspect.judge.rules import RULES, TARGETS
from quantship.precision import PRESETS, preset
from tests.onnx_edits import strip_kernel_shape

ALL_TARGETS = ["onnxruntime", "tensorrt", "openvino", "tigris"]  # as users name them (onnxruntime: an alias)


def test_rule_tables_are_consistent():
    # one name per runtime: one Target holds its preset and its file rules, and an alias reads the same one
    assert list(TARGETS) == [p.target for p in PRESETS] == ["onnxruntime-cpu", "tensorrt", "openvino", "tigris"]
    assert all(targets.get(name) is preset(name) is TARGETS[preset(name).target] for name in ALL_TARGETS)
    for tgt in TARGETS.values():
        rules = tgt.file_rules
        assert set(rules.errors) <= set(RULES) and set(rules.warnings) <= set(RULES)
        assert not set(rules.errors) & set(rules.warnings)
    with pytest.raises(ValueError, match="valid targets"):
        check_file("whatever.onnx", "coreml")


@pytest.mark.parametrize("name", ["mobilenetv2", "resnet18"])
@pytest.mark.parametrize("target", ALL_TARGETS)
def test_our_pt2e_files_pass_every_target(files, name, target):
    report = check_file(files[name], target)
    assert report.ok, [f.message for f in report.findings]
    assert report.format == "QDQ" and report.errors == []


def test_conv_without_kernel_shape_fails_tensorrt_only(files, tmp_path):
    model = onnx.load(str(files["resnet18"]))
    stripped = strip_kernel_shape(model)
    path = tmp_path / "no_kernel_shape.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="no_kernel_shape.onnx.data")
    trt = check_file(path, "tensorrt")
    assert not trt.ok and [f.rule for f in trt.errors] == ["conv_kernel_shape"]
    assert len(trt.errors[0].offending) == stripped == 20
    assert check_file(path, "tigris").ok


def test_export_qdq_uint8_file_fails_tensorrt_passes_tigris(files):
    trt = check_file(files["resnet18_uint8"], "tensorrt")
    rules = {f.rule: f for f in trt.errors}
    assert not trt.ok and {"zero_point_zero", "activation_dtype"} <= set(rules)
    assert "zero-point 128" in rules["zero_point_zero"].message
    assert check_file(files["resnet18_uint8"], "tigris").ok


def test_onnxruntime_uint8_qdq_fails_tensorrt_passes_tigris(ort_files):
    assert not check_file(ort_files["uint8"], "tensorrt").ok
    assert check_file(ort_files["uint8"], "tigris").ok
    assert check_file(ort_files["uint8"], "openvino").ok


@pytest.mark.parametrize("name", ["qoperator", "dynamic"])
def test_qoperator_and_dynamic_fail_tigris_saying_qdq_and_static(ort_files, name):
    report = check_file(ort_files[name], "tigris")
    assert not report.ok
    for finding in report.errors:
        if finding.rule in ("qdq_format", "static_scales"):
            assert "QDQ" in finding.message and "static" in finding.message
    assert {"qdq_format", "static_scales"} & {f.rule for f in report.errors}
    if name == "dynamic":
        assert "static_scales" in {f.rule for f in report.errors}
    # ONNX Runtime runs these files: it only warns
    assert check_file(ort_files[name], "onnxruntime").ok


def test_partially_quantized_file_names_the_float_tensors(ort_files):
    report = check_file(ort_files["partial"], "tigris")
    assert not report.ok
    (finding,) = [f for f in report.errors if f.rule == "fully_quantized"]
    model = onnx.load(str(ort_files["partial"]))
    produced_by = {o: n.op_type for n in model.graph.node for o in n.output}
    # only Conv was quantized: every named tensor comes out of an operator the quantizer skipped
    assert finding.offending and all(produced_by[t] not in ("Conv", "QuantizeLinear", "DequantizeLinear")
                                     for t in finding.offending)
    assert model.graph.output[0].name in finding.offending  # the float Gemm output
    assert all(t in finding.message for t in finding.offending[:4])


def test_check_json_is_versioned(ort_files):
    data = json.loads(check_file(ort_files["qoperator"], "tigris").to_json())
    assert data["report"] == "quantship-check" and data["version"] == 1 and data["ok"] is False
    assert {"rule", "severity", "message", "offending", "fix"} <= set(data["findings"][0])
