"""export_qdq on a small residual CNN (32x32): rewrites, refusals, atomicity, metadata."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import quantship.export.artifact as artifact
import quantship.export.postconditions as postconditions
import quantship.export.qdq as qdq
from quantship import Quantizer, export_qdq, qdq_stats, quant_spec, quant_spec_of_file
from quantship.examples.models import TinyResNet
from quantship.inspect.run.verify import ort_session, run_session
from quantship.precision import SPEC_ATTRIBUTE, resolve_spec, tag_model
from tests.onnx_edits import doubled_scale_pass, strip_kernel_shape


def _outputs(path, x: torch.Tensor) -> np.ndarray:
    return run_session(ort_session(path), [x.numpy()])[0]


def _only(tmp_path, *names):
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_opset17_is_lowered_and_exact(tiny_pt2e, tiny_calib, tiny_qdq, tmp_path):
    p18 = tiny_qdq
    p17 = export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "m17.onnx", opset_version=17)
    m17 = onnx.load(str(p17))
    assert {o.domain: o.version for o in m17.opset_import}[""] == 17
    onnx.checker.check_model(m17)
    (mean,) = [n for n in m17.graph.node if n.op_type == "ReduceMean"]
    assert list(mean.input) == [mean.input[0]] and [a.name for a in mean.attribute if a.name == "axes"] == ["axes"]
    assert len(m17.graph.initializer) == len(onnx.load(str(p18)).graph.initializer) - 1  # the axes constant
    assert _outputs(p17, tiny_calib[1]).tobytes() == _outputs(p18, tiny_calib[1]).tobytes()


def test_affine_spec_as_uint8_is_exact(tiny_affine_pt2e, tiny_calib, tmp_path):
    p8 = export_qdq(tiny_affine_pt2e, tiny_calib[0], tmp_path / "a8.onnx")
    pu = export_qdq(tiny_affine_pt2e, tiny_calib[0], tmp_path / "au8.onnx", activation_dtype="uint8")
    s8, su = qdq_stats(p8), qdq_stats(pu)
    assert s8.n_nonzero_zero_point > 0 and s8.n_uint8 == 0
    assert su.n_uint8 == s8.n_quantize + s8.n_dequantize - s8.n_per_channel
    assert su.n_per_channel == s8.n_per_channel
    for x in tiny_calib:
        assert _outputs(pu, x).tobytes() == _outputs(p8, x).tobytes()


def test_metadata_round_trips(tiny_pt2e, tiny_qdq):
    assert quant_spec_of_file(tiny_qdq) == quant_spec(tiny_pt2e)
    props = {p.key: p.value for p in onnx.load(str(tiny_qdq)).metadata_props}
    assert props["quantship.activation_dtype"] == "int8" and "quantship.target" not in props


def test_target_sets_activation_dtype_and_is_recorded(tiny_pt2e, tiny_calib, tmp_path, reuse_produced):
    path = export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "u.onnx", target="onnxruntime-cpu")
    stats = qdq_stats(path)
    assert stats.n_uint8 > 0 and stats.n_nonzero_zero_point == stats.n_uint8
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert props["quantship.target"] == "onnxruntime-cpu" and props["quantship.activation_dtype"] == "uint8"
    assert quant_spec_of_file(path) == quant_spec(tiny_pt2e)
    with pytest.raises(ValueError, match="conflicts with target='tensorrt'"):
        export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "c.onnx", target="tensorrt", activation_dtype="uint8")
    _only(tmp_path, "u.onnx")


def test_skip_conv_add_leaves_bare_edges(tiny_calib, tmp_path):
    torch.manual_seed(0)
    model = Quantizer(backend="pt2e", qdq_placement="skip_conv_add").quantize(TinyResNet().eval(), tiny_calib)
    stats = qdq_stats(export_qdq(model, tiny_calib[0], tmp_path / "skip.onnx"))
    assert stats.n_unquantized_conv_add == 2  # TinyResNet has two residual additions
    assert stats.n_nonzero_zero_point == 0


def test_dynamic_batch_writes_a_symbolic_batch(tiny_pt2e, tiny_calib, tmp_path):
    path = export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "d.onnx", dynamic_batch=True)
    assert onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert _outputs(path, torch.randn(3, 1, 32, 32)).shape == (3, 10)
    _only(tmp_path, "d.onnx")


@pytest.mark.parametrize("spec_kwargs, words", [
    ({"backend": "torchao", "method": "int8_dynamic"}, ["W8A8", "run time"]),
    ({"backend": "x86"}, ["W8A8", "'x86'", "FX"]),
])
def test_unexportable_specs_are_refused(spec_kwargs, words, tmp_path):
    model = tag_model(torch.nn.Linear(4, 2), resolve_spec(**spec_kwargs))
    with pytest.raises(ValueError) as info:
        export_qdq(model, torch.randn(1, 4), tmp_path / "x.onnx")
    for word in [*words, "Quantizer(backend='pt2e')"]:
        assert word in str(info.value)
    _only(tmp_path)


def test_float_and_untagged_models_are_refused(tiny_pt2e, tiny_calib, tmp_path):
    with pytest.raises(ValueError, match="export_onnx"):
        export_qdq(TinyResNet().eval(), tiny_calib[0], tmp_path / "f.onnx")
    untagged = copy.copy(tiny_pt2e)  # a GraphModule copy does not carry the tag along
    if SPEC_ATTRIBUTE in vars(untagged):
        object.__delattr__(untagged, SPEC_ATTRIBUTE)
    assert quant_spec(untagged) is None and quant_spec(tiny_pt2e) is not None
    with pytest.raises(ValueError, match="no quantship spec"):
        export_qdq(untagged, tiny_calib[0], tmp_path / "u.onnx")
    _only(tmp_path)


def test_injected_failure_keeps_nothing_and_spares_an_existing_file(tiny_pt2e, tiny_calib, tmp_path, monkeypatch,
                                                                    reuse_produced):
    target = tmp_path / "m.onnx"
    target.write_bytes(b"an older artifact")

    class Broken(qdq.KernelShapePass):
        def rewrite(self, model):
            raise RuntimeError("injected")

    monkeypatch.setattr(qdq, "PASSES", (*qdq.PASSES[:2], Broken, *qdq.PASSES[2:]))
    with pytest.raises(RuntimeError, match="injected"):
        export_qdq(tiny_pt2e, tiny_calib[0], target)
    assert target.read_bytes() == b"an older artifact"
    _only(tmp_path, "m.onnx")


def test_external_data_is_written_atomically(tiny_pt2e, tiny_calib, tmp_path, monkeypatch, reuse_produced):
    monkeypatch.setattr(artifact, "EXTERNAL_DATA_THRESHOLD", 0)
    path = export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "ext.onnx")
    (data,) = artifact.external_locations(path)  # a name of its own: ext.onnx.<token>.data
    _only(tmp_path, "ext.onnx", data)
    assert _outputs(path, tiny_calib[0]).shape == (8, 10)

    def failing_post_condition(*args, **kwargs):
        raise postconditions.ExportRefused("injected post-condition failure")

    monkeypatch.setattr(qdq, "check_spec_held", failing_post_condition)
    with pytest.raises(ValueError, match="injected"):
        export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "gone.onnx")
    _only(tmp_path, "ext.onnx", data)


def test_post_condition_refuses_a_file_that_contradicts_the_spec(tiny_pt2e, tiny_calib, tmp_path, monkeypatch,
                                                                 reuse_produced):
    real = postconditions.qdq_stats

    def with_a_nonzero_zero_point(path):
        stats = real(path)
        return type(stats)(**{**stats.as_dict(), "n_nonzero_zero_point": 1})

    monkeypatch.setattr(postconditions, "qdq_stats", with_a_nonzero_zero_point)
    with pytest.raises(ValueError, match="non-zero zero-point"):
        export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "p.onnx")
    _only(tmp_path)


def _runtime_axes_model() -> onnx.ModelProto:
    """ReduceMean whose axes are computed while the graph runs: Shape(Shape(x)) - 1 == [3]."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Shape", ["shape"], ["rank"]),
        helper.make_node("Sub", ["rank", "one"], ["axes"]),
        helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=1, name="runtime_mean"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 1, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("one", TensorProto.INT64, [1], [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_runtime_reduce_axes_are_refused_by_name(tiny_pt2e, tiny_calib, tmp_path, monkeypatch):
    monkeypatch.setattr(qdq, "produce", lambda *a, **k: _runtime_axes_model())
    with pytest.raises(ValueError, match="ReduceMean 'runtime_mean' reads its axes from 'axes'"):
        export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "r.onnx", opset_version=17)
    _only(tmp_path)


def test_an_op_needing_opset18_is_refused_by_name():
    import onnx_ir as ir

    from quantship.export.opset import OpsetRefused, lower_opset

    graph = helper.make_graph(
        [helper.make_node("Split", ["x"], ["a", "b"], axis=0, num_outputs=2, name="halves")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "ab"],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    with pytest.raises(OpsetRefused, match="Split 'halves' needs opset 18"):
        lower_opset(model, 17)


def test_kernel_shape_is_restored_from_the_weight(tiny_qdq):
    import onnx_ir as ir

    from quantship.export.kernel_shape import write_kernel_shapes

    proto = onnx.load(str(tiny_qdq))
    expected = {n.name: [a for a in n.attribute if a.name == "kernel_shape"][0].ints for n in proto.graph.node
                if n.op_type == "Conv"}
    strip_kernel_shape(proto)
    model = ir.from_proto(proto)
    assert write_kernel_shapes(model) == len(expected) == 6
    restored = {n.name: list(n.attributes["kernel_shape"].as_ints()) for n in model.graph if n.op_type == "Conv"}
    assert restored == {k: list(v) for k, v in expected.items()}


def test_unequal_or_bad_arguments_refused_before_work(tiny_pt2e, tiny_calib, tmp_path, monkeypatch):
    def no_export(*args, **kwargs):
        raise AssertionError("the exporter ran before the arguments were checked")

    monkeypatch.setattr(qdq, "produce", no_export)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="activation_dtype='int4'"):
            export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "a.onnx", activation_dtype="int4")
        with pytest.raises(ValueError, match="opset_version=16"):
            export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "b.onnx", opset_version=16)
    assert [str(w.message) for w in caught] == []  # refused in one line, nothing else said
    _only(tmp_path)


