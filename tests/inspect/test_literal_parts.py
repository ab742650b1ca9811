"""The literal reading of a large QDQ file, a few layers at a time (``inspect.run.literal``, issue 40).

Run part by part, a small multi-layer QDQ model gives the same bytes as one ``ORT_DISABLE_ALL`` session, for
every output (an intermediate one among them) and feeds of different batch sizes, read from memory or from a
file with external data; the split is chosen only when the dequantized weights exceed the part size, which a
small ``--max-memory`` lowers (``memory.literal_part_bytes``).
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from quantship.inspect.run import literal
from quantship.inspect.run.consumers import ort_session, run_onnxruntime
from quantship.quantize_onnx import memory

WIDTH, TOKENS, LAYERS = 32, 8, 5
WEIGHT_BYTES = WIDTH * WIDTH * (1 + 4)  # one layer's int8 weight and its float copy


def qdq_stack(layers: int = LAYERS) -> onnx.ModelProto:
    """``layers`` x (Q/DQ activation -> MatMul with a per-channel int8 weight -> Add bias -> LayerNorm with shared
    gamma/beta -> Relu -> residual Add); the second layer's output is a graph output too."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.float32(0.05), "act_scale"), numpy_helper.from_array(np.uint8(128), "act_zero"),
             numpy_helper.from_array(np.ones(WIDTH, np.float32), "gamma"),
             numpy_helper.from_array(np.zeros(WIDTH, np.float32), "beta")]
    nodes, x = [], "x"
    for i in range(layers):
        p = f"l{i}_"
        inits += [numpy_helper.from_array(rng.integers(-127, 128, (WIDTH, WIDTH)).astype(np.int8), p + "w"),
                  numpy_helper.from_array(rng.uniform(1e-3, 4e-3, WIDTH).astype(np.float32), p + "w_scale"),
                  numpy_helper.from_array(np.zeros(WIDTH, np.int8), p + "w_zero"),
                  numpy_helper.from_array(rng.standard_normal(WIDTH).astype(np.float32), p + "b")]
        nodes += [helper.make_node("QuantizeLinear", [x, "act_scale", "act_zero"], [p + "q"]),
                  helper.make_node("DequantizeLinear", [p + "q", "act_scale", "act_zero"], [p + "dq"]),
                  helper.make_node("DequantizeLinear", [p + "w", p + "w_scale", p + "w_zero"], [p + "wf"], axis=1),
                  helper.make_node("MatMul", [p + "dq", p + "wf"], [p + "mm"]),
                  helper.make_node("Add", [p + "mm", p + "b"], [p + "mb"]),
                  helper.make_node("LayerNormalization", [p + "mb", "gamma", "beta"], [p + "ln"], axis=-1),
                  helper.make_node("Relu", [p + "ln"], [p + "relu"]),
                  helper.make_node("Add", [x, p + "relu"], [p + "out"])]
        x = p + "out"
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", TOKENS, WIDTH])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("l1_out", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _whole(model: onnx.ModelProto | str) -> ort.InferenceSession:
    """One session read literally, as ``ort_session`` made it before the split."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_cpu_mem_arena = False
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((n, TOKENS, WIDTH), dtype=np.float32) * 3} for n in (1, 4, 3)]


def _same(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> None:
    assert len(got) == len(want)
    for outs, refs in zip(got, want):
        assert len(outs) == len(refs)
        for out, ref in zip(outs, refs):
            assert out.dtype == ref.dtype and out.shape == ref.shape and out.tobytes() == ref.tobytes()


def test_the_split_reading_gives_the_bytes_of_one_session():
    model = qdq_stack()
    feeds = _feeds()
    want = [_whole(model).run(None, feed) for feed in feeds]
    split = literal.split_session(model, limit=2 * WEIGHT_BYTES)
    assert split is not None and split.n_parts >= LAYERS // 2  # two layers' weights per part at most
    assert [o.name for o in split.get_outputs()] == ["l4_out", "l1_out"] and split.get_inputs()[0].name == "x"
    _same(split.run_feeds(feeds), want)
    _same([split.run(None, feed) for feed in feeds], want)  # one feed at a time, as InferenceSession.run
    one_per_part = literal.split_session(model, limit=1)  # each node alone: every boundary crossed
    assert one_per_part is not None and one_per_part.n_parts > 4 * LAYERS
    _same(one_per_part.run_feeds(feeds), want)
    # quantization moved the outputs: the comparison could fail
    assert not np.array_equal(want[0][0], feeds[0]["x"])


def test_a_file_with_external_data_is_split_and_read_the_same(tmp_path):
    model = qdq_stack()
    path = tmp_path / "q.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="q.onnx.data", size_threshold=0)
    feeds = _feeds()
    want = [_whole(str(path)).run(None, feed) for feed in feeds]
    assert isinstance(ort_session(path), ort.InferenceSession)  # small against the default part: one session
    with literal.parts_of_at_most(2 * WEIGHT_BYTES):
        session = ort_session(path)
        assert isinstance(session, literal.SplitSession) and session.n_parts >= 2
        _same(run_onnxruntime(path, feeds), want)
        assert isinstance(ort_session(path, optimized=True), ort.InferenceSession)  # fused: no float copy to split
    assert isinstance(ort_session(path), ort.InferenceSession)  # the budget ends with its block


def test_a_single_file_is_split_from_a_temporary_copy_of_its_weights_removed_with_the_session(tmp_path):
    model = qdq_stack()
    path = tmp_path / "q.onnx"
    onnx.save_model(model, str(path))
    feeds = _feeds()
    want = [_whole(str(path)).run(None, feed) for feed in feeds]
    split = literal.split_session(path, limit=2 * WEIGHT_BYTES)
    assert split is not None and split.n_parts >= 2
    folder = Path(split._base_dir)
    assert folder != tmp_path and (folder / "model.onnx.data").stat().st_size >= LAYERS * WIDTH * WIDTH
    assert not any(t.HasField("raw_data") and len(t.raw_data) >= 1024 for t in split._model.graph.initializer)
    _same(split.run_feeds(feeds), want)
    del split
    gc.collect()
    assert not folder.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx"]
    light = literal.graph_only(path)  # what check --run keeps beside its sessions: dims and types, no values
    assert {t.name: list(t.dims) for t in light.graph.initializer} == {
        t.name: list(t.dims) for t in model.graph.initializer}
    assert light.ByteSize() < model.ByteSize() - LAYERS * WIDTH * WIDTH


def test_a_small_max_memory_chooses_the_split_and_a_large_one_does_not():
    model = qdq_stack()
    needed = memory.estimate(1 << 20, [{"x": np.zeros((4, TOKENS, WIDTH), np.float32)}], mapped=True)
    tight = memory.literal_part_bytes(needed, memory.Room(needed.fixed + 3 * WEIGHT_BYTES, "--max-memory"))
    roomy = memory.literal_part_bytes(needed, memory.Room(needed.fixed + (64 << 30), "--max-memory"))
    assert tight == 3 * WEIGHT_BYTES and roomy == literal.LITERAL_PART_BYTES
    assert memory.literal_part_bytes(None, memory.Room(1, "--max-memory")) == literal.LITERAL_PART_BYTES
    with literal.parts_of_at_most(tight):
        assert isinstance(ort_session(model), literal.SplitSession)
    with literal.parts_of_at_most(roomy):
        assert isinstance(ort_session(model), ort.InferenceSession)


def test_a_graph_whose_output_is_a_stored_tensor_keeps_one_session():
    model = qdq_stack(2)
    model.graph.output.append(helper.make_tensor_value_info("gamma", TensorProto.FLOAT, [WIDTH]))
    assert literal.split_session(model, limit=1) is None


def test_nodes_out_of_order_keep_one_session():
    model = qdq_stack(2)
    nodes = list(model.graph.node)[::-1]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    assert literal.split_session(model, limit=1) is None
