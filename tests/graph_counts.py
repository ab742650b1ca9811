"""Counting helpers for converted pt2e graphs (test-side: the library checks files, not graphs)."""

from collections import Counter

import torch

qd = torch.ops.quantized_decomposed
aten = torch.ops.aten


def op_counts(graph_module) -> Counter:
    return Counter(n.target for n in graph_module.graph.nodes if n.op == "call_function")


def activation_zero_points(graph_module) -> list[int]:
    targets = {qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default}
    return [n.args[2] for n in graph_module.graph.nodes if n.op == "call_function" and n.target in targets]


def float_weighted_ops(graph_module) -> list[str]:
    weighted = {aten.conv2d.default, aten.linear.default, aten.conv1d.default}
    dq = {qd.dequantize_per_channel.default, qd.dequantize_per_tensor.default}
    return [
        n.name for n in graph_module.graph.nodes
        if n.op == "call_function" and n.target in weighted and getattr(n.args[1], "target", None) not in dq
    ]
