"""Metadata set on a written file without reading its graph (``external.set_metadata_streamed``, what
``add_file_metadata`` records after each measurement): the model read back is the one written, with the entries
set, the file's own kept in order; a file that is not a model is refused and left as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from quantship.export.metadata import add_file_metadata
from quantship.inspect.read import external


def _model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    helper.set_model_props(model, {"a": "1", "b": "2"})
    return model


def test_entries_are_set_and_everything_else_is_the_same_model(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_model(), str(path))
    add_file_metadata(path, {"b": "two", "c": "3"})
    read = onnx.load(str(path))
    assert [(p.key, p.value) for p in read.metadata_props] == [("a", "1"), ("b", "two"), ("c", "3")]
    expected = _model()
    del expected.metadata_props[:]
    del read.metadata_props[:]
    assert read == expected  # graph, tensors, opsets as written
    add_file_metadata(path, {"c": "three"})  # again: no entry twice
    assert [(p.key, p.value) for p in onnx.load(str(path)).metadata_props] == [("a", "1"), ("b", "two"),
                                                                                 ("c", "three")]
    onnx.checker.check_model(str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_bytes_that_are_no_model_are_refused_and_left(tmp_path):
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"\x0f\xff\xff")
    with pytest.raises(ValueError):
        external.set_metadata_streamed(path, {"a": "1"})
    assert path.read_bytes() == b"\x0f\xff\xff" and sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx"]


@pytest.mark.parametrize("own", [{"a": "1", "b": "2"}, {}])
def test_the_file_is_byte_for_byte_what_onnx_writes_and_openvino_reads_it(tmp_path, own):
    # field order matters to readers that sniff a file's first fields: OpenVINO refused the entries appended last
    model = _model()
    del model.metadata_props[:]
    helper.set_model_props(model, own)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    add_file_metadata(path, {"b": "two", "c": "3"})
    helper.set_model_props(model, {**own, "b": "two", "c": "3"})
    assert path.read_bytes() == model.SerializeToString()
    ov = pytest.importorskip("openvino", reason="OpenVINO is a pinned extra that make test installs")
    compiled = ov.Core().compile_model(str(path), "CPU")
    x = np.ones((1, 8), np.float32)
    np.testing.assert_allclose(compiled([x])[0], x @ np.arange(64, dtype=np.float32).reshape(8, 8))


def test_a_graph_written_after_its_metadata_comes_out_in_onnx_order(tmp_path):
    # onnx_ir writes the graph last; OpenVINO's reader refused such a file once the entries were set in place
    import onnx_ir as ir

    model = _model()
    path = tmp_path / "m.onnx"
    ir.save(ir.serde.deserialize_model(model), path)
    add_file_metadata(path, {"c": "3"})
    helper.set_model_props(model, {"a": "1", "b": "2", "c": "3"})
    read = onnx.load(str(path))
    assert path.read_bytes() == read.SerializeToString()  # ONNX's own field order
    assert [(p.key, p.value) for p in read.metadata_props] == [("a", "1"), ("b", "2"), ("c", "3")]
    assert onnx.helper.printable_graph(read.graph) == onnx.helper.printable_graph(model.graph)
