"""Graph rewrites applied before annotation, so that every product the model computes is a node
the annotator can quantize.

``scaled_dot_product_attention`` is one fused aten op: left whole, its two matrix products stay
float in the exported file. ``decompose_attention`` rewrites it into the arithmetic it stands for

    softmax(mask(matmul(q * scale, k^T))) @ v

so that both products become activation x activation ``matmul`` nodes (quantized on both inputs,
integer MatMuls in ONNX Runtime). The rewrite keeps each node's module path and computes every
new node's fake value, so the annotator sees the same metadata as on a captured node.
"""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import GraphModule, Node

from quantship.quantize.constants import attribute

aten = torch.ops.aten
ATTENTION_OPS = {aten.scaled_dot_product_attention.default}
EINSUM_OPS = {aten.einsum.default}
# products of an activation by a constant [in, out] weight, rewritten into linear layers
PRODUCT_WEIGHT_OPS = {aten.addmm.default, aten.mm.default, aten.matmul.default}
# products and sums ONNX Runtime fuses (QLinearMul, QLinearAdd) once both inputs are dequantized
SCALAR_OPERAND_OPS = {aten.mul.Tensor, aten.add.Tensor}
_ARG_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")



def _swap(graph, node: Node, out: Node) -> None:
    """``out`` takes every use of ``node``, which leaves the graph."""
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _recompiled(model: GraphModule, n: int) -> int:
    """After ``n`` rewrites of ``model``'s graph: check it and regenerate the code (nothing to do for 0)."""
    if n:
        model.graph.lint()
        model.recompile()
    return n

def _fake_value(target, args: tuple, kwargs: dict) -> object:
    """Run ``target`` on the fake values of its node arguments (shapes and dtypes only)."""
    from torch._guards import detect_fake_mode

    def val(a):
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a.meta["val"] if isinstance(a, Node) else a

    values = tuple(val(a) for a in args)
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if mode is None:
        return target(*values, **kwargs)
    with mode:
        return target(*values, **kwargs)


def _insert(graph, target, args: tuple, like: Node, **kwargs) -> Node:
    node = graph.call_function(target, args, kwargs)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    node.meta["val"] = _fake_value(target, args, kwargs)
    return node


def _scalar_constant(model: GraphModule, value: float, like: Node) -> Node:
    """A 0-d buffer holding ``value`` (``like``'s dtype), read by a get_attr node: a tensor the
    annotator quantizes like any other constant, where a Python float would stay a float literal."""
    return _tensor_constant(model, torch.tensor(value, dtype=like.meta["val"].dtype), like, "scale")


def _tensor_constant(model: GraphModule, value: torch.Tensor, like: Node, stem: str) -> Node:
    """A buffer holding ``value`` under the first free name ``_quantship_{stem}_{n}``, read by a get_attr node whose
    fake value (in ``like``'s fake mode) the annotator can read."""
    from torch._guards import detect_fake_mode

    n = 0
    while hasattr(model, f"_quantship_{stem}_{n}"):
        n += 1
    name = f"_quantship_{stem}_{n}"
    model.register_buffer(name, value)
    node = model.graph.get_attr(name)
    mode = detect_fake_mode([like.meta["val"]])
    buffer = getattr(model, name)
    node.meta["val"] = mode.from_tensor(buffer) if mode is not None else buffer
    return node


def _attention_args(node: Node) -> dict:
    args = dict(zip(_ARG_NAMES, node.args))
    args.update(node.kwargs)
    return args


def decomposable(node: Node) -> bool:
    """An attention node this rewrite reproduces exactly: no dropout, no grouped-query heads."""
    args = _attention_args(node)
    return not args.get("dropout_p") and not args.get("enable_gqa", False)


