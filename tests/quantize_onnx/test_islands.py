"""Float islands of a ``full`` placement (tensorrt, tigris): one small graph per rule, the rule named in the
plan, the file accepted by the target's rules, and its output close to the float model's where one int8
scale everywhere is not."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from quantship.errors import SpecRefused
from quantship.inspect.read.facts import read_file
from quantship.inspect.read.islands import Op, normalisation_statistics, polynomial_interiors
from quantship.inspect.run.consumers import run_tigris, tigris_executable
from quantship.quantize_onnx import quantize_onnx_file
from tests.quantize_onnx import graphs


def _const(name: str, v) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(v, np.float32), name)


def second_moment_layernorm() -> onnx.ModelProto:
    """x -> LayerNorm as jax2tf writes it (var = E[x^2] - E[x]^2, Rsqrt as Reciprocal(Sqrt)) -> fc2."""
    n = _const("inv_n", 1 / 16)
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["s1"], name="sum", keepdims=1),
             helper.make_node("Mul", ["s1", "inv_n"], ["mean"], name="mean"),
             helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
             helper.make_node("ReduceSum", ["sq", "axes"], ["s2"], name="sum_sq", keepdims=1),
             helper.make_node("Mul", ["s2", "inv_n"], ["ex2"], name="ex2"),
             helper.make_node("Mul", ["mean", "mean"], ["mean2"], name="mean_sq"),
             helper.make_node("Sub", ["ex2", "mean2"], ["var"], name="variance"),
             helper.make_node("Add", ["var", "eps"], ["ve"], name="add_eps"),
             helper.make_node("Sqrt", ["ve"], ["sd"], name="sqrt"),
             helper.make_node("Reciprocal", ["sd"], ["rs"], name="rsqrt"),
             helper.make_node("Sub", ["x", "mean"], ["d"], name="centre"),
             helper.make_node("Mul", ["d", "rs"], ["n1"], name="normalise"),
             helper.make_node("MatMul", ["n1", "w2"], ["y"], name="fc2")]
    inits = [graphs.weight(16, 4, name="w2"), n, _const("eps", 1e-6),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    return graphs.model(nodes, [graphs.value("x", ["n", 16])], [graphs.value("y", ["n", 4])], inits)


def tanh_gelu() -> onnx.ModelProto:
    """fc1 -> GELU's tanh form written out as magika's file does (x * (c x) * x ...) -> fc2."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Mul", ["c", "h"], ["ch"], name="scale"),
             helper.make_node("Mul", ["h", "ch"], ["h2"], name="square"),
             helper.make_node("Mul", ["h", "h2"], ["h3"], name="cube"),
             helper.make_node("Add", ["h", "h3"], ["inner"], name="inner"),
             helper.make_node("Mul", ["k", "inner"], ["arg"], name="arg"),
             helper.make_node("Tanh", ["arg"], ["t"], name="tanh"),
             helper.make_node("Add", ["one", "t"], ["t1"], name="one_plus"),
             helper.make_node("Mul", ["half", "t1"], ["gate"], name="half"),
             helper.make_node("Mul", ["h", "gate"], ["g"], name="gelu"),
             helper.make_node("MatMul", ["g", "w2"], ["y"], name="fc2")]
    inits = [graphs.weight(8, 16, name="w1"), graphs.weight(16, 4, name="w2"), _const("c", 0.044715),
             _const("k", 0.7978845608), _const("one", 1.0), _const("half", 0.5)]
    return graphs.model(nodes, [graphs.value("x", ["n", 8])], [graphs.value("y", ["n", 4])], inits)


def boxes_and_scores(batch="n") -> onnx.ModelProto:
    """A detector's head: box coordinates (x stride, 0..~100) and sigmoid scores (0..1) in one output Concat."""
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv_box", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["x", "w2"], ["b0"], name="conv_cls", kernel_shape=[1, 1]),
             helper.make_node("Sigmoid", ["b0"], ["b"], name="score"),
             helper.make_node("Mul", ["a", "stride"], ["a2"], name="stride"),
             helper.make_node("Concat", ["a2", "b"], ["y"], name="head", axis=1)]
    inits = [graphs.weight(4, 3, 1, 1, name="w1"), graphs.weight(4, 3, 1, 1, name="w2"), _const("stride", 100.0)]
    return graphs.model(nodes, [graphs.value("x", [batch, 3, 4, 4])], [graphs.value("y", [batch, 8, 4, 4])], inits)


