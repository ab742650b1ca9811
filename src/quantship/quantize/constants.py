"""Constants the model computes on every call from a tensor constructor, stored once before annotation.

A decoder builds some of its inputs from ``arange`` at its (static) sequence length: GPT-2's position
embedding ``wpe(arange(T))``, Llama's RoPE table ``cos(inv_freq x arange(T))`` and its ``sin``. Their
values never depend on an input, so the annotator treats them as constants and gives the op that
reads them the per-tensor weight form. torchao's ``convert_pt2e`` does not fold a subgraph that
starts from a constructor (its constant folder skips constructors), so the quantize node stayed in
the graph; the ONNX exporter then folds the float value into an initializer and the file quantizes a
stored tensor on every run, which ``export_qdq`` refuses for a uint8 file. Stored here as a buffer,
the value is folded by ``convert_pt2e`` into an int8 tensor like every other constant operand.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

BUFFER_PREFIX = "_quantship_constant_"


def _args(node: Node) -> list[Node]:
    found: list[Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def attribute(model: GraphModule, target: str) -> object:
    """What a ``get_attr`` node's dotted ``target`` names on ``model`` (a parameter, a buffer, a constant)."""
    value: object = model
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _sources(node: Node, memo: dict[Node, tuple[bool, bool]], model: GraphModule) -> tuple[bool, bool]:
    """(reaches a constructor, reaches what must stay live) over ``node``'s ancestors: a parameter, a random
    op, or a model input (a ``new_zeros`` template the annotator counts as constant)."""
    if node in memo:
        return memo[node]
    if node.op == "get_attr":
        result = (False, isinstance(attribute(model, str(node.target)), torch.nn.Parameter))
    elif node.op != "call_function":
        result = (False, True)
    else:
        inputs = _args(node)
        seeded = isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags
        result = (not inputs, seeded)
        for a in inputs:
            constructor, live = _sources(a, memo, model)
            result = (result[0] or constructor, result[1] or live)
    memo[node] = result
    return result


def _evaluate(node: Node, values: dict[Node, object], model: GraphModule) -> object:
    """The real value of a constant node (its ancestors evaluated once, in the graph's order)."""
    if node not in values:
        if node.op == "get_attr":
            values[node] = attribute(model, str(node.target))
        else:
            for a in _args(node):
                _evaluate(a, values, model)
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
            values[node] = node.target(*args, **kwargs)
    return values[node]


def _fake(model: GraphModule, value: torch.Tensor, like: Node) -> object:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([like.meta["val"]]) if isinstance(like.meta.get("val"), torch.Tensor) else None
    return mode.from_tensor(value) if mode is not None else value


def store_constructed_constants(model: GraphModule, is_constant: Callable[[Node], bool]) -> int:
    """Store in a buffer each constant built from a tensor constructor (and no parameter, no random op, no
    model input) where it meets the rest of the graph: read by an input-dependent node (a float value: Llama's cos
    and sin) or by a constant that also reads a parameter (GPT-2's position ids, whose embedding
    lookup convert_pt2e then folds); return how many were stored.

    Each value is the one torch computes at this graph's static shapes, so the output is unchanged.
    A parameter stays a parameter (quantization-aware training updates it)."""
    graph = model.graph
    memo: dict[Node, tuple[bool, bool]] = {}
    values: dict[Node, object] = {}
    n, suffix = 0, 0
    with torch.no_grad():
        for node in list(graph.nodes):
            if node.op != "call_function" or not is_constant(node):
                continue
            constructor, live = _sources(node, memo, model)
            if not constructor or live:
                continue
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            to_input = val.is_floating_point() and any(not is_constant(user) for user in node.users)
            # a constant that also reads a parameter (an embedding table): convert_pt2e folds it once this is stored
            to_parameter = any(is_constant(user) and user.op == "call_function" and _sources(user, memo, model)[1]
                               for user in node.users)
            if not (to_input or to_parameter):
                continue  # read only by constants of the same kind (the one to store is further down) or a mask
            value = _evaluate(node, values, model)
            if not isinstance(value, torch.Tensor):
                continue
            while hasattr(model, f"{BUFFER_PREFIX}{suffix}"):
                suffix += 1
            name = f"{BUFFER_PREFIX}{suffix}"
            model.register_buffer(name, value.detach().clone().contiguous())
            with graph.inserting_before(node):
                stored = graph.get_attr(name)
            stored.meta["val"] = _fake(model, getattr(model, name), node)
            node.replace_all_uses_with(stored)
            n += 1
    if n:
        for node in reversed(list(graph.nodes)):  # the constant chains no one reads any more
            if node.op == "call_function" and not node.users and is_constant(node) and not node.is_impure():
                graph.erase_node(node)
        graph.lint()
        model.recompile()
    return n