def decompose_attention(model: GraphModule) -> int:
    """Rewrite each decomposable ``scaled_dot_product_attention`` node in place; return how many."""
    graph = model.graph
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in ATTENTION_OPS or not decomposable(node):
            continue
        a = _attention_args(node)
        q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
        q_val, k_val = q.meta["val"], k.meta["val"]
        scale = a.get("scale")
        if scale is None:
            scale = 1.0 / math.sqrt(q_val.shape[-1])
        with graph.inserting_before(node):
            scaled_q = _insert(graph, aten.mul.Tensor, (q, float(scale)), node)
            k_t = _insert(graph, aten.transpose.int, (k, -2, -1), node)
            scores = _insert(graph, aten.matmul.default, (scaled_q, k_t), node)
            if a.get("is_causal"):
                size = (q_val.shape[-2], k_val.shape[-2])
                ones = _insert(graph, aten.ones.default, (list(size),), node, dtype=torch.bool)
                mask = _insert(graph, aten.tril.default, (ones,), node)
            if isinstance(mask, Node):
                if mask.meta["val"].dtype == torch.bool:
                    scores = _insert(graph, aten.where.ScalarOther, (mask, scores, float("-inf")), node)
                else:
                    scores = _insert(graph, aten.add.Tensor, (scores, mask), node)
            weights = _insert(graph, aten.softmax.int, (scores, -1), node)
            out = _insert(graph, aten.matmul.default, (weights, v), node)
        _swap(graph, node, out)
        n += 1
    return _recompiled(model, n)


def _unit(value: object) -> bool:
    return value is None or (not isinstance(value, bool) and value == 1)


def linear_from_matmul(model: GraphModule, is_constant) -> int:
    """Rewrite each product of an input-dependent tensor by a constant 2-D weight stored [in, out] --
    ``addmm(bias, x, W)`` (GPT-2's ``Conv1D``), ``mm(x, W)``, ``matmul(x, W)`` -- into
    ``linear(x, W.t(), bias)``; return how many.

    The annotator then quantizes ``W.t()`` per output channel (axis 0 of ``[out, in]``) as a linear
    layer's weight, where the product would have quantized W per tensor as a second activation. The
    transpose is computed on the constant: convert_pt2e folds it into the stored int8 weight."""
    graph = model.graph
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in PRODUCT_WEIGHT_OPS:
            continue
        addmm = node.target is aten.addmm.default
        if addmm and not (_unit(node.kwargs.get("beta")) and _unit(node.kwargs.get("alpha"))):
            continue
        bias, (x, w) = (node.args[0], node.args[1:3]) if addmm else (None, node.args[:2])
        if len(node.args) != (3 if addmm else 2) or not all(isinstance(a, Node) for a in (x, w)):
            continue
        w_val, x_val = w.meta.get("val"), x.meta.get("val")
        if not isinstance(w_val, torch.Tensor) or not isinstance(x_val, torch.Tensor):
            continue
        if w_val.dim() != 2 or x_val.dim() < 2 or not w_val.is_floating_point() or is_constant(x) or not is_constant(w):
            continue
        if addmm:
            b_val = bias.meta.get("val") if isinstance(bias, Node) else None
            if (not isinstance(b_val, torch.Tensor) or b_val.dim() != 1 or b_val.shape[0] != w_val.shape[1]
                    or not is_constant(bias)):
                continue
        with graph.inserting_before(node):
            w_t = _insert(graph, aten.t.default, (w,), node)
            out = _insert(graph, aten.linear.default, (x, w_t) if bias is None else (x, w_t, bias), node)
        _swap(graph, node, out)
        n += 1
    return _recompiled(model, n)


