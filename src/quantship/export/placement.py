"""Placement by profile for files made from a PyTorch model: the same rule as the ONNX path's
(``export.profile_place``: one profiled run of the float file and one of the INT8 file per batch,
the weighted ops whose integer form costs more kept float, verified once by timing the whole file), with
the two things only a torch export needs:

- the float reference is torch's own export of the float model, whose node names are not the INT8
  file's. Both files record the module each node was traced under (``pkg.torch.onnx.name_scopes``), so
  the float file's weighted nodes are renamed after the INT8 file's integer ones from the same module
  (module path, op type, k-th such node in graph order); a node either file leaves unscoped, or whose
  module appears in one file and not the other, is not profiled.
- a node is kept float through ``skip_activations``, the same way the fidelity repair does: by its module when
  no other integer weighted node of the file is in that module, else by its torch op's name (the last name scope).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quantship.errors import QuantshipError
from quantship.inspect.read import external
from quantship.inspect.read.float_ops import module_path, torch_op
from quantship.precision import smallest_names

WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclass
class Made:
    """One file of the PyTorch path as ``profile_place.place_by_profile`` reads it: its path, its integer
    weighted nodes (``plan["weighted_nodes"]``), its fidelity to FP32 (``fp32``), and what made it."""

    path: Path
    plan: dict = field(default_factory=dict)
    fp32: Any = None
    payload: Any = None  # the caller's record of the attempt (model, quantizer, path, fidelity)
    profile: Any = None


def _by_module(model: onnx.ModelProto, keep: Callable[[onnx.NodeProto], bool]) -> dict[tuple[str, str, int], str]:
    """(module path, op type, k-th such node of that module in graph order) -> node name, for the weighted
    nodes ``keep`` accepts; unscoped nodes are left out."""
    seen: dict[tuple[str, str], int] = {}
    out: dict[tuple[str, str, int], str] = {}
    for node in model.graph.node:
        if node.op_type not in WEIGHTED_OPS:
            continue
        module = module_path(node)
        key = (module or "", node.op_type)
        k = seen[key] = seen.get(key, -1) + 1
        if module is not None and torch_op(node) and keep(node):
            out[(module, node.op_type, k)] = node.name
    return out


def integer_weighted(model: onnx.ModelProto) -> dict[tuple[str, str, int], str]:
    """The INT8 file's weighted nodes that run an integer kernel (their activation and their weight come
    through a DequantizeLinear), keyed by module (``_by_module``)."""
    dequantized = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return _by_module(model, lambda n: len(n.input) > 1 and n.input[0] in dequantized and n.input[1] in dequantized)


def _in_order(model: onnx.ModelProto) -> list[tuple[str, str, tuple[int, ...] | None]]:
    """Each weighted node in graph order: its name, op type and stored weight's dims (through a
    DequantizeLinear in an INT8 file; None when not stored)."""
    stored = {t.name: tuple(t.dims) for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}

    def weight_shape(node: onnx.NodeProto) -> tuple[int, ...] | None:
        name = node.input[1] if len(node.input) > 1 else ""
        if name in producer and producer[name].op_type == "DequantizeLinear":
            name = producer[name].input[0]
        return stored.get(name)

    return [(n.name, n.op_type, weight_shape(n)) for n in model.graph.node if n.op_type in WEIGHTED_OPS]


def _same(a: tuple, b: tuple) -> bool:
    """The same weighted op in two exports: op type and weight shape, a linear layer written as Gemm in one and
    as MatMul (its weight transposed) in the other included."""
    if a[2] is None or b[2] is None:
        return False
    if a[1] == b[1]:
        return a[2] == b[2]
    return {a[1], b[1]} == {"Gemm", "MatMul"} and len(a[2]) == 2 and sorted(a[2]) == sorted(b[2])


def float_named_as(float_model: onnx.ModelProto, int8_model: onnx.ModelProto) -> dict[str, str]:
    """Rename, in ``float_model``, each weighted node after the INT8 file's integer node it is; returns the
    matched INT8 node names -> the names that keep each float (``precision.smallest_names`` of its module and its
    torch op, ``torch_op``, among the integer weighted nodes). When both files hold the same weighted ops in the same
    order with the same stored weight shapes, they are paired by position (a BatchNorm the float export folds
    into its Conv scopes that Conv under the BatchNorm's module); otherwise by module (module docstring)."""
    wanted = integer_weighted(int8_model)
    ops = {n.name: torch_op(n) for n in int8_model.graph.node}
    modules = dict(zip(wanted.values(), smallest_names([key[0] for key in wanted], [ops[n] for n in wanted.values()])))
    ours, theirs = _in_order(int8_model), _in_order(float_model)
    if len(ours) == len(theirs) and all(_same(a, b) for a, b in zip(ours, theirs)):
        pairs = [(a[0], b[0]) for a, b in zip(ours, theirs) if a[0] in modules]
    else:
        found = _by_module(float_model, lambda n: True)
        pairs = [(name, found[key]) for key, name in wanted.items() if key in found]
    by_name = {n.name: n for n in float_model.graph.node}
    for name, _ in pairs:  # a float node already holding an INT8 name is moved aside first
        if name in by_name:
            by_name[name].name = f"{name}__float"
    for name, was in pairs:
        by_name[was].name = name
    return {name: modules[name] for name, _ in pairs}


def profiled_reference(float_path: Path, int8_path: Path, out: Path) -> dict[str, str]:
    """The float reference written to ``out`` with its weighted nodes named after ``int8_path``'s; returns the
    INT8 node names the profile can compare -> the names that keep each float (``float_named_as``). Raises
    ``QuantshipError`` when none match."""
    float_model = onnx.load(str(float_path), load_external_data=False)  # a large one's weights stay in its data file
    matched = float_named_as(float_model, external.graph_without_weights(int8_path))
    if not matched:
        raise QuantshipError("no integer weighted node of the INT8 file records the module it was exported from")
    if external.locations(float_model) and out.parent.resolve() != Path(float_path).parent.resolve():
        raise QuantshipError(f"the float reference's renamed graph must sit beside its data file, in {Path(float_path).parent}")
    out.write_bytes(float_model.SerializeToString())  # refers to the same data file, beside it
    return matched


def feeds(rows: Mapping[str, np.ndarray], batches: tuple[int, ...]) -> dict[int, dict[str, np.ndarray]]:
    """One feed per batch: the first sample repeated (as the ONNX path's ``speed.timing_feeds``)."""
    return {b: {k: np.ascontiguousarray(np.repeat(np.asarray(v)[:1], b, axis=0)) for k, v in rows.items()}
            for b in sorted(set(batches))}
