"""One Conv in ONNX Runtime: its float NCHWc kernel against the QLinearConv its QDQ form fuses into.

The evidence behind the ``onnxruntime-cpu`` float rules for Convs (``export.roles, read from the target's float_rules``):
for each shape, a float file (the Conv with its float weight) and a QDQ file (uint8 activation pair on
the input, int8 per-channel weight, uint8 pair on the output: what ``quantize-onnx`` writes around a
Conv between two quantized layers) are timed in the same process, interleaved run by run, one
intra-op thread (the machine may be shared), median of ``--reps`` runs each.

    python bench/conv_speed.py
    python bench/conv_speed.py --smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import _smoke
import numpy as np
from onnx import TensorProto, helper, numpy_helper

SHAPES = (  # (input channels, output channels, kernel, group, input side, stride): stems first
    (1, 16, 3, 1, 160, 1), (3, 10, 3, 1, 200, 1), (3, 16, 3, 1, 320, 2), (3, 32, 3, 1, 224, 2),
    (3, 64, 7, 1, 224, 2), (3, 16, 1, 1, 112, 1), (4, 16, 3, 1, 160, 1), (8, 16, 3, 1, 112, 1),
    (10, 16, 3, 1, 112, 1), (16, 32, 3, 1, 112, 1), (32, 32, 3, 1, 56, 1), (64, 64, 3, 1, 56, 1),
    (32, 64, 1, 1, 56, 1), (32, 32, 3, 32, 112, 1), (64, 64, 5, 64, 56, 1),
)


def conv_model(cin: int, cout: int, k: int, group: int, side: int, stride: int, quantized: bool,
               rng: np.random.Generator) -> bytes:
    w = (rng.standard_normal((cout, cin // group, k, k)) * 0.1).astype(np.float32)
    attrs = {"pads": [k // 2] * 4, "group": group, "strides": [stride, stride]}
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, side, side])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    if not quantized:
        nodes, inits = [helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], [numpy_helper.from_array(w, "w")]
    else:
        scale = (np.abs(w).reshape(cout, -1).max(1) / 127).astype(np.float32)
        wq = np.clip(np.rint(w / scale.reshape(-1, 1, 1, 1)), -127, 127).astype(np.int8)
        inits = [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(scale, "ws"),
                 numpy_helper.from_array(np.zeros(cout, np.int8), "wz"),
                 numpy_helper.from_array(np.array(0.02, np.float32), "s_in"),
                 numpy_helper.from_array(np.array(0.05, np.float32), "s_out"),
                 numpy_helper.from_array(np.array(128, np.uint8), "z")]
        nodes = [helper.make_node("QuantizeLinear", ["x", "s_in", "z"], ["xq"]),
                 helper.make_node("DequantizeLinear", ["xq", "s_in", "z"], ["xd"]),
                 helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0),
                 helper.make_node("Conv", ["xd", "w"], ["c"], **attrs),
                 helper.make_node("QuantizeLinear", ["c", "s_out", "z"], ["cq"]),
                 helper.make_node("DequantizeLinear", ["cq", "s_out", "z"], ["y"])]
    graph = helper.make_graph(nodes, "conv", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def session(model: bytes):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def time_pair(shape: tuple[int, ...], reps: int, rng: np.random.Generator) -> tuple[float, float, str]:
    cin, cout, k, group, side, stride = shape
    models = [conv_model(*shape, quantized=q, rng=np.random.default_rng(0)) for q in (False, True)]
    sessions, fused = [session(m) for m in models], fused_ops(models[1])
    x = {"x": rng.standard_normal((1, cin, side, side)).astype(np.float32)}
    times: list[list[float]] = [[], []]
    for _ in range(3):
        for s in sessions:
            s.run(None, x)
    for _ in range(reps):
        for i, s in enumerate(sessions):
            start = time.perf_counter()
            s.run(None, x)
            times[i].append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[0]), 1e3 * statistics.median(times[1]), fused


def fused_ops(model: bytes) -> str:
    """The compute op ONNX Runtime's optimized graph runs for the QDQ file (QLinearConv when it fuses)."""
    import tempfile
    from pathlib import Path

    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        ops = [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]
    return next((op for op in ops if "Conv" in op), "no Conv")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=25)
    args = _smoke.parse_args(parser, argv, reps=2)
    shapes = SHAPES[:2] if args.smoke else SHAPES
    rng = np.random.default_rng(1)
    lines = [*_smoke.banner(args), *_smoke.cpu_lines("One Conv: float NCHWc against QDQ (QLinearConv), 1 thread"),
             "| input channels | output channels | kernel | group | input side | stride | float ms | QDQ ms | "
             "float / QDQ | QDQ runs as |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape in shapes:
        fp, q, fused = time_pair(shape, args.reps, rng)
        lines.append("| " + " | ".join(str(v) for v in shape) + f" | {fp:.3f} | {q:.3f} | {fp / q:.2f}x | {fused} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
