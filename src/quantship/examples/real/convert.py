"""The PyTorch path on the ONNX models: ``onnx2torch`` after lifting ``Constant`` nodes to initializers.

Paddle exports keep their weights in ``Constant`` nodes, which onnx2torch would turn into
buffers computed at run time rather than parameters; lifted to initializers they become the
modules' weights. Failures are left to the caller to record (the reason is the exception).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
from onnx import helper

from quantship.examples.real import require
from quantship.export import ir_edit
from quantship.inspect.run.consumers import ort_session


def lift_constants(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` whose ``Constant`` nodes are initializers (``export.ir_edit.lift_constants``, the ONNX
    path's own lift); returns (copy, how many)."""
    graph = ir.from_proto(model)
    lifted = ir_edit.lift_constants(graph)
    return ir.to_proto(graph), lifted


def rank_hints(model: onnx.ModelProto, example) -> int:
    """Give each BatchNormalization input that shape inference leaves without a rank (after a Reshape whose shape is
    computed, as in the PP-OCRv4 recognizer) the rank one ONNX Runtime run of ``example`` (one input array) shows, as
    symbolic dims: onnx2torch picks BatchNorm1d/2d/3d from it and refused the node without it. In place; how many."""
    inferred = onnx.shape_inference.infer_shapes(model)
    ranked = {v.name for v in inferred.graph.value_info if v.type.tensor_type.HasField("shape")
              and len(v.type.tensor_type.shape.dim) > 0}
    ranked |= {v.name for v in model.graph.input}
    missing = sorted({n.input[0] for n in model.graph.node if n.op_type == "BatchNormalization"} - ranked)
    if not missing:
        return 0
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in missing)
    outputs = ort_session(probe).run(missing, {model.graph.input[0].name: example})
    for name, array in zip(missing, outputs):
        model.graph.value_info.append(helper.make_tensor_value_info(
            name, onnx.TensorProto.FLOAT, [f"{name}_d{i}" for i in range(array.ndim)]))
    return len(missing)


def to_torch(path: str | Path, example=None):
    """``onnx2torch.convert`` of the file with its Constants lifted and its constant shape arguments
    frozen (``freeze_shape_arguments``; ``example``, one input, lets it follow shapes computed from
    shapes): a ``torch.fx.GraphModule`` in eval mode."""
    require("onnx2torch")
    from onnx2torch import convert

    model, _ = lift_constants(onnx.load(str(path)))
    if example is not None:
        rank_hints(model, example.numpy() if hasattr(example, "numpy") else example)
    module = convert(model).eval()
    freeze_shape_arguments(module, example)
    return module


def _constant(graph_module, node):
    """The value of a ``get_attr`` node (an initializer onnx2torch kept as a buffer), else None."""
    if getattr(node, "op", None) != "get_attr":
        return None
    value = graph_module
    for part in node.target.split("."):
        value = getattr(value, part)
    return value


def _shape_expression(graph_module, node, modules):
    """A Reshape target computed from shapes, as a list of ints and ``(tensor node, dim)`` references, or None.

    Follows what onnx2torch makes of ``Shape -> Slice -> Cast -> Concat`` (the flatten before a Paddle
    classifier head): each element is either a constant or one dimension of a tensor of the graph.
    """
    import numpy as np
    from onnx2torch.node_converters.cast import OnnxCast
    from onnx2torch.node_converters.concat import OnnxConcat
    from onnx2torch.node_converters.shape import OnnxShape
    from onnx2torch.node_converters.slice import OnnxSlice

    value = _constant(graph_module, node)
    if value is not None:
        return [int(v) for v in value.reshape(-1).tolist()]
    if getattr(node, "op", None) != "call_module":
        return None
    module = modules[node.target]
    if isinstance(module, OnnxShape):
        source = node.args[0]
        rank = source.meta.get("rank")
        if rank is None:
            return None
        start, end = module._start, module._end
        return [(source, i) for i in range(rank)[start:end]]
    if isinstance(module, OnnxCast):
        return _shape_expression(graph_module, node.args[0], modules)
    if isinstance(module, OnnxConcat):
        parts = [_shape_expression(graph_module, a, modules) for a in node.args]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]
    if isinstance(module, OnnxSlice) and len(node.args) >= 3:
        inner = _shape_expression(graph_module, node.args[0], modules)
        bounds = [_constant(graph_module, a) for a in node.args[1:]]
        if inner is None or any(b is None for b in bounds):
            return None
        starts, ends = (int(np.asarray(b).reshape(-1)[0]) for b in bounds[:2])
        axes = int(np.asarray(bounds[2]).reshape(-1)[0]) if len(bounds) > 2 else 0
        steps = int(np.asarray(bounds[3]).reshape(-1)[0]) if len(bounds) > 3 else 1
        if axes != 0 or steps != 1:
            return None
        return inner[starts:ends]
    return None


def _annotate_ranks(graph_module, example) -> None:
    """Record each node's output rank from one run of the module (``node.meta['rank']``)."""
    import torch

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                n.meta["rank"] = out.dim()
            return out

    with torch.no_grad():
        Recorder(graph_module).run(example)