def _rows(n: int, seed: int) -> np.ndarray:
    """Rows of mean ~1 whose spread varies from 0.1 to 0.5: E[x^2] and E[x]^2 nearly cancel."""
    rng = np.random.default_rng(seed)
    return (1 + rng.standard_normal((n, 16)) * 10 ** rng.uniform(-1, -0.3, (n, 1))).astype(np.float32)


def _wide(n: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, 8)) * 10).astype(np.float32)


def _quantize(tmp_path, m, data, target):
    src = graphs.save(m, tmp_path / "float.onnx")
    return src, quantize_onnx_file(src, tmp_path / f"int8_{target}.onnx", data, target=target, run_check=False)


def _run(path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _row_errors(ref: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Each row's worst error relative to the row's magnitude (a normalised output is O(1) per row)."""
    return np.abs(out - ref).max(-1) / np.abs(ref).max(-1)


def test_layernorm_statistics_stay_float_in_a_full_placement_and_the_rules_accept_it(tmp_path):
    src, r = _quantize(tmp_path, second_moment_layernorm(), [_rows(256, 0)], "tensorrt")
    islands = r.plan["float_islands"]["normalisation_statistics"]
    assert set(islands["tensors"]) == {"s1", "mean", "sq", "s2", "ex2", "mean2", "var", "ve", "sd", "rs"}
    assert "E[x^2] - E[x]^2" in islands["why"]
    q = onnx.load(str(r.path))
    quantized = {n.input[0] for n in q.graph.node if n.op_type == "QuantizeLinear"}
    assert quantized == {"x", "d", "n1", "y_float"}  # the normalisation's input, its centred and normalised rows
    facts = read_file(r.path).quant
    assert facts.float_tensors == [] and {"var", "rs"} <= set(facts.float_islands)
    # measured: 90% of rows within 8.6% of the float output (with every statistic at one int8 scale, as
    # before this rule: 38%, the variance of a row of spread 0.1 is a fifth of one step of E[x^2])
    x = _rows(256, 1)
    assert np.quantile(_row_errors(_run(src, x), _run(r.path, x)), 0.9) < 0.15


def test_a_written_out_gelu_keeps_its_polynomial_float(tmp_path):
    src, r = _quantize(tmp_path, tanh_gelu(), [_wide(256, 0)], "tensorrt")
    assert set(r.plan["float_islands"]["polynomial_interior"]["tensors"]) == {"h2", "h3", "inner", "arg"}
    q = onnx.load(str(r.path))
    quantized = {n.input[0] for n in q.graph.node if n.op_type == "QuantizeLinear"}
    assert {"h", "ch", "t", "g"} <= quantized and not {"h2", "h3", "inner", "arg"} & quantized
    assert read_file(r.path).quant.float_tensors == []
    # measured: mean error 2.7% of the mean output (x^3 at one int8 scale, before this rule: 25%)
    x = _wide(256, 1)
    ref = _run(src, x)
    assert float(np.abs(_run(r.path, x) - ref).mean()) < 0.08 * float(np.abs(ref).mean())


def test_islands_leave_a_global_average_pool_and_a_plain_square_alone():
    act = lambda name: name not in ("w", "axes", "c")  # noqa: E731
    gap = [Op("Conv", ("x", "w"), ("c1",)), Op("ReduceMean", ("c1", "axes"), ("pooled",)),
           Op("Gemm", ("pooled", "w"), ("y",))]
    assert normalisation_statistics(gap, act) == set()  # a mean never re-applied to what it summarises
    squared = [Op("Mul", ("x", "x"), ("x2",)), Op("Gemm", ("x2", "w"), ("y",))]
    assert polynomial_interiors(squared, act) == set()  # no saturating op reads it


def test_a_split_range_output_concat_moves_dequantized_values_and_keeps_the_scores(tmp_path):
    data = [graphs.images(16, (3, 4, 4), seed=0)]
    src, r = _quantize(tmp_path, boxes_and_scores(), data, "tensorrt")
    assert r.plan["float_islands"]["split_range_output_concat"]["tensors"] == ["y"]
    q = onnx.load(str(r.path))
    assert [n.op_type for n in q.graph.node if "y" in n.output] == ["Concat"]  # no pair on the output
    assert read_file(r.path).quant.float_tensors == []
    x = graphs.images(16, (3, 4, 4), seed=1)
    ref, out = _run(src, x), _run(r.path, x)
    boxes, scores = slice(0, 4), slice(4, 8)
    # scores at their own scale (1/127 of their range), boxes at theirs: one shared scale (box range / 127)
    # would round every score to 0 or to one step of ~0.8
    assert float(np.abs(out[:, scores] - ref[:, scores]).max()) < 0.02
    assert float(np.abs(out[:, boxes] - ref[:, boxes]).max()) < 0.02 * float(np.abs(ref[:, boxes]).max())


def test_a_concat_of_close_ranges_keeps_its_output_pair(tmp_path):
    data = [graphs.images(16, (3, 4, 4), seed=0)]
    _, r = _quantize(tmp_path, graphs.concat_convs(), data, "tensorrt")
    assert "split_range_output_concat" not in r.plan["float_islands"]


def test_tigris_compiles_the_float_tail_and_runs_the_scores_at_their_scale(tmp_path):
    if tigris_executable() is None or shutil.which("true") is None:
        pytest.skip("the tigris CLI is not installed (pip install tigris-ml)")
    data = [graphs.images(1, (3, 4, 4), seed=s) for s in range(16)]
    src, r = _quantize(tmp_path, boxes_and_scores(batch=1), data, "tigris")
    assert r.plan["float_islands"]["split_range_output_concat"]["tensors"] == ["y"]
    x = graphs.images(1, (3, 4, 4), seed=99)
    (out,), = run_tigris(r.path, [{"x": x}], onnx.load(str(r.path)))
    ref = _run(src, x)
    assert float(np.abs(out[:, 4:] - ref[:, 4:]).max()) < 0.02


def test_a_shared_scale_on_request_ties_the_output_concat_and_rounds_the_scores_away(tmp_path):
    """``shared_scale`` forces one scale through a Concat (bench/yolo_head.py measures it on nudenet's head):
    on onnxruntime-cpu the output Concat gets a pair it never has by default, and the 0..1 scores land on
    a grid of box-range steps."""
    data = [graphs.images(16, (3, 4, 4), seed=0)]
    src = graphs.save(boxes_and_scores(), tmp_path / "float.onnx")
    plain = quantize_onnx_file(src, tmp_path / "plain.onnx", data, target="onnxruntime-cpu", run_check=False)
    shared = quantize_onnx_file(src, tmp_path / "shared.onnx", data, target="onnxruntime-cpu", run_check=False,
                                shared_scale=["head"])
    assert plain.plan["shared_scale"] == [] and shared.plan["shared_scale"] == ["head"]
    q = onnx.load(str(shared.path))
    scales = {n.input[0]: numpy_helper.to_array(next(t for t in q.graph.initializer if t.name == n.input[1]))
              for n in q.graph.node if n.op_type == "QuantizeLinear"}
    assert {"a2", "b", "y_float"} <= set(scales) and scales["a2"] == scales["b"] == scales["y_float"]
    assert "y_float" not in {n.input[0] for n in onnx.load(str(plain.path)).graph.node if n.op_type == "QuantizeLinear"}
    x = graphs.images(16, (3, 4, 4), seed=1)
    ref, out_plain, out_shared = _run(src, x), _run(plain.path, x), _run(tmp_path / "shared.onnx", x)
    step = float(scales["y_float"])
    scores = slice(4, 8)
    # shared (measured): every score is 0 or one step of ~0.92 (the box range over 255), 25% exactly 0, error
    # up to 0.46; default: the Sigmoid runs in float on the dequantized class logits, error 0.027, no zero
    values = np.unique(out_shared[:, scores])
    assert step > 0.5 and len(values) <= 2 and np.allclose(values, [0.0, step][:len(values)])
    assert float(np.abs(out_shared[:, scores] - ref[:, scores]).max()) > 0.3
    assert float(np.abs(out_plain[:, scores] - ref[:, scores]).max()) < 0.05 and not (out_plain[:, scores] == 0).any()

def test_a_shared_scale_that_names_no_concat_is_refused(tmp_path):
    src = graphs.save(boxes_and_scores(), tmp_path / "float.onnx")
    with pytest.raises(SpecRefused, match="--shared-scale 'score' names no Concat"):
        quantize_onnx_file(src, tmp_path / "q.onnx", [graphs.images(4, (3, 4, 4))], target="onnxruntime-cpu",
                           shared_scale=["score"])
    assert not (tmp_path / "q.onnx").exists()
