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


def doubled_scale_pass():
    """An export pass (the pass class, for ``qdq.PASSES``) whose rewrite is not exact: it doubles the
    scale of the first QuantizeLinear, so its ``ensures()`` must refuse the graph by name."""
    import onnx_ir as ir

    import quantship.export.qdq as qdq

    class DoubledScale(qdq.KernelShapePass):
        what = "doubling one activation scale"

        def rewrite(self, model):
            node = next(n for n in model.graph if n.op_type == "QuantizeLinear")
            doubled = ir.Value(name="doubled_scale", const_value=ir.tensor(node.inputs[1].const_value.numpy() * 2))
            model.graph.register_initializer(doubled)
            node.replace_input_with(1, doubled)
            return 1

    return DoubledScale