def _slice_index(graph_module, node) -> tuple | None:
    """The Python index of an onnx2torch Slice whose starts, ends, axes and steps are stored (None: computed, a
    negative step, or a negative axis of a tensor of unknown rank)."""
    values = [_constant(graph_module, a) if a is not None else None for a in node.args[1:5]]
    if len(values) < 2 or values[0] is None or values[1] is None or any(
            a is not None and v is None for a, v in zip(node.args[1:5], values)):
        return None
    starts, ends = values[0].tolist(), values[1].tolist()
    axes = values[2].tolist() if len(values) > 2 and values[2] is not None else list(range(len(starts)))
    steps = values[3].tolist() if len(values) > 3 and values[3] is not None else [1] * len(starts)
    rank = node.args[0].meta.get("rank") if hasattr(node.args[0], "meta") else None
    if any(s < 0 for s in steps) or (any(a < 0 for a in axes) and rank is None):
        return None
    axes = [a % rank if a < 0 else a for a in axes]
    index = [slice(None)] * (max(axes) + 1)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[axis] = slice(int(start), int(end), int(step))
    return tuple(index)


def freeze_shape_arguments(graph_module, example=None) -> int:
    """Replace onnx2torch ``Reshape``/``Resize``/``Slice`` modules whose shape/scales/sizes/starts... inputs are
    initializers with modules holding those values as Python numbers; returns how many were replaced.

    onnx2torch reads such an input at run time (``torch.any(shape == 0)``, ``scales.tolist()``, a Slice's
    ``.numpy()``), a
    data-dependent branch ``torch.export`` refuses; the values are constants of the file, so
    reading them once changes nothing the model computes.
    """
    import torch
    from onnx2torch.node_converters.reshape import OnnxReshape
    from onnx2torch.node_converters.resize import OnnxResize, _onnx_mode_to_torch_mode
    from onnx2torch.node_converters.slice import OnnxSlice

    class ConstReshape(torch.nn.Module):
        def __init__(self, shape: list[int]):
            super().__init__()
            self.shape = shape

        def forward(self, x):
            return x.reshape([x.shape[i] if d == 0 else d for i, d in enumerate(self.shape)])

    class ConstResize(torch.nn.Module):
        def __init__(self, mode: str, align_corners, scales: list[float] | None, sizes: list[int] | None):
            super().__init__()
            self.mode, self.align_corners, self.scales, self.sizes = mode, align_corners, scales, sizes

        def forward(self, x):
            return torch.nn.functional.interpolate(x, size=self.sizes, scale_factor=self.scales,
                                                   mode=_onnx_mode_to_torch_mode(self.mode, x.dim() - 2),
                                                   align_corners=self.align_corners)

    class DimsReshape(torch.nn.Module):
        """Reshape to constants and dimensions of other tensors (a shape computed from shapes)."""

        def __init__(self, spec: list):
            super().__init__()
            self.spec = spec  # int, or the position of (reference tensor, dim) in forward's arguments

        def forward(self, x, *refs):
            dims = [d if isinstance(d, int) else refs[d[0]].shape[d[1]] for d in self.spec]
            return x.reshape([x.shape[i] if d == 0 else d for i, d in enumerate(dims)])

    class ConstSlice(torch.nn.Module):
        """A Slice of stored starts, ends, axes and steps: one Python index."""

        def __init__(self, index: tuple):
            super().__init__()
            self.index = index

        def forward(self, x):
            return x[self.index]

    if example is not None:
        _annotate_ranks(graph_module, example)
    modules = dict(graph_module.named_modules())
    replaced = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_module":
            continue
        module = graph_module.get_submodule(node.target)
        if isinstance(module, OnnxReshape) and len(node.args) == 2:
            shape = _constant(graph_module, node.args[1])
            if shape is None:
                expression = _shape_expression(graph_module, node.args[1], modules)
                if expression is None:
                    continue
                sources = list(dict.fromkeys(e[0] for e in expression if not isinstance(e, int)))
                spec = [e if isinstance(e, int) else (sources.index(e[0]), e[1]) for e in expression]
                graph_module.add_submodule(node.target, DimsReshape(spec))
                node.args = (node.args[0], *sources)
                replaced += 1
                continue
            new = ConstReshape([int(v) for v in shape.tolist()])
        elif isinstance(module, OnnxResize):
            args = list(node.args) + [None] * (4 - len(node.args))
            for i, name in enumerate(("roi", "scales", "sizes"), start=1):  # onnx2torch passes some as keywords
                if name in node.kwargs:
                    args[i] = node.kwargs[name]
            values = [_constant(graph_module, a) if a is not None else None for a in args[1:4]]
            if any(a is not None and v is None for a, v in zip(args[1:4], values)):
                continue
            roi, scales, sizes = (None if v is None or v.numel() == 0 else v.tolist() for v in values)
            if roi is not None and not module.ignore_roi:
                continue
            if (scales and scales[:2] != [1.0, 1.0]) or (sizes and not module.ignore_bs_ch_size):
                continue
            new = ConstResize(module.onnx_mode, module.align_corners, scales[2:] if scales else None,
                              [int(s) for s in sizes[2:]] if sizes else None)
        else:
            continue
        graph_module.add_submodule(node.target, new)
        node.args, node.kwargs = (node.args[0],), {}
        replaced += 1
    graph_module.graph.eliminate_dead_code()
    # then the slices left (those of a shape the Reshapes above read are gone with them)
    for node in list(graph_module.graph.nodes):
        if node.op == "call_module" and isinstance(graph_module.get_submodule(node.target), OnnxSlice):
            index = _slice_index(graph_module, node)
            if index is not None:
                graph_module.add_submodule(node.target, ConstSlice(index))
                node.args, node.kwargs = (node.args[0],), {}
                replaced += 1
    graph_module.graph.eliminate_dead_code()
    graph_module.recompile()
    return replaced
