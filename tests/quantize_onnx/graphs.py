"""Small hand-built ONNX graphs, one per pattern the ONNX quantizer has a rule for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

RNG = np.random.default_rng(0)


def weight(*shape: int, name: str) -> onnx.TensorProto:
    """The same numbers every time a graph is built (seeded by the tensor's name)."""
    rng = np.random.default_rng(sum(name.encode()))
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def model(nodes, inputs, outputs, initializers=(), opset: int = 17, ir_version: int = 8) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir_version
    return m


def save(m: onnx.ModelProto, path: Path) -> Path:
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    return path


def value(name: str, dims, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, dims)


def conv_relu_conv(channels: int = 8) -> onnx.ModelProto:
    """x -> Conv -> Relu -> Conv -> y: two integer convs, the quantization point after the Relu."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2")]
    inits = [weight(channels, 3, 3, 3, name="w1"), weight(channels, name="b1"), weight(4, channels, 1, 1, name="w2")]
    return model(nodes, [value("x", ["n", 3, 8, 8])], [value("y", ["n", 4, 8, 8])], inits)


def conv_reshape_matmul() -> onnx.ModelProto:
    """Conv -> Reshape -> MatMul(weight): the Reshape shares its input's scale."""
    shape = numpy_helper.from_array(np.array([0, -1], np.int64), "shape")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv"),
             helper.make_node("Reshape", ["c1", "shape"], ["flat"], name="reshape"),
             helper.make_node("MatMul", ["flat", "w2"], ["y"], name="fc")]
    inits = [weight(4, 3, 1, 1, name="w1"), shape, weight(4 * 4 * 4, 5, name="w2")]
    return model(nodes, [value("x", ["n", 3, 4, 4])], [value("y", ["n", 5])], inits)


def attention_matmul() -> onnx.ModelProto:
    """Two projections and an activation x activation MatMul: q @ k^T."""
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="proj_q"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="proj_k"),
             helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["y"], name="scores")]
    inits = [weight(8, 8, name="wq"), weight(8, 8, name="wk")]
    return model(nodes, [value("x", ["n", 6, 8])], [value("y", ["n", 6, 6])], inits)


def concat_convs() -> onnx.ModelProto:
    """Two convs concatenated, then a conv: the Concat ties its inputs' scales when their ranges are close."""
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv_a"),
             helper.make_node("Conv", ["x", "w2"], ["b"], name="conv_b"),
             helper.make_node("Concat", ["a", "b"], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "w3"], ["y"], name="conv_c")]
    inits = [weight(4, 3, 1, 1, name="w1"), weight(4, 3, 1, 1, name="w2"), weight(2, 8, 1, 1, name="w3")]
    return model(nodes, [value("x", ["n", 3, 4, 4])], [value("y", ["n", 2, 4, 4])], inits)


def written_layernorm(tokens: int | None = None) -> onnx.ModelProto:
    """MatMul -> a LayerNorm written out (ReduceMean, Sub, Mul, ReduceMean, Add, Sqrt, Div) -> MatMul, on
    [n, 8] (or [n, tokens, 8]: TiGrIS reduces one axis of a rank-3 tensor only)."""
    eps = numpy_helper.from_array(np.array(1e-5, np.float32), "eps")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("ReduceMean", ["h"], ["mu"], name="mean", axes=[-1]),
             helper.make_node("Sub", ["h", "mu"], ["d"], name="centre"),
             helper.make_node("Mul", ["d", "d"], ["d2"], name="square"),
             helper.make_node("ReduceMean", ["d2"], ["var"], name="variance", axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"], name="add_eps"),
             helper.make_node("Sqrt", ["ve"], ["sd"], name="sqrt"),
             helper.make_node("Div", ["d", "sd"], ["n1"], name="normalise"),
             helper.make_node("MatMul", ["n1", "w2"], ["y"], name="fc2")]
    inits = [weight(8, 16, name="w1"), eps, weight(16, 4, name="w2")]
    lead = ["n"] if tokens is None else ["n", tokens]
    return model(nodes, [value("x", [*lead, 8])], [value("y", [*lead, 4])], inits, opset=17)


def integer_ids() -> onnx.ModelProto:
    """int32 ids -> Gather(table) -> MatMul: the ids stay integer, the rows read are quantized."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
             helper.make_node("MatMul", ["emb", "w"], ["y"], name="fc")]
    inits = [weight(257, 8, name="table"), weight(8, 3, name="w")]
    return model(nodes, [value("ids", ["n", 5], TensorProto.INT32)], [value("y", ["n", 5, 3])], inits)


def shared_weight() -> onnx.ModelProto:
    """One weight read by two convs and by an Add: one stored int8 copy, a DequantizeLinear per conv,
    the Add keeps reading the float weight."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], name="conv_a"),
             helper.make_node("Conv", ["a", "w"], ["b"], name="conv_b"),
             helper.make_node("Add", ["b", "w"], ["y"], name="add_w")]
    inits = [weight(3, 3, 1, 1, name="w")]
    return model(nodes, [value("x", [3, 3, 4, 4])], [value("y", [3, 3, 4, 4])], inits)


