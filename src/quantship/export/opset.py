"""Opset lowering: make the file declare the opset asked for, or refuse by name.

The dynamo exporter writes opset 18. Going to 17 only changes the Reduce* family, whose ``axes``
moved from an attribute to an input in opset 18: constant axes move back to the attribute and the
constant that fed them is dropped. Axes computed at run time, or any other operator whose opset-18
form differs from its opset-17 one, are refused with the node named.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from quantship.errors import OpsetRefused

# operators whose only change at opset 18 is axes: attribute -> optional input
AXES_MOVED_AT_18 = frozenset({
    "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
})
LOWEST_OPSET = 17
INT16_OPSET = 21  # QuantizeLinear / DequantizeLinear accept int16 / uint16 zero-points from opset 21


def _since(op_type: str, opset: int) -> int | None:
    try:
        return onnx.defs.get_schema(op_type, opset, "").since_version
    except onnx.defs.SchemaError:
        return None


def constant_axes(value: ir.Value) -> list[int] | None:
    """The axes a stored tensor or a Constant node holds; None when they are computed."""
    if value.const_value is not None:
        return [int(a) for a in value.const_value.numpy().reshape(-1)]
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return [int(a) for a in producer.attributes["value"].as_tensor().numpy().reshape(-1)]
    return None


def _drop_if_unused(graph: ir.Graph, value: ir.Value) -> None:
    if value.uses() or value.is_graph_output():
        return
    if value.is_initializer() and value.name in graph.initializers:
        del graph.initializers[value.name]
        return
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant":
        graph.remove(producer, safe=True)


def _lower_axes(graph: ir.Graph, node: ir.Node) -> None:
    axes_value = node.inputs[1] if len(node.inputs) > 1 else None
    noop = node.attributes.get("noop_with_empty_axes")
    noop_on = noop is not None and noop.as_int() == 1
    if axes_value is None:
        if noop_on:
            raise OpsetRefused(f"{node.op_type} {node.name!r} has no axes and noop_with_empty_axes=1, which "
                               "opset 17 cannot express")
    else:
        axes = constant_axes(axes_value)
        if axes is None:
            raise OpsetRefused(
                f"{node.op_type} {node.name!r} reads its axes from {axes_value.name!r}, a value computed at "
                "run time; opset 17 needs them as a constant attribute. Export at opset_version=18."
            )
        if not axes and noop_on:
            raise OpsetRefused(f"{node.op_type} {node.name!r} has empty axes with noop_with_empty_axes=1")
        node.resize_inputs(1)
        if axes:
            node.attributes["axes"] = ir.AttrInt64s("axes", axes)
        _drop_if_unused(graph, axes_value)
    node.attributes.pop("noop_with_empty_axes", None)


def lower_opset(model: ir.Model, target: int) -> int:
    """Rewrite ``model`` in place to declare opset ``target``; returns the number of nodes rewritten."""
    current = model.opset_imports.get("")
    if current == target:
        return 0
    if current is None or current < target:
        raise OpsetRefused(f"the exporter wrote opset {current}, below the requested {target}; raising "
                           "an opset is not something export_qdq rewrites")
    if target < LOWEST_OPSET or current != 18:
        raise OpsetRefused(f"opset_version={target}: quantship lowers opset 18 to {LOWEST_OPSET} only "
                           f"(the exporter wrote {current})")
    n_rewritten = 0
    for node in list(model.graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        since_new, since_old = _since(node.op_type, current), _since(node.op_type, target)
        if since_old is None:
            raise OpsetRefused(f"{node.op_type} {node.name!r} does not exist at opset {target}")
        if since_new == since_old:
            continue
        if node.op_type not in AXES_MOVED_AT_18:
            raise OpsetRefused(
                f"{node.op_type} {node.name!r} needs opset {since_new} (its opset-{target} form differs); "
                f"export at opset_version={current}"
            )
        _lower_axes(model.graph, node)
        n_rewritten += 1
    model.opset_imports[""] = target
    model.graph.opset_imports[""] = target
    return n_rewritten
