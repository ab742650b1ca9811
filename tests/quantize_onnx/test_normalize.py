"""Each normalisation pass on a Paddle-style file: what it changes, and that ONNX Runtime's outputs do not."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from quantship.errors import ExportRefused
from quantship.quantize_onnx import normalize
from quantship.quantize_onnx.quantizer import normalise
from tests.quantize_onnx import graphs

X = graphs.images(5, (3, 6, 6), seed=3)


def _outputs(m: ir.Model | onnx.ModelProto) -> list[np.ndarray]:
    proto = ir.to_proto(m) if isinstance(m, ir.Model) else m
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": X})


def _ops(m: ir.Model) -> list[str]:
    return [n.op_type for n in m.graph]


def _run_until(name: str) -> tuple[ir.Model, int]:
    """The Paddle-style model after every pass up to and including ``name``; returns its change count."""
    m = ir.from_proto(graphs.paddle_style())
    for p in normalize.PASSES:
        n = p.run(m)
        if p.name == name:
            return m, n
    raise AssertionError(name)


EXACT = [p.name for p in normalize.PASSES if p.proof == "exact"]


@pytest.mark.parametrize("name", EXACT)
def test_each_exact_pass_keeps_every_output_byte(name):
    before_pass = [p.name for p in normalize.PASSES][: [p.name for p in normalize.PASSES].index(name)]
    m = ir.from_proto(graphs.paddle_style())
    for p in normalize.PASSES:
        if p.name in before_pass:
            p.run(m)
    before = _outputs(m)
    changes = next(p for p in normalize.PASSES if p.name == name).run(m)
    after = _outputs(m)
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(before, after))
    assert changes == {"name_nodes": 0, "lift_constants": 8, "initializers_out_of_inputs": 0, "fold_constant_moves": 1,
                       "dynamic_dims": 2, "upgrade_opset": 1}[name]


def test_lift_constants_makes_weights_initializers_under_their_names():
    m, n = _run_until("lift_constants")
    assert n == 8 and "Constant" not in _ops(m)
    assert {"w1", "w2", "gamma", "bias"} <= set(m.graph.initializers)


def test_folded_reshape_of_a_constant_is_an_initializer():
    m, _ = _run_until("fold_constant_moves")
    assert "Reshape" not in _ops(m) and m.graph.initializers["bias4d"].const_value.shape == (1, 4, 1, 1)


def test_minus_one_dims_become_named_dynamic_dims_and_names_stay():
    m, _ = _run_until("dynamic_dims")
    assert [str(d) for d in m.graph.inputs[0].shape][0] == "x_dim0"
    assert m.graph.inputs[0].name == "x" and [o.name for o in m.graph.outputs] == ["y"]


def test_opset_11_is_converted_to_13_and_squeeze_axes_move_to_an_input():
    m, n = _run_until("upgrade_opset")
    assert n == 1 and m.opset_imports[""] == 13
    squeeze = next(node for node in m.graph if node.op_type == "Squeeze")
    assert len(squeeze.inputs) == 2 and "axes" not in squeeze.attributes
    # the axes the converter wrote are an initializer, as the file's own Constants were lifted: no Constant node
    # is left (TiGrIS's compiler failed on one: the PP-OCRv4 recognizer's tigris file, an IndexError)
    assert squeeze.inputs[1].is_initializer() and "Constant" not in _ops(m)


def test_float_passes_fold_batch_norm_and_bias_add_into_the_convs():
    m = ir.from_proto(graphs.paddle_style())
    reference = _outputs(m)
    records = normalise(m, [{"x": X}])
    ops = _ops(m)
    assert "BatchNormalization" not in ops and "Add" not in ops and ops.count("Conv") == 2
    done = {r.name: r for r in records}
    assert done["fold_batch_norm"].changes == 1 and done["fold_bias_add"].changes == 1
    assert all(r.max_abs_diff == 0 for r in records if r.proof == "exact" and r.changes)
    (after,) = _outputs(m)
    np.testing.assert_allclose(after, reference[0], rtol=0, atol=1e-5)  # rounding of the folded weights only
    assert [o.name for o in m.graph.outputs] == ["y"]  # the BatchNormalization's output name survives


def test_a_pass_that_changes_outputs_is_refused(monkeypatch):
    def breaks(model: ir.Model) -> int:
        conv = next(n for n in model.graph if n.op_type == "Conv")
        w = conv.inputs[1].const_value.numpy() * 1.01
        conv.inputs[1].const_value = ir.tensor(w)
        return 1

    broken = normalize.Pass("lift_constants", breaks, "exact", "test")
    monkeypatch.setattr(normalize, "PASSES", (broken,))
    m = ir.from_proto(graphs.conv_relu_conv())
    with pytest.raises(ExportRefused, match="changed the outputs"):
        normalise(m, [{"x": graphs.images(2)}])


def test_passes_run_on_onnx_irs_pass_manager_with_the_proof_in_ensures():
    """One pass framework (issue 36): a normalisation pass is an onnx-ir pass whose ``ensures()`` holds the proof,
    so a float pass beyond FLOAT_TOLERANCE is refused there, and the next pass never runs."""
    from quantship.quantize_onnx.quantizer import ProvenPass

    ran = []

    def drifts(model: ir.Model) -> int:
        conv = next(n for n in model.graph if n.op_type == "Conv")
        conv.inputs[1].const_value = ir.tensor(conv.inputs[1].const_value.numpy() * 1.05)
        return 1

    passes = (normalize.Pass("drifts", drifts, "float", "test"), normalize.Pass("after", lambda m: ran.append(1) or 0,
                                                                                "exact", "test"))
    assert issubclass(ProvenPass, ir.passes.PassBase)
    m = ir.from_proto(graphs.conv_relu_conv())
    with pytest.raises(ExportRefused, match="drifts moved the outputs"):
        normalise(m, [{"x": graphs.images(2)}], passes)
    assert ran == []


def test_unnamed_nodes_are_named_and_two_hard_swishes_rewritten_still_run(tmp_path):
    """torch's exporter leaves some nodes unnamed (torchvision's MobileNetV3 at opset 18: 38 of them, its
    HardSigmoid + Mul hard swishes among them). The hard swish rewrite named its node after the one it replaced,
    so two unnamed ones became two nodes named ``/hardswish`` and ONNX Runtime refused the file. ``name_nodes``
    names every unnamed (or twice-named) node first; the file quantizes and runs."""
    from onnx import helper

    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("HardSigmoid", ["c1"], ["g1"], alpha=1 / 6, beta=0.5),
             helper.make_node("Mul", ["c1", "g1"], ["s1"]),
             helper.make_node("Conv", ["s1", "w2"], ["c2"], name="dup"),
             helper.make_node("HardSigmoid", ["c2"], ["g2"], alpha=1 / 6, beta=0.5, name="dup"),
             helper.make_node("Mul", ["c2", "g2"], ["y"])]
    m = graphs.model(nodes, [graphs.value("x", ["n", 3, 6, 6])], [graphs.value("y", ["n", 4, 6, 6])],
                     [graphs.weight(8, 3, 3, 3, name="w1"), graphs.weight(4, 8, 1, 1, name="w2")], opset=18)
    model = ir.from_proto(m)
    assert normalize.name_nodes(model) == 5  # four unnamed, one second "dup"
    names = [n.name for n in model.graph]
    assert len(set(names)) == len(names) == 6 and "dup" in names
    assert normalize.name_nodes(model) == 0
    from quantship.quantize_onnx import quantize_onnx_file

    m.graph.node[3].name = "conv2"  # ONNX Runtime refuses a float file with two nodes of one name: give it none
    out = tmp_path / "int8.onnx"
    quantize_onnx_file(graphs.save(m, tmp_path / "float.onnx"), out, calibration=X, target="onnxruntime-cpu")
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": X})[0].shape == (5, 4, 6, 6)
    assert "HardSwish" in {n.op_type for n in onnx.load(str(out)).graph.node}


@pytest.fixture(scope="module")
def amplifying_float_file(tmp_path_factory):
    """Untrained EfficientNet-B0 at 32 x 32 with its BatchNorms re-estimated on random images (bench/zoo.py's
    preparation): a deep network that amplifies a last-bit float change to 1e-4 of its output."""
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.efficientnet_b0(weights=None).eval()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    with torch.no_grad():
        model(torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(2)))
    model.eval()
    path = tmp_path_factory.mktemp("amplifying") / "fp32.onnx"
    from quantship.export import export_onnx

    export_onnx(model, torch.randn(1, 3, 32, 32), path)
    x = np.random.default_rng(1).standard_normal((16, 3, 32, 32)).astype(np.float32)
    return path, x


def test_a_float_pass_within_the_models_own_float_noise_is_accepted(amplifying_float_file, tmp_path, monkeypatch):
    """A "float" pass is held to 1e-4 of the output's magnitude, or to what ONNX Runtime's own
    optimizations move the outputs by (times 4), whichever is larger: on this network folding the spatial means
    into pools moved the outputs by 1.05e-4 of their magnitude (2e-4 with other float threads), about what ORT's
    own Conv + BatchNormalization fusion moves them by. The file was refused; it is quantized now, and the fixed
    tolerance alone still refuses it."""
    from quantship.quantize_onnx import quantize_onnx_file

    path, x = amplifying_float_file
    out = quantize_onnx_file(path, tmp_path / "int8.onnx", calibration=x, target="onnxruntime-cpu")
    assert out.path.exists()
    assert any(p.max_abs_diff for p in out.normalised if p.proof == "float")
    monkeypatch.setattr(normalize, "NOISE_FACTOR", 0.0)
    with pytest.raises(ExportRefused, match="moved the outputs by"):
        quantize_onnx_file(path, tmp_path / "again.onnx", calibration=x, target="onnxruntime-cpu")
    assert not (tmp_path / "again.onnx").exists()