def depthwise_5x5() -> onnx.ModelProto:
    """Conv 1x1 -> depthwise 5x5 -> Tanh -> Conv 1x1 (a float op after the depthwise conv, as the
    written-out hardswish of PP-OCR: a QuantizeLinear right after it would let ONNX Runtime quantize
    its weight itself)."""
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="pw1"),
             helper.make_node("Conv", ["a", "wd"], ["b"], name="dw", group=8, pads=[2, 2, 2, 2]),
             helper.make_node("Tanh", ["b"], ["t"], name="act"),
             helper.make_node("Conv", ["t", "w2"], ["y"], name="pw2")]
    inits = [weight(8, 3, 1, 1, name="w1"), weight(8, 1, 5, 5, name="wd"), weight(4, 8, 1, 1, name="w2")]
    return model(nodes, [value("x", ["n", 3, 8, 8])], [value("y", ["n", 4, 8, 8])], inits)


def paddle_style() -> onnx.ModelProto:
    """What Paddle writes: opset 11, weights in Constant nodes, batch -1, a Conv without bias followed
    by an Add of a reshaped constant, a BatchNormalization after a Conv."""
    def const(name, array):
        return helper.make_node("Constant", [], [name], name=f"const_{name}", value=numpy_helper.from_array(array, name))

    w1 = (RNG.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32)
    w2 = (RNG.standard_normal((4, 4, 1, 1)) * 0.3).astype(np.float32)
    nodes = [const("w1", w1), const("bias", RNG.standard_normal(4).astype(np.float32)),
             const("bias_shape", np.array([1, 4, 1, 1], np.int64)), const("w2", w2),
             const("gamma", RNG.uniform(0.5, 1.5, 4).astype(np.float32)), const("beta", RNG.standard_normal(4).astype(np.float32)),
             const("mean", RNG.standard_normal(4).astype(np.float32)), const("var", RNG.uniform(0.5, 2, 4).astype(np.float32)),
             helper.make_node("Conv", ["x", "w1"], ["c1"], name="Conv@0", pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["bias", "bias_shape"], ["bias4d"], name="Reshape@0"),
             helper.make_node("Add", ["c1", "bias4d"], ["a1"], name="Add@0"),
             helper.make_node("Relu", ["a1"], ["r1"], name="Relu@0"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="Conv@1"),
             helper.make_node("BatchNormalization", ["c2", "gamma", "beta", "mean", "var"], ["bn"], name="BN@0"),
             helper.make_node("Unsqueeze", ["bn"], ["u"], name="Unsqueeze@0", axes=[1]),
             helper.make_node("Squeeze", ["u"], ["y"], name="Squeeze@0", axes=[1])]
    return model(nodes, [value("x", [-1, 3, 6, 6])], [value("y", [-1, 4, 6, 6])], opset=11, ir_version=7)


def images(n: int, shape=(3, 8, 8), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, *shape)).astype(np.float32)


def embedding_matmul(vocab: int = 1000, width: int = 16, seq: int = 6) -> onnx.ModelProto:
    """int64 token ids -> Gather(word table) + Gather(position table, constant positions) -> Add -> MatMul:
    the word table is read by computed indices (a table read), the position rows are a constant."""
    positions = numpy_helper.from_array(np.arange(seq, dtype=np.int64), "positions")
    nodes = [helper.make_node("Gather", ["words", "ids"], ["emb"], name="embed"),
             helper.make_node("Gather", ["position_table", "positions"], ["pos"], name="embed_positions"),
             helper.make_node("Add", ["emb", "pos"], ["h"], name="add_positions"),
             helper.make_node("MatMul", ["h", "w"], ["y"], name="fc")]
    inits = [weight(vocab, width, name="words"), weight(seq, width, name="position_table"), positions,
             weight(width, 4, name="w")]
    return model(nodes, [value("ids", ["n", seq], TensorProto.INT64)], [value("y", ["n", seq, 4])], inits)