def flatten_linear_inputs(model: GraphModule) -> int:
    """Feed every ``linear`` on an N-D input (N > 2) a 2-D view, and restore the shape after.

    The ONNX exporter writes a 2-D linear as one Gemm reading the weight's DequantizeLinear
    directly; an N-D one becomes MatMul(x, Transpose(weight)), whose weight input is no longer a
    dequantized tensor. The views share their input's scale, so no rounding is added, and torch
    computes an N-D linear on this same flattened view. A symbolic dimension between the first and
    the last is read back with ``sym_size`` for the restoring reshape.
    """
    graph = model.graph
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        x = node.args[0]
        shape = x.meta["val"].shape if isinstance(x, Node) and "val" in x.meta else None
        if shape is None or len(shape) <= 2 or not isinstance(shape[-1], int):
            continue
        out_features = node.meta["val"].shape[-1]
        with graph.inserting_before(node):
            # a symbolic middle dimension (MultiheadAttention's batch, sequence-first) is read at run time
            sizes = {i: _insert(graph, aten.sym_size.int, (x, i), node)
                     for i, d in enumerate(shape[1:-1], start=1) if not isinstance(d, int)}
            flat = _insert(graph, aten.flatten.using_ints, (x, 0, len(shape) - 2), node)
        node.replace_input_with(x, flat)
        node.meta["val"] = _fake_value(node.target, node.args, dict(node.kwargs))
        with graph.inserting_after(node):
            middle = [sizes.get(i, d) for i, d in enumerate(shape[1:-1], start=1)]
            restored = _insert(graph, aten.reshape.default, (node, [-1, *middle, out_features]), node)
        for user in list(node.users):
            if user is not restored:
                user.replace_input_with(node, restored)
        n += 1
    return _recompiled(model, n)


def batched_matmul_form(equation: str) -> bool | None:
    """For a two-operand einsum that is a batched matrix product, whether the second operand enters
    transposed ('bik,bjk->bij': True; 'bik,bkj->bij': False); None for any other equation.

    Batch labels must be the same, in the same order, on both operands and the output."""
    compact = equation.replace(" ", "")
    if "." in compact or "->" not in compact:
        return None
    operands, out = compact.split("->")
    parts = operands.split(",")
    if len(parts) != 2:
        return None
    a, b = parts
    if not (len(a) == len(b) == len(out) >= 2) or any(len(set(t)) != len(t) for t in (a, b, out)):
        return None
    batch, (i, k) = a[:-2], a[-2:]
    if b[:-2] != batch or out[:-2] != batch or out[-2] != i:
        return None
    j = out[-1]
    if len({i, j, k}) != 3 or {i, j, k} & set(batch):
        return None
    if b[-2:] == j + k:
        return True
    if b[-2:] == k + j:
        return False
    return None


def decompose_einsum(model: GraphModule) -> int:
    """Rewrite each two-operand ``einsum`` that is a batched matrix product into ``matmul`` (with a
    transpose of the second operand where the equation asks for one); return how many.

    ONNX Runtime has no integer Einsum; a MatMul between two DequantizeLinear and a QuantizeLinear
    becomes QLinearMatMul. Other equations are left as they are."""
    graph = model.graph
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in EINSUM_OPS:
            continue
        equation, operands = node.args[0], node.args[1]
        transpose = batched_matmul_form(equation) if isinstance(equation, str) and len(operands) == 2 else None
        if transpose is None or not all(isinstance(t, Node) for t in operands):
            continue
        a, b = operands
        with graph.inserting_before(node):
            if transpose:
                b = _insert(graph, aten.transpose.int, (b, -2, -1), node)
            out = _insert(graph, aten.matmul.default, (a, b), node)
        _swap(graph, node, out)
        n += 1
    return _recompiled(model, n)


def scalars_as_constants(model: GraphModule) -> int:
    """Replace the Python number operand of each ``mul``/``add`` of a float tensor (the attention
    scale of ``decompose_attention``, ``q * scale`` in MaxViT's and Swin's attention) by a stored 0-d
    constant; return how many.

    A literal stays a float initializer in the file, and ONNX Runtime runs the op in float between a
    DequantizeLinear and a QuantizeLinear; a stored constant is quantized like any other (its value
    is the largest integer of its grid times its own scale), and the op runs as QLinearMul/QLinearAdd."""
    n = 0
    for node in list(model.graph.nodes):
        if node.op != "call_function" or node.target not in SCALAR_OPERAND_OPS or node.kwargs or len(node.args) != 2:
            continue
        a, b = node.args
        tensor, number = (a, b) if isinstance(a, Node) else (b, a)
        val = tensor.meta.get("val") if isinstance(tensor, Node) else None
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            continue
        with model.graph.inserting_before(node):
            constant = _scalar_constant(model, float(number), tensor)
        node.args = (tensor, constant) if tensor is a else (constant, tensor)
        n += 1
    if n:
        model.graph.lint()
        model.recompile()
    return n


