"""Cross-layer equalization: the float function is kept, the channel ranges are equalized, and only
positively homogeneous activations (ReLU) are crossed; ReLU6 and HardSwish pairs are left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from quantship.quantize_onnx import equalize, quantize_onnx_file
from tests.quantize_onnx import graphs


def _skewed(*shape: int, name: str, spread: float = 3.0) -> onnx.TensorProto:
    """A weight whose output channels differ in range by up to ``10**spread`` (what equalization fixes)."""
    rng = np.random.default_rng(sum(name.encode()))
    w = rng.standard_normal(shape) * 10 ** np.linspace(-spread / 2, spread / 2, shape[0]).reshape(-1, *[1] * (len(shape) - 1))
    return numpy_helper.from_array(w.astype(np.float32), name)


def chain(activation: str = "Relu", depthwise: bool = False) -> onnx.ModelProto:
    """x -> conv1 -> act -> conv2 (depthwise if asked) -> Relu -> conv3 -> y; conv1's channels skewed."""
    act_nodes, inits = [], []
    if activation == "Relu":
        act_nodes = [helper.make_node("Relu", ["c1"], ["a1"], name="act1")]
    elif activation == "Relu6":
        inits += [numpy_helper.from_array(np.array(0, np.float32), "lo"), numpy_helper.from_array(np.array(6, np.float32), "hi")]
        act_nodes = [helper.make_node("Clip", ["c1", "lo", "hi"], ["a1"], name="act1")]
    elif activation == "PRelu_MaxPool":  # MTCNN's pattern: Conv -> PReLU -> MaxPool -> Conv
        inits.append(numpy_helper.from_array(np.linspace(-0.5, 0.5, 8, dtype=np.float32).reshape(8, 1, 1), "slope"))
        act_nodes = [helper.make_node("PRelu", ["c1", "slope"], ["p1"], name="act1"),
                     helper.make_node("MaxPool", ["p1"], ["a1"], name="pool1", kernel_shape=[2, 2], pads=[0, 0, 1, 1],
                                      strides=[1, 1])]
    elif activation == "HardSwish":
        act_nodes = [helper.make_node("HardSwish", ["c1"], ["a1"], name="act1")]
    group = 8 if depthwise else 1
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]), *act_nodes,
             helper.make_node("Conv", ["a1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1], group=group),
             helper.make_node("Relu", ["c2"], ["a2"], name="act2"),
             helper.make_node("Conv", ["a2", "w3"], ["y"], name="conv3")]
    inits += [_skewed(8, 3, 3, 3, name="w1"), graphs.weight(8, name="b1"),
              _skewed(8, 8 // group, 3, 3, name="w2", spread=2.0), graphs.weight(8, name="b2"),
              graphs.weight(4, 8, 1, 1, name="w3")]
    return graphs.model(nodes, [graphs.value("x", ["n", 3, 8, 8])], [graphs.value("y", ["n", 4, 8, 8])], inits)


def _run(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


X = np.random.default_rng(3).standard_normal((16, 3, 8, 8)).astype(np.float32)


@pytest.mark.parametrize("depthwise, activation", [(False, "Relu"), (True, "Relu"), (False, "PRelu_MaxPool")])
def test_equalization_keeps_the_float_outputs_and_equalizes_the_ranges(depthwise, activation):
    m = chain(activation, depthwise=depthwise)
    model = ir.from_proto(m)
    pairs = equalize.find_pairs(model)
    assert [(p.first.name, p.second.name) for p in pairs] == [("conv1", "conv2"), ("conv2", "conv3")]
    before = [np.abs(np.log(np.divide(*equalize.channel_ranges(p)))).max() for p in pairs]
    assert equalize.equalize(model) == 2
    after = [np.divide(*equalize.channel_ranges(p)) for p in pairs]
    # each channel's range now matches across the pair (converged: every scale of the last sweep within 1e-3)
    assert max(before) > 1.0 and all(np.allclose(r, 1.0, rtol=5e-3) for r in after), (before, after)
    reference, equalized = _run(m, X), _run(ir.to_proto(model), X)
    assert np.allclose(equalized, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    w1 = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "w1"))
    assert not np.allclose(model.graph.initializers["w1"].const_value.numpy(), w1)  # the weights did move


@pytest.mark.parametrize("activation", ["Relu6", "HardSwish"])
def test_a_pair_through_a_non_homogeneous_activation_is_left_alone(activation):
    model = ir.from_proto(chain(activation))
    assert [(p.first.name, p.second.name) for p in equalize.find_pairs(model)] == [("conv2", "conv3")]
    w1 = model.graph.initializers["w1"].const_value.numpy().copy()
    equalize.equalize(model)
    assert np.array_equal(model.graph.initializers["w1"].const_value.numpy(), w1)


def test_a_conv_read_twice_is_not_rescaled():
    m = chain()
    m.graph.output.append(graphs.value("c1", ["n", 8, 8, 8]))  # conv1's output is also a graph output
    assert [(p.first.name, p.second.name) for p in equalize.find_pairs(ir.from_proto(m))] == [("conv2", "conv3")]


def test_quantize_with_equalize_records_it_and_helps_per_tensor_weights(tmp_path):
    float_path = graphs.save(chain(), tmp_path / "float.onnx")
    errors = {}
    for on in (False, True):
        result = quantize_onnx_file(float_path, tmp_path / f"q{on}.onnx", [X[:8], X[8:]], target="onnxruntime-cpu",
                                    per_tensor=True, equalize=on, run_check=False)
        meta = {p.key: p.value for p in onnx.load(str(result.path)).metadata_props}
        assert ("equalize: pairs_changed 2" in meta["quantship.algorithms"]) is on
        assert ("equalize" in result.as_dict()["algorithms"]) is on
        errors[on] = result.fidelity["fused"]["mean_abs_error"]
    record = next(r for r in result.normalised if r.name == "equalize")
    # proven in ONNX Runtime as a float pass: within float rounding of the outputs' magnitude
    assert record.changes and record.max_abs_diff < 1e-5 * result.fidelity["reference_max_abs"]
    # per-tensor weights: conv1's channels spread over 3 decades lose the small ones without equalization
    assert errors[True] < 0.75 * errors[False], errors  # measured 21.1 vs 36.1 mean abs error