def test_uint8_read_back_refuses_an_incomplete_rewrite(tiny_pt2e, tiny_calib, tmp_path, monkeypatch, reuse_produced):
    monkeypatch.setattr(qdq, "to_uint8_activations", lambda model: 0)  # a rewrite that forgot its job
    with pytest.raises(ValueError, match="still int8"):
        export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "u.onnx", activation_dtype="uint8")
    _only(tmp_path)


def test_uint8_refuses_an_integer_tensor_read_by_another_op():
    import onnx_ir as ir

    from quantship.export.activations import ActivationDtypeRefused, to_uint8_activations

    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], name="q"),
         helper.make_node("Identity", ["q"], ["y"], name="raw_reader")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.INT8, [2])],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]), helper.make_tensor("zp", TensorProto.INT8, [], [0])],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    with pytest.raises(ActivationDtypeRefused, match="Identity 'raw_reader'"):
        to_uint8_activations(model)


def test_an_inexact_pass_is_refused_by_its_ensures(tiny_pt2e, tiny_calib, tmp_path, monkeypatch, reuse_produced):
    """A pass's ensures() runs the rewritten graph in ORT and refuses it, by name, unless the bytes match."""
    from quantship.errors import ExportRefused

    monkeypatch.setattr(qdq, "PASSES", (*qdq.PASSES, doubled_scale_pass()))
    with pytest.raises(ExportRefused, match="doubling one activation scale: output 0 differs from the graph as produced"):
        export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "m.onnx")
    _only(tmp_path)