def two_heads(first_weight: np.ndarray | None = None) -> onnx.ModelProto:
    """x -> Gemm(w1) -> score and x -> Gemm(w2) -> box: two graph outputs from one input (a detector's
    two heads). ``box`` does not read feature 7 (w2's row 7 is zero); ``first_weight`` replaces w1."""
    w2 = numpy_helper.to_array(weight(8, 4, name="w2")).copy()
    w2[7] = 0.0
    w1 = weight(8, 2, name="w1") if first_weight is None else numpy_helper.from_array(
        first_weight.astype(np.float32), "w1")
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["score"], name="score_head"),
             helper.make_node("Gemm", ["x", "w2", "b2"], ["box"], name="box_head")]
    inits = [w1, weight(2, name="b1"), numpy_helper.from_array(w2, "w2"), weight(4, name="b2")]
    return model(nodes, [value("x", ["n", 8])], [value("score", ["n", 2]), value("box", ["n", 4])], inits)


def heavy_tailed_feature(n: int, seed: int = 0) -> np.ndarray:
    """N x 8 standard normal features whose last one is 0 but for rare spikes of 40: a range a
    histogram observer clips."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    x[:, 7] = np.where(rng.random(n) < 0.02, 40.0, 0.0)
    return x


def encoder_block(width: int = 16, tokens: int = 6, classes: int = 3) -> onnx.ModelProto:
    """One transformer block on x [n, tokens, width]: Q/K/V projections (MatMul + bias Add, the bias first
    in V's Add), q @ k^T, softmax, @ v, the output projection, residual + LayerNormalization, a two-MatMul
    feed-forward with Relu, then a mean over tokens and a Gemm head (transB=1, alpha 0.5): seven weighted
    MatMul/Gemm and two activation x activation MatMuls."""
    scale = numpy_helper.from_array(np.array(1.0 / np.sqrt(width), np.float32), "attn_scale")
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q0"], name="proj_q"),
             helper.make_node("Add", ["q0", "bq"], ["q"], name="bias_q"),
             helper.make_node("MatMul", ["x", "wk"], ["k0"], name="proj_k"),
             helper.make_node("Add", ["k0", "bk"], ["k"], name="bias_k"),
             helper.make_node("MatMul", ["x", "wv"], ["v0"], name="proj_v"),
             helper.make_node("Add", ["bv", "v0"], ["v"], name="bias_v"),
             helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"], name="scores"),
             helper.make_node("Mul", ["s0", "attn_scale"], ["s"], name="scale_scores"),
             helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["ctx"], name="context"),
             helper.make_node("MatMul", ["ctx", "wo"], ["o0"], name="proj_o"),
             helper.make_node("Add", ["o0", "bo"], ["o"], name="bias_o"),
             helper.make_node("Add", ["x", "o"], ["r"], name="residual"),
             helper.make_node("LayerNormalization", ["r", "ln_g", "ln_b"], ["h"], name="norm", axis=-1),
             helper.make_node("MatMul", ["h", "w1"], ["f0"], name="ffn_in"),
             helper.make_node("Add", ["f0", "b1"], ["f1"], name="bias_in"),
             helper.make_node("Relu", ["f1"], ["f2"], name="relu"),
             helper.make_node("MatMul", ["f2", "w2"], ["f3"], name="ffn_out"),
             helper.make_node("Add", ["f3", "b2"], ["f"], name="bias_out"),
             helper.make_node("ReduceMean", ["f"], ["pooled"], name="pool", axes=[1], keepdims=0),
             helper.make_node("Gemm", ["pooled", "wh", "bh"], ["y"], name="head", transB=1, alpha=0.5)]
    inits = [weight(width, width, name=n) for n in ("wq", "wk", "wv", "wo")]
    inits += [weight(width, name=n) for n in ("bq", "bk", "bv", "bo", "ln_b", "b2")]
    inits += [numpy_helper.from_array(np.ones(width, np.float32), "ln_g"), scale,
              weight(width, 4 * width, name="w1"), weight(4 * width, name="b1"), weight(4 * width, width, name="w2"),
              weight(classes, width, name="wh"), weight(classes, name="bh")]
    return model(nodes, [value("x", ["n", tokens, width])], [value("y", ["n", classes])], inits)


def stem_then_body(side: int = 96) -> onnx.ModelProto:
    """A one-channel stem Conv over a large image (ONNX Runtime's integer kernel runs it several times
    slower than its float NCHWc Conv: bench/conv_speed.py), then wider Convs that run faster on integers."""
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], name="stem", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("Conv", ["r0", "w1"], ["c1"], name="body1", pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="body2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w3"], ["y"], name="head")]
    inits = [weight(16, 1, 3, 3, name="w0"), weight(64, 16, 3, 3, name="w1"), weight(64, 64, 3, 3, name="w2"),
             weight(8, 64, 1, 1, name="w3")]
    half = side // 2
    return model(nodes, [value("x", ["n", 1, side, side])], [value("y", ["n", 8, half, half])], inits)
