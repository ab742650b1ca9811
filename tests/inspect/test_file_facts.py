"""One read of a file: every reader (counts, report, rules, scales, spec, post-conditions) takes its
figures from the same ``FileFacts``, built from one load and one shape inference."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

import quantship.inspect.read.facts as facts_module
from quantship.export import postconditions
from quantship.inspect.judge.check import check_file
from quantship.inspect.read.facts import FileFacts, read_file
from quantship.inspect.read.graph import inspect_file
from quantship.inspect.read.lsb import output_scales
from quantship.inspect.read.stats import QDQStats, qdq_stats, quant_spec_of_file
from quantship.precision import preset

TARGETS = ("onnxruntime", "openvino", "tigris", "tensorrt")


@pytest.fixture
def counted(monkeypatch):
    """Count file loads and shape inferences made through the facts reader."""
    calls = {"load": 0, "infer": 0}
    real_load, real_infer = facts_module.load_onnx, onnx.shape_inference.infer_shapes

    def load(path):
        calls["load"] += 1
        return real_load(path)

    def infer(*args, **kwargs):
        calls["infer"] += 1
        return real_infer(*args, **kwargs)

    monkeypatch.setattr(facts_module, "load_onnx", load)
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", infer)
    return calls


def test_resnet18_reference_figures(files):
    # the ResNet-18 reference file: 33 Q / 54 DQ / 21 per-channel, symmetric, every conv->add quantized
    assert qdq_stats(files["resnet18"]) == QDQStats(
        n_quantize=33, n_dequantize=54, n_per_channel=21, n_nonzero_zero_point=0, n_unquantized_conv_add=0,
        n_uint8=0, n_float_compute=0)


def test_every_reader_agrees_on_one_file(small_qdq):
    facts = read_file(small_qdq)
    stats, report = qdq_stats(small_qdq), inspect_file(small_qdq)
    assert isinstance(facts, FileFacts) and stats == facts.stats and (stats.n_quantize, stats.n_dequantize) == (7, 10)
    assert (report.n_quantize, report.n_dequantize, report.n_per_channel) == \
        (stats.n_quantize, stats.n_dequantize, stats.n_per_channel)
    assert report.format == "QDQ" and report.as_dict() == inspect_file(facts).as_dict()
    for target in TARGETS:
        by_path, by_facts = check_file(small_qdq, target), check_file(facts, target)
        assert by_path.ok and by_path.as_dict() == by_facts.as_dict()
        assert by_path.report.n_dequantize == stats.n_dequantize
    (scale,) = output_scales(small_qdq).values()
    assert scale == report.outputs[0].scale > 0
    assert quant_spec_of_file(small_qdq) == quant_spec_of_file(facts) is not None


def test_one_load_and_one_inference_serve_every_question(small_qdq, counted):
    facts = read_file(small_qdq)
    qdq_stats(facts), inspect_file(facts), output_scales(facts), quant_spec_of_file(facts)
    for target in TARGETS:
        check_file(facts, target)
    assert counted == {"load": 1, "infer": 1}


def test_export_postconditions_read_the_written_file_once(small_qdq, counted):
    spec = quant_spec_of_file(small_qdq)
    counted.update(load=0, infer=0)
    facts = postconditions.read_written(small_qdq)  # what export_qdq does: one read, handed to every check
    stats = postconditions.check_spec_held(facts, spec, activation_dtype="int8", opset_version=18)
    for target in ("tigris", "openvino", "onnxruntime-cpu"):
        postconditions.check_target(facts, preset(target))
    assert counted == {"load": 1, "infer": 1} and stats == qdq_stats(facts)


def test_postconditions_keep_nothing_between_calls(small_qdq, tmp_path, counted):
    """A file rewritten in place (same path, maybe the same size and timestamp tick) is read anew: the
    post-conditions hold no process-wide cache of the last file."""
    path = tmp_path / "copy.onnx"
    path.write_bytes(small_qdq.read_bytes())
    counted.update(load=0, infer=0)
    first = postconditions.read_written(path)
    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, {"note": "changed"})
    onnx.save(model, str(path))
    second = postconditions.read_written(path)
    assert second is not first and counted["load"] == 2
    assert dict((p.key, p.value) for p in second.model.metadata_props).get("note") == "changed"


def test_output_scale_is_read_through_unsqueeze():
    """lsb used to look through Reshape/Flatten/Squeeze/Identity only; the view's shape-op set has Unsqueeze."""
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
        helper.make_node("Unsqueeze", ["d", "axes"], ["y"]),
    ]
    inits = [helper.make_tensor("s", TensorProto.FLOAT, [], [0.25]), helper.make_tensor("z", TensorProto.INT8, [], [0]),
             helper.make_tensor("axes", TensorProto.INT64, [1], [0])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert output_scales(model) == {"y": 0.25}
    assert inspect_file(model).outputs[0].scale == 0.25


def test_facts_of_refuses_what_is_not_a_file():
    with pytest.raises(TypeError, match="FileFacts"):
        qdq_stats(42)


def test_the_graph_is_read_without_its_weights(small_qdq, tmp_path):
    """``graph_without_weights`` gives the model as onnx reads it, the initializers' stored bytes left out; external
    references and every other field are kept; bytes that are not a protobuf message are refused."""
    import onnx
    import pytest

    from quantship.inspect.read import external

    full = onnx.load(str(small_qdq))
    light = external.graph_without_weights(small_qdq)
    assert any(t.raw_data for t in full.graph.initializer)
    assert not any(t.raw_data for t in light.graph.initializer)
    for t in full.graph.initializer:
        t.ClearField("raw_data")
    assert light.SerializeToString() == full.SerializeToString()

    moved = tmp_path / "moved.onnx"
    onnx.save_model(onnx.load(str(small_qdq)), str(moved), save_as_external_data=True, location="moved.data",
                    size_threshold=0)
    assert external.locations(external.graph_without_weights(moved)) == {"moved.data"}
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x0b" * 64)  # a field of wire type 3 (a group): no ONNX file holds one
    with pytest.raises(ValueError):
        external.graph_without_weights(garbage)


def test_a_model_written_one_tensor_at_a_time_reads_back_the_same(small_qdq, tmp_path):
    """``save_one_file`` (the export's writer of a single-file model) gives a file onnx reads as the same model,
    which ONNX Runtime runs."""
    import onnx
    import onnxruntime as ort

    from quantship.inspect.read import external

    model = onnx.load(str(small_qdq))
    assert external.serialized_size(model) == model.ByteSize()  # counted a tensor at a time, to the byte
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    del bare.graph.initializer[:]
    assert external.serialized_size(bare) == bare.ByteSize()
    out = tmp_path / "streamed.onnx"
    external.save_one_file(model, out)
    again = onnx.load(str(out))
    assert again.SerializeToString() == model.SerializeToString()
    onnx.checker.check_model(str(out))
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("temporary_folder", ["writable", "missing"])
def test_a_file_read_a_tensor_at_a_time_is_checked_as_onnx_checks_it(small_qdq, tmp_path, monkeypatch,
                                                                      temporary_folder):
    """``load_onnx`` reads a single file a tensor at a time, the checker run on its graph with a placeholder of each
    tensor's bytes (or, with no temporary folder to write it in, on the file itself): the model onnx reads, and a
    tensor whose stored bytes are too few for its shape refused as onnx.checker refuses it."""
    import tempfile

    import onnx

    from quantship.errors import FileRefused
    from quantship.inspect.read.loading import load_onnx

    if temporary_folder == "missing":
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no" / "such" / "folder"))
    assert load_onnx(small_qdq).SerializeToString() == onnx.load(str(small_qdq)).SerializeToString()
    model = onnx.load(str(small_qdq))
    weight = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    weight.raw_data = weight.raw_data[:-1]
    short = tmp_path / "short.onnx"
    onnx.save(model, str(short))
    with pytest.raises(onnx.checker.ValidationError, match="too small for the declared shape"):
        onnx.checker.check_model(str(short))
    with pytest.raises(FileRefused, match=rf"not a valid ONNX model.*{weight.name}.*too small for the declared shape"):
        load_onnx(short)


def test_a_pipe_is_refused_without_being_read(tmp_path):
    """A pipe named like a model is refused at once (reading it would wait for a writer forever)."""
    import os

    from quantship.errors import FileRefused
    from quantship.inspect.read.loading import load_onnx

    os.mkfifo(tmp_path / "pipe.onnx")
    with pytest.raises(FileRefused, match="not a regular file"):
        load_onnx(tmp_path / "pipe.onnx")
