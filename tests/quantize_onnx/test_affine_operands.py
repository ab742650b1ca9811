"""The ONNX path's integer Add/Mul (``place.plan``, ``integer`` placement): an Add or a Mul whose result an
integer kernel reads runs on integers, its stored operand kept per tensor beside it (uint8, zero-point 128
for ONNX Runtime) and a float op's value it reads paired, unless another float reader would then dequantize
that value. PP-LCNetV3's learnable affine block (``x * a + b`` after a hard swish, PP-OCR's detector) is the
pattern; a squeeze-excitation Mul whose input a mean also reads stays float."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quantship.inspect.run.consumers import ort_optimized_ops
from quantship.quantize_onnx import quantize_onnx_file
from tests.quantize_onnx import graphs


def _affine_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, s).astype(np.float32), n)
             for n, s in (("w1", (8, 3, 3, 3)), ("w2", (8, 8, 3, 3)), ("w3", (8, 8, 1, 1)), ("wg", (8, 8, 1, 1)))]
    inits += [numpy_helper.from_array(np.array(1.3, np.float32), "a"), numpy_helper.from_array(np.array(0.2, np.float32), "b")]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["c1"], ["h1"]),
        helper.make_node("Mul", ["h1", "a"], ["m1"]),  # the affine block: read only by its Add
        helper.make_node("Add", ["m1", "b"], ["y1"]),
        helper.make_node("Conv", ["y1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["c2"], ["h2"]),
        helper.make_node("ReduceMean", ["h2"], ["avg"], axes=[2, 3], keepdims=1),  # the mean reads h2 too
        helper.make_node("Conv", ["avg", "wg"], ["g0"]),
        helper.make_node("HardSigmoid", ["g0"], ["g"]),
        helper.make_node("Mul", ["h2", "g"], ["se"]),
        helper.make_node("Conv", ["se", "w3"], ["out"]),
    ]
    graph = helper.make_graph(nodes, "affine", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 8, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_affine_block_runs_on_integers_and_the_gating_mul_stays_float(tmp_path):
    float_path = graphs.save(_affine_model(), tmp_path / "float.onnx")
    x = graphs.images(32, shape=(3, 8, 8), seed=1)
    done = quantize_onnx_file(float_path, tmp_path / "q.onnx", x, target="onnxruntime-cpu", run_check=False)
    model = onnx.load(str(done.path))
    producer = {o: n for n in model.graph.node for o in n.output}
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    muls = [n for n in model.graph.node if n.op_type == "Mul"]
    add = next(n for n in model.graph.node if n.op_type == "Add")
    for node in (muls[0], add):  # both inputs through a DequantizeLinear, the operand stored uint8 around 128
        assert all(producer[i].op_type == "DequantizeLinear" for i in node.input), node.name
        operand = next(producer[i] for i in node.input if producer[i].input[0] in stored)
        q, zero = stored[operand.input[0]], stored[operand.input[2]]
        assert q.dtype == np.uint8 and zero.dtype == np.uint8 and int(zero) == 128 and abs(int(q) - 128) <= 63
    assert not any(i in producer and producer[i].op_type == "DequantizeLinear" for i in muls[1].input)  # SE: float
    assert done.plan["n_operands"] == 2
    ops = ort_optimized_ops(done.path)
    assert ops["QLinearMul"] == 1 and ops["QLinearAdd"] == 1, ops
    # the integer affine block computes what the float one does, within the file's own rounding
    import onnxruntime as ort

    outs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            for p in (float_path, done.path)]
    sqnr = 10 * np.log10(np.sum(outs[0] ** 2) / np.sum((outs[0] - outs[1]) ** 2))
    assert sqnr > 25, sqnr
