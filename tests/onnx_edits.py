"""Edits tests make to ONNX graphs to show what a check reacts to."""

import onnx


def strip_kernel_shape(model: onnx.ModelProto) -> int:
    """Remove ``kernel_shape`` from every Conv, in place; returns how many were removed."""
    removed = 0
    for node in model.graph.node:
        if node.op_type == "Conv":
            kept = [a for a in node.attribute if a.name != "kernel_shape"]
            removed += len(node.attribute) - len(kept)
            del node.attribute[:]
            node.attribute.extend(kept)
    return removed