def _out_of_place(target: object) -> object | None:
    """The functional overload of an in-place aten op (``relu_`` -> ``relu``), or None."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return None
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(aten, name[:-1], None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    if overload is None or overload._schema.is_mutable:
        return None
    return overload


def _returns_alias(node: Node) -> bool:
    """True when ``node`` returns a view of an input (``reshape``, ``slice``...: an aliased result)."""
    schema = getattr(node.target, "_schema", None)
    return schema is None or not schema.returns or schema.returns[0].alias_info is not None


def _sole_owner(node: Node, mutated: Node) -> bool:
    """True when ``node`` is the only reader of the storage of ``mutated``: every tensor from the op
    that allocated it, through the views taken of it, has exactly one reader, the next link."""
    reader = node
    while True:
        if mutated.op != "call_function" or len(mutated.users) != 1 or reader not in mutated.users:
            return False
        if not _returns_alias(mutated):
            return True
        reader, mutated = mutated, mutated.args[0] if mutated.args else None
        if not isinstance(mutated, Node):
            return False


def out_of_place_on_constants(model: GraphModule, is_constant) -> int:
    """Make each in-place op on a constant tensor (``is_constant``) whose storage nothing else reads
    functional (``relu_`` -> ``relu``); return how many.

    convert_pt2e folds a constant subgraph (Swin V2's position-bias MLP on its coordinate table, whose
    ``ReLU(inplace=True)`` is captured as ``relu_``) into the stored tensor its quantized consumer reads,
    and then drops the nodes left without users; an in-place node counts as a side effect and would keep
    the float chain before it alive. A mutation of a parameter, a buffer, or a tensor some other node
    reads (Swin V2's ``qkv_bias[n:2n].zero_()`` on a slice of a copy the linear then reads) is left as is."""
    n = 0
    for node in list(model.graph.nodes):
        if node.op != "call_function" or not node.args:
            continue
        functional = _out_of_place(node.target)
        mutated = node.args[0]
        if functional is None or not isinstance(mutated, Node) or not is_constant(node):
            continue
        if not _sole_owner(node, mutated):
            continue
        node.target = functional
        n += 1
    if n:
        model.graph.lint()
        model.recompile()
    return n


_CLAMPS = {aten.clamp.default, aten.clip.default, aten.hardtanh.default}


def _number(model: GraphModule, value: object) -> float | None:
    """A Python number, or the one value of a stored 0-d / 1-element constant (``get_attr``); else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, Node) and value.op == "get_attr":
        stored = attribute(model, str(value.target))
        if isinstance(stored, torch.Tensor) and stored.numel() == 1:
            return float(stored.reshape(()).item())
    return None


def _only_user(node: object, user: Node) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and set(node.users) == {user}


def _relu6_of_plus_3(model: GraphModule, gate: object, x: Node) -> list[Node] | None:
    """``[add, clamp]`` when ``gate`` is ``clamp(x + 3, 0, 6)``."""
    if not isinstance(gate, Node) or gate.op != "call_function" or gate.target not in _CLAMPS or gate.kwargs:
        return None
    bounds = [_number(model, b) for b in gate.args[1:3]]
    if len(gate.args) != 3 or bounds != [0.0, 6.0]:
        return None
    plus = gate.args[0]
    if not _only_user(plus, gate) or plus.target is not aten.add.Tensor or len(plus.args) != 2 or plus.kwargs:
        return None
    a, b = plus.args
    if not ((a is x and _number(model, b) == 3.0) or (b is x and _number(model, a) == 3.0)):
        return None
    return [plus, gate]


def hard_swish_as_one_op(model: GraphModule) -> int:
    """Replace each hard swish written out as ``x * clamp(x + 3, 0, 6) / 6`` (or ``x * (clamp(x + 3, 0, 6) / 6)``,
    as a model converted from ONNX has it) by one ``aten.hardswish``, which PyTorch computes the same way,
    operation for operation; return how many. The file then carries one HardSwish, as the ONNX path writes
    it, where a runtime runs it as one op faster than four (``Target.hard_swish_faster_as_one_op``)."""
    n = 0
    for end in list(model.graph.nodes):
        if end.op != "call_function" or end.kwargs:
            continue
        found = None
        if end.target is aten.div.Tensor and len(end.args) == 2 and _number(model, end.args[1]) == 6.0:
            product = end.args[0]  # (x * gate) / 6
            if _only_user(product, end) and product.target is aten.mul.Tensor and len(product.args) == 2:
                for x, gate in (product.args, product.args[::-1]):
                    inner = _relu6_of_plus_3(model, gate, x) if isinstance(x, Node) and _only_user(gate, product) \
                        else None
                    if inner is not None:
                        found = (x, [*inner, product, end])
                        break
        elif end.target is aten.mul.Tensor and len(end.args) == 2:  # x * (gate / 6)
            for x, sixth in (end.args, end.args[::-1]):
                if not (isinstance(x, Node) and _only_user(sixth, end) and sixth.target is aten.div.Tensor
                        and len(sixth.args) == 2 and _number(model, sixth.args[1]) == 6.0):
                    continue
                inner = _relu6_of_plus_3(model, sixth.args[0], x) if _only_user(sixth.args[0], sixth) else None
                if inner is not None:
                    found = (x, [*inner, sixth, end])
                    break
        if found is None:
            continue
        x, nodes = found
        with model.graph.inserting_before(end):
            swish = model.graph.call_function(aten.hardswish.default, (x,))
        swish.meta = dict(end.meta)
        end.replace_all_uses_with(swish)
        for node in reversed(nodes):
            model.graph.erase_node(node)
        n += 1
    if n:
        model.graph.eliminate_dead_code()
        model.graph.lint()
        model.recompile()
    return n


# eval-mode batch norms: (input, weight, bias, running_mean, running_var) come first in both; eps is the last
# argument of each (batch_norm has cudnn_enabled after it, at index 8)
_BATCH_NORM_EPS = {aten.batch_norm.default: 7, aten._native_batch_norm_legit_no_training.default: 6}


def _batch_norm_constants(model: GraphModule, node: Node) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(factor, shift) of an eval-mode batch norm whose statistics are stored: ``y = x * factor + shift``."""
    args = node.args
    if node.target is aten.batch_norm.default and (len(args) < 9 or args[5]):  # training mode: batch statistics
        return None
    stored = args[1:5]
    if not all(isinstance(a, Node) and a.op == "get_attr" for a in stored[2:]) \
            or not all(a is None or (isinstance(a, Node) and a.op == "get_attr") for a in stored[:2]):
        return None
    weight, bias, mean, var = (None if a is None else attribute(model, a.target).detach().double() for a in stored)
    eps = float(args[_BATCH_NORM_EPS[node.target]])
    factor = torch.rsqrt(var + eps) * (weight if weight is not None else 1.0)
    shift = (bias if bias is not None else 0.0) - mean * factor
    return factor, shift


def batch_norm_as_affine(model: GraphModule, folds_into: set) -> int:
    """Write each eval-mode batch norm whose input no op of ``folds_into`` produces (prepare_pt2e folds those into
    their conv) as ``x * factor + shift``, per channel at the input's rank; return how many. For a
    target whose runtime runs BatchNormalization only folded into a Conv (``Target.runs_lone_batch_norm``): the
    mul and the add are then quantized like any other, as the ONNX path's ``batch_norm_written_out`` has them."""
    graph = model.graph
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _BATCH_NORM_EPS:
            continue
        x = node.args[0]
        if isinstance(x, Node) and x.op == "call_function" and x.target in folds_into:
            continue
        val = x.meta.get("val") if isinstance(x, Node) else None
        constants = _batch_norm_constants(model, node)
        if constants is None or not isinstance(val, torch.Tensor) or val.dim() < 2:
            continue
        if node.target is aten.batch_norm.default:
            out = node
        else:  # (output, saved mean, saved rstd): only the output may be read
            readers = list(node.users)
            if any(r.target is not operator.getitem or r.args[1] != 0 for r in readers) or len(readers) != 1:
                continue
            out = readers[0]
        per_channel = (1, -1) + (1,) * (val.dim() - 2)
        factor, shift = (c.to(val.dtype).reshape(per_channel) for c in constants)
        with graph.inserting_before(node):
            a = _tensor_constant(model, factor, x, "bn_factor")
            b = _tensor_constant(model, shift, x, "bn_shift")
            scaled = _insert(graph, aten.mul.Tensor, (x, a), node)
            shifted = _insert(graph, aten.add.Tensor, (scaled, b), node)
        out.replace_all_uses_with(shifted)
        if out is not node:
            graph.erase_node(out)
        graph.erase_node(node)
        n += 1
    if n:
        graph.eliminate_dead_code()
    return _recompiled(model, n)


def _last_axis_mean(node: object, x: object) -> bool:
    """``node`` is ``mean(x, [-1], keepdim=True)`` (the last axis, by either spelling)."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is aten.mean.dim
            and len(node.args) >= 3 and node.args[0] is x and node.args[2] is True and not node.kwargs):
        return False
    rank = x.meta["val"].dim() if isinstance(x, Node) and isinstance(x.meta.get("val"), torch.Tensor) else None
    return list(node.args[1]) in ([-1], [rank - 1] if rank else [-1])


def _stored_row(model: GraphModule, value: object, width: int) -> bool:
    """``value`` reads a stored tensor of ``width`` values along the last axis (a layer norm's scale or bias)."""
    if not (isinstance(value, Node) and value.op == "get_attr"):
        return False
    stored = attribute(model, str(value.target))
    return isinstance(stored, torch.Tensor) and stored.dim() >= 1 and stored.numel() == width \
        and stored.shape[-1] == width


def _written_out_layer_norm(model: GraphModule, root: Node) -> tuple[Node, float, Node, Node | None, Node] | None:
    """(x, eps, scale, bias or None, the last node) when ``root`` is the Sqrt of ``x``'s layer norm written out:
    ``d = x - mean(x)``, ``sqrt(mean(d ** 2) + eps)`` (or ``d * d``), ``d / that * scale (+ bias)``, over the last
    axis, every inner value read only inside the pattern."""
    plus = root.args[0]
    if not _only_user(plus, root) or plus.target is not aten.add.Tensor or len(plus.args) != 2:
        return None
    variance, eps = next(((v, _number(model, e)) for v, e in (plus.args, plus.args[::-1])
                          if _number(model, e) is not None and isinstance(v, Node)), (None, None))
    if variance is None or not _only_user(variance, plus):
        return None
    square = variance.args[0]
    if not _only_user(square, variance):
        return None
    if square.target in (aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar) and _number(model, square.args[1]) == 2.0:
        d = square.args[0]
    elif square.target is aten.mul.Tensor and square.args[0] is square.args[1]:
        d = square.args[0]
    else:
        return None
    if not (isinstance(d, Node) and d.target is aten.sub.Tensor and len(d.args) == 2 and _last_axis_mean(variance, square)):
        return None
    x, mean = d.args
    if not (_only_user(mean, d) and _last_axis_mean(mean, x)) or len(root.users) != 1:
        return None
    divided = next(iter(root.users))
    if divided.target is not aten.div.Tensor or divided.args != (d, root) or set(d.users) != {square, divided}:
        return None
    width = x.meta["val"].shape[-1] if isinstance(x.meta.get("val"), torch.Tensor) else None
    scaled = next(iter(divided.users)) if len(divided.users) == 1 else None
    if width is None or scaled is None or scaled.target is not aten.mul.Tensor:
        return None
    scale = next((s for v, s in (scaled.args, scaled.args[::-1]) if v is divided and _stored_row(model, s, width)), None)
    if scale is None:
        return None
    shifted = next(iter(scaled.users)) if len(scaled.users) == 1 else None
    bias = None
    if shifted is not None and shifted.target is aten.add.Tensor and len(shifted.args) == 2:
        bias = next((b for v, b in (shifted.args, shifted.args[::-1]) if v is scaled and _stored_row(model, b, width)),
                    None)
    return x, eps, scale, bias, shifted if bias is not None else scaled


def layer_norm_as_one_op(model: GraphModule) -> int:
    """Replace each layer norm written out over the last axis (``_written_out_layer_norm``: a model converted from
    ONNX, Paddle's export) by one ``aten.layer_norm``; return how many. For a target whose runtime cannot keep its
    statistics float between integer ops, or reads the norm only as one op (``Target.runs_written_out_layer_norm``):
    quantized piece by piece, its variance dies at one int8 scale; as one op, the file carries one
    LayerNormalization between two pairs, as the ONNX path writes it for TiGrIS."""
    graph = model.graph
    n = 0
    for root in list(graph.nodes):
        if root.op != "call_function" or root.target is not aten.sqrt.default:
            continue
        found = _written_out_layer_norm(model, root)
        if found is None:
            continue
        x, eps, scale, bias, end = found
        width = int(x.meta["val"].shape[-1])
        with graph.inserting_before(end):
            norm = _insert(graph, aten.layer_norm.default, (x, [width], scale, bias, eps), end)
        end.replace_all_uses_with(norm)
        graph.eliminate_dead_code()
        n += 1
    return _recompiled(model, n)


def slices_within_rank(model: GraphModule, limit: int) -> int:
    """Write each ``slice`` of a tensor of rank above ``limit`` as the same slice of a rank-3 view: ``reshape`` to
    ``[d0 * .. * d(a-1), da, d(a+1) * ..]``, ``slice`` on axis 1, ``reshape`` back; return how many. The same elements
    in the same order, for a runtime whose Slice reads rank ``limit`` at most (``Target.max_slice_rank``: TiGrIS, the
    recognizer's q, k, v split), as the ONNX path's ``slice_rank_lowered`` writes it."""
    graph = model.graph
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.slice.Tensor or node.kwargs:
            continue
        x = node.args[0]
        val = x.meta.get("val") if isinstance(x, Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() <= limit:
            continue
        axis = (node.args[1] if len(node.args) > 1 else 0) % val.dim()
        # one symbolic dim at most (the batch), not the sliced one: it is the -1 of each reshape
        dims = [int(d) if isinstance(d, int) else -1 for d in val.shape]
        if dims.count(-1) > 1 or dims[axis] == -1:
            continue
        before, after = (-1 if -1 in part else math.prod(part) for part in (dims[:axis], dims[axis + 1:]))
        out = [int(d) if isinstance(d, int) else -1 for d in node.meta["val"].shape]
        with graph.inserting_before(node):
            view = _insert(graph, aten.reshape.default, (x, [before, dims[axis], after]), node)
            part = _insert(graph, aten.slice.Tensor, (view, 1, *node.args[2:]), node)
            back = _insert(graph, aten.reshape.default, (part, out), node)
        _swap(graph, node, back)
        n += 1
    return _recompiled(model, n)
