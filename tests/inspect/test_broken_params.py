"""check refuses broken quantization parameters for every target, naming the node and the value;
the readers refuse unreadable fields (FileRefused naming the file and the field); JSON stays strict."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from quantship.errors import FileRefused
from quantship.inspect.judge.check import check_file
from quantship.inspect.read.graph import inspect_file
from quantship.inspect.read.stats import qdq_stats
from tests.inspect.broken_files import CASES, MICROSOFT_DOMAIN, REGISTERED_DOMAIN, Broken, weight_dequantize, write

TARGETS = ("onnxruntime", "openvino", "tigris", "tensorrt")


@pytest.fixture(scope="module")
def broken(small_qdq, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    return {case.name: write(case, small_qdq, root) for case in (*CASES, REGISTERED_DOMAIN, MICROSOFT_DOMAIN)}


def _refusal(path, target) -> str | None:
    """The refusal's text (an error finding, or the reader's FileRefused); None when accepted."""
    try:
        report = check_file(path, target)
    except FileRefused as exc:
        return str(exc)
    return " ".join(f.message for f in report.errors) or None


def test_the_unbroken_file_is_accepted_everywhere(small_qdq):
    for target in TARGETS:
        assert check_file(small_qdq, target).ok


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_target_refuses_a_broken_file_naming_it(broken, case: Broken):
    for target in TARGETS:
        refusal = _refusal(broken[case.name], target)
        assert refusal is not None, f"{target} accepted {case.name}"
        assert case.named in refusal, (target, refusal)


def test_scale_refusal_names_node_tensor_and_value(broken):
    report = check_file(broken["weight scale 1e-45"], "onnxruntime")
    (finding,) = report.errors
    assert finding.rule == "valid_parameters" and finding.severity == "error"
    scale = weight_dequantize(onnx.load(str(broken["weight scale 1e-45"]))).input[1]
    assert f"node_dequantize_per_channel: scale '{scale}'[1] = 1.401298464324817e-45: denormal" in finding.offending[0]
    nan = check_file(broken["activation scale nan"], "openvino").errors[0]
    assert any("= nan: not finite" in o for o in nan.offending) and len(nan.offending) == 2  # its Q and DQ


def test_domains_follow_the_target(broken):
    registered, microsoft = broken[REGISTERED_DOMAIN.name], broken[MICROSOFT_DOMAIN.name]
    assert check_file(registered, "onnxruntime").ok and check_file(registered, "openvino").ok
    assert check_file(microsoft, "onnxruntime").ok
    for path, targets in ((registered, ("tigris", "tensorrt")), (microsoft, ("openvino", "tigris", "tensorrt"))):
        for target in targets:
            assert "op_domains" in {f.rule for f in check_file(path, target).errors}


def _edited(small_qdq, tmp_path, edit) -> str:
    model = onnx.load(str(small_qdq))
    edit(model)
    path = tmp_path / "edited.onnx"
    onnx.save(model, str(path))
    return path


def _refused_by_every_reader(path, *words):
    for read in (inspect_file, qdq_stats, lambda p: check_file(p, "tigris")):
        with pytest.raises(FileRefused) as info:
            read(path)
        message = str(info.value)
        assert "\n" not in message and str(path) in message and all(w in message for w in words), message


def test_unknown_element_type_is_refused_naming_the_field(small_qdq, tmp_path):
    def edit(model):
        model.graph.output[0].type.tensor_type.elem_type = 99
    _refused_by_every_reader(_edited(small_qdq, tmp_path, edit), "output", "element type 99")


def test_deep_or_non_finite_spec_json_is_refused(small_qdq, tmp_path):
    for text, words in (("[" * 100_000 + "]" * 100_000, ("quantship.spec", "nested")),
                        ('{"a":' * 40 + "1" + "}" * 40, ("quantship.spec", "nested")),
                        ('{"backend": NaN}', ("quantship.spec", "NaN")),
                        ('{"backend": 1e999}', ("quantship.spec", "inf"))):
        def edit(model, text=text):
            onnx.helper.set_model_props(model, {"quantship.spec": text})
        _refused_by_every_reader(_edited(small_qdq, tmp_path, edit), *words)


def test_absurd_dimension_is_refused(small_qdq, tmp_path):
    def edit(model):
        model.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 1 << 50
    _refused_by_every_reader(_edited(small_qdq, tmp_path, edit), "input 'x'", str(1 << 50))


def test_empty_and_non_onnx_files_are_refused_not_counted(tmp_path):
    empty, text = tmp_path / "empty.onnx", tmp_path / "text.onnx"
    empty.write_bytes(b"")
    text.write_text("not a model\n" * 10)
    for path, word in ((empty, "empty"), (text, "not an ONNX model")):
        with pytest.raises(FileRefused, match=word):
            qdq_stats(path)


def test_inspect_json_is_strict_with_a_note_for_a_nan_scale(small_qdq, tmp_path):
    def edit(model):
        name = next(n for n in model.graph.node if n.op_type == "QuantizeLinear").input[1]
        tensor = next(t for t in model.graph.initializer if t.name == name)
        tensor.CopyFrom(numpy_helper.from_array(np.array(np.nan, dtype=np.float32), name))
    path = _edited(small_qdq, tmp_path, edit)
    text = inspect_file(path).to_json()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
    assert data["inputs"][0]["scale"] is None
    assert data["notes"] == ["inputs[0].scale is nan, not a JSON number: written as null"]
    assert "valid_parameters" in json.loads(check_file(path, "onnxruntime").to_json())["findings"][0]["rule"]


def test_an_in_memory_graph_with_a_cycle_is_refused_not_walked_forever(small_qdq):
    model = onnx.load(str(small_qdq))
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    relu.input[0] = relu.output[0]
    with pytest.raises(FileRefused, match="before it is produced"):
        qdq_stats(model)


def test_inspect_cli_json_is_strict(small_qdq, tmp_path, capsys):
    from quantship.cli.main import main

    def edit(model):
        output = model.graph.output[0].name
        name = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == output).input[1]
        tensor = next(t for t in model.graph.initializer if t.name == name)
        tensor.CopyFrom(numpy_helper.from_array(np.array(np.inf, dtype=np.float32), name))
    path = _edited(small_qdq, tmp_path, edit)
    assert main(["inspect", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
    assert data["outputs"][0]["scale"] is None and "outputs[0].scale is inf" in data["notes"][0]