def test_passes_report_what_they_changed(tiny_produced, tiny_pt2e, tiny_calib):
    """PassResult.modified: an opset-18 int8 export changes nothing an ORT run could see, so no session is built."""
    import onnx_ir as ir

    ctx = qdq.ExportContext(spec=quant_spec(tiny_pt2e), opset_version=18, activation_dtype="int8", target=None,
                            inputs=[tiny_calib[0].numpy()], produced=tiny_produced)
    model = ir.from_proto(tiny_produced)
    passes = [make(ctx) for make in qdq.PASSES]
    result = qdq.run_passes(passes, model)
    assert result.modified  # the metadata pass always writes
    by_name = {type(p).__name__: p for p in passes}
    assert not by_name["LowerOpsetPass"].modified and not by_name["ActivationDtypePass"].modified
    kernel = by_name["KernelShapePass"]
    assert kernel.modified == (kernel.count > 0)
    assert (ctx._reference is not None) == kernel.modified  # the reference ran only if something needed it


def test_a_weight_read_by_a_float_input_op_is_stored_as_its_dequantized_floats(tmp_path):
    """A conv reading a module kept float (``skip_activations``) keeps its input float; the annotator still
    quantizes its weight, which ONNX Runtime would dequantize on every call for a float kernel (MobileNetV2 after
    the fidelity repair held six; one was its report's slowest node, 7%). For a runtime that runs mixed
    graphs the file stores the floats that DequantizeLinear computes (the pass proves the file's outputs unchanged)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 1)).eval()
    calib = [torch.randn(2, 3, 12, 12) for _ in range(2)]
    qmodel = Quantizer.for_target("onnxruntime-cpu", skip_activations=["0"]).quantize(model, calib)
    path = export_qdq(qmodel, calib[0], tmp_path / "m.onnx", target="onnxruntime-cpu")
    graph = onnx.load(str(path)).graph
    producer = {o: n for n in graph.node for o in n.output}
    first, reader, last = [n for n in graph.node if n.op_type == "Conv"]
    assert first.input[0] == graph.input[0].name and reader.input[0] == first.output[0]  # the float input
    assert reader.input[1] not in producer  # a stored float weight, no DequantizeLinear
    stored = onnx.numpy_helper.to_array(next(t for t in graph.initializer if t.name == reader.input[1]))
    bound = 63 if quant_spec(qmodel).reduce_range else 127  # symmetric per channel: the int8 codes' grid
    codes = stored / (np.abs(stored).max(axis=(1, 2, 3), keepdims=True) / bound)
    assert np.abs(codes - np.round(codes)).max() < 1e-3 and np.unique(np.round(codes)).size > 8
    assert producer[last.input[1]].op_type == "DequantizeLinear"  # the integer conv keeps its pair
