"""A Conv kept float stays float in ONNX Runtime (``export.float_pairs.float_reads_per_axis``).

ONNX Runtime 1.21+ quantizes, at its default optimizations, the float weight of a Conv / ConvTranspose / Gemm that
reads a per-tensor DequantizeLinear and writes (through Relu / Clip) into a QuantizeLinear: symmetric int8 per
tensor, run as an integer kernel. Without the rewrite, a conv kept float on request, by the fidelity repair or by
the target's float rule (a depthwise 5x5 conv, slower as an integer kernel) ran as a QLinearConv with per-tensor
weights. Both paths now give such an op its own DequantizeLinear written per axis (the same scale and zero-point
repeated): the same values, read literally; float in the graph ONNX Runtime runs; counted as the per-tensor pair it
is."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper

from quantship import Quantizer, export_qdq
from quantship.inspect.read.facts import read_file
from quantship.inspect.run.consumers import ort_optimized_ops, ort_session
from quantship.quantize_onnx.quantizer import quantize_onnx_file
from tests.quantize_onnx import graphs
from tests.quantize_onnx.test_int16_policy import _chain


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn_conv(3, 16, 3), nn_conv(16, 16, 3), torch.nn.Conv2d(16, 4, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def nn_conv(cin: int, cout: int, k: int) -> torch.nn.Conv2d:
    return torch.nn.Conv2d(cin, cout, k, padding=k // 2)


def _runs(path, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    name = ort_session(path).get_inputs()[0].name
    return tuple(ort_session(path, optimized=o).run(None, {name: x})[0] for o in (False, True))


def _assert_float_in_runtime(path, x: np.ndarray) -> None:
    ops = ort_optimized_ops(path)
    assert ops["QLinearConv"] == 2 and ops["Conv"] == 1, dict(ops)  # the middle conv runs float, the others integer
    facts = read_file(path)
    read = [q for q in facts.quant.of_role("activation") if q.node.endswith("_float_read")]
    assert len(read) == 1 and not read[0].per_channel and read[0].scale is not None  # one scale, written per axis
    assert facts.stats.n_per_channel == 2  # the two integer convs' weights only
    literal, fused = _runs(path, x)
    (step,) = facts.output_scales.values()  # run as written: the float conv's sums in another order move a
    assert np.abs(literal.astype(np.float64) - fused).max() <= 1.01 * step  # rounding by one step at most


def test_an_excluded_conv_between_integer_convs_runs_float_on_the_onnx_path(tmp_path):
    _chain(tmp_path / "float.onnx")
    x = graphs.images(40, shape=(3, 16, 16))
    done = quantize_onnx_file(tmp_path / "float.onnx", tmp_path / "q.onnx", x[:32], target="onnxruntime-cpu",
                              exclude=["conv2"])
    _assert_float_in_runtime(done.path, x[32:])


def test_a_skipped_module_between_integer_convs_runs_float_on_the_pytorch_path(tmp_path):
    torch.manual_seed(0)
    x = torch.from_numpy(graphs.images(40, shape=(3, 16, 16)))
    q = Quantizer.for_target("onnxruntime-cpu", skip_activations=["b"]).quantize(Chain().eval(), [x[:32]])
    _assert_float_in_runtime(export_qdq(q, x[:2], tmp_path / "q.onnx", target="onnxruntime-cpu"), x[32:].numpy())


def test_the_float_rules_depthwise_5x5_before_a_relu_stays_float(tmp_path):
    """onnxruntime-cpu's float rule keeps a depthwise 5x5 conv float (its integer kernel is slower); followed by a
    Relu, ONNX Runtime used to quantize it back into that kernel."""
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="dw", pads=[2, 2, 2, 2], group=16),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w3"], ["y"], name="conv3")]
    inits = [graphs.weight(16, 3, 3, 3, name="w1"), graphs.weight(16, 1, 5, 5, name="w2"),
             graphs.weight(4, 16, 1, 1, name="w3")]
    graphs.save(graphs.model(nodes, [graphs.value("x", ["n", 3, 16, 16])], [graphs.value("y", ["n", 4, 16, 16])],
                             inits), tmp_path / "float.onnx")
    x = graphs.images(40, shape=(3, 16, 16))
    done = quantize_onnx_file(tmp_path / "float.onnx", tmp_path / "q.onnx", x[:32], target="onnxruntime-cpu")
    assert "dw" in done.as_dict()["plan"]["kept_float"]  # the rule's choice
    _assert_float_in_runtime(done.path, x[32:])
    assert onnx.load(str(done.path)).opset_import[0].version >= 13


def test_two_excluded_convs_reading_one_tensor_get_one_read_and_a_valid_file(tmp_path):
    """Two float convs reading the same dequantized tensor (a detector's two branches after one activation): each
    once got its own per-axis read under the same output name, a file that breaks ONNX's single assignment (seen on
    nudenet's repair, "float for 16 node(s) gives no file"). They share one read now: the channels are the tensor's."""
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1")]
    for branch in ("a", "b"):
        nodes += [helper.make_node("Conv", ["r1", f"w_{branch}"], [f"c_{branch}"], name=f"conv_{branch}",
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c_{branch}"], [f"r_{branch}"], name=f"relu_{branch}"),
                  helper.make_node("Conv", [f"r_{branch}", f"w_{branch}2"], [f"y_{branch}"], name=f"head_{branch}")]
    nodes.append(helper.make_node("Add", ["y_a", "y_b"], ["y"], name="add"))
    inits = [graphs.weight(16, 3, 3, 3, name="w1"), graphs.weight(16, 16, 3, 3, name="w_a"),
             graphs.weight(16, 16, 3, 3, name="w_b"), graphs.weight(4, 16, 1, 1, name="w_a2"),
             graphs.weight(4, 16, 1, 1, name="w_b2")]
    graphs.save(graphs.model(nodes, [graphs.value("x", ["n", 3, 16, 16])], [graphs.value("y", ["n", 4, 16, 16])],
                             inits), tmp_path / "float.onnx")
    x = graphs.images(40, shape=(3, 16, 16))
    done = quantize_onnx_file(tmp_path / "float.onnx", tmp_path / "q.onnx", x[:32], target="onnxruntime-cpu",
                              exclude=["conv_a", "conv_b"])
    written = onnx.load(str(done.path))
    onnx.checker.check_model(written, full_check=True)
    outputs = [o for n in written.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs))  # single static assignment
    reads = [n for n in written.graph.node if n.name.endswith("_float_read")]
    assert len(reads) == 1 and len({n.input[0] for n in reads}) == 1
    assert ort_optimized_ops(done.path)["Conv"] == 2  # both branches' convs run float in ONNX Runtime
    literal, fused = _runs(done.path, x[32:])
    assert np.isfinite(literal).all() and np.isfinite(fused).all()
