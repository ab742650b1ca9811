"""16-bit activations for the few tensors int8 cannot hold: chosen nodes' Q/DQ pairs widened to int16/uint16.

A node named in ``int16`` (the grammar of ``exclude``: a node name, a glob over names, or an op type)
gets every activation it reads quantized and its own quantization point written with a 16-bit
zero-point; weights stay int8. A tensor that shares its scale with others (data movement, a Concat)
widens with them, so a tie is never split across two grids. The 16-bit range is the exact min/max of
the calibration data (at 16 bits rounding costs ~256x less than at 8, so clipping outliers no longer
pays). QuantizeLinear/DequantizeLinear take 16-bit zero-points from opset 21: a file below is converted
(``OPSET_PASS``, proven exact in ONNX Runtime with the other normalisation passes).

Who runs such a file is the target's fact (``Target.runs_int16``, from its file rules'
``activation_dtypes``); a target that does not list the 16-bit type is refused up front, in one line.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from quantship import targets
from quantship.errors import Int16Uncovered, SpecRefused
from quantship.export.metadata import INT16_KEY  # noqa: F401  (the front-end's name for the shared key)
from quantship.export.opset import INT16_OPSET
from quantship.quantize_onnx import normalize, place, selection
from quantship.quantize_onnx.calibrate import TensorObserver
from quantship.targets import Target

GRID = {"int16": (-32768, 32767), "uint16": (0, 65535)}
# ONNX Runtime 1.32 at its default optimizations turns DequantizeLinear(int8 weight) -> MatMul whose activation is
# not int8 into MatMulNBits at accuracy_level 4, which re-quantizes that activation to int8 per block at run time:
# measured on tests' outlier model, 125/128 read literally, 61/128 as users run it. Such a reader of a 16-bit
# tensor keeps its weight float (ONNX Runtime runs it as a float MatMul either way). A Gemm keeps its int8 weight:
# ONNX Runtime runs DequantizeLinear -> Gemm in float as written, but quantizes a float Gemm (or Conv) weight
# between a DequantizeLinear and a QuantizeLinear to int8 per tensor (tests' wide-gain Gemm: 30.5 dB literally,
# 6.6 dB as users run it with a float weight).
REQUANTIZING_READERS = ("MatMul",)


def runs_int16(target: str | Target) -> bool:
    """Whether the target's file rules accept 16-bit activations of its preset's kind."""
    return targets.get(target).runs_int16


def refuse_unless_runs(target: str | Target) -> None:
    why = targets.get(target).int16_refusal("--int16")
    if why is not None:
        raise SpecRefused(why)


def upgrade_for_int16(model: ir.Model) -> int:
    """Convert a file below opset 21 to 21 (``onnx.version_converter``), for 16-bit zero-points."""
    return normalize.convert_opset(model, INT16_OPSET)


OPSET_PASS = normalize.Pass("opset_21_for_int16", upgrade_for_int16, "float",  # as normalize's upgrade_opset
                            "16-bit zero-points on QuantizeLinear/DequantizeLinear need opset 21")


def chosen_tensors(layout: place.Plan, patterns: Iterable[str], excluded: set[int]) -> list[str]:
    """The quantized tensors the nodes ``patterns`` name read or produce, with every tensor tied to
    them, in graph order. Refused when a pattern matches nothing, or only nodes left float."""
    nodes = layout.nodes
    planned = set(layout.tensors)
    by_node: dict[int, set[str]] = collections.defaultdict(set)
    for i, k in layout.readers:
        value = nodes[i].inputs[k]
        if value is not None and value.name in planned:
            by_node[i].add(value.name)
    for i, node in enumerate(nodes):
        for out in node.outputs:
            if out.name in planned and (i in layout.integer_nodes or i in layout.weighted):
                by_node[i].add(out.name)
                for use in out.uses():  # a fused Relu/Clip: the quantization point is its output
                    nxt = use.node
                    if nxt.op_type in ("Relu", "Clip") and nxt.outputs and nxt.outputs[0].name in planned:
                        by_node[i].add(nxt.outputs[0].name)
    chosen: set[str] = set()
    for pattern in patterns:
        hits = selection.resolve_excludes(nodes, [pattern], flag="--int16")
        found = set().union(*(by_node.get(i, set()) for i in hits - excluded))
        if not found:
            names = ", ".join(sorted(selection.node_label(nodes[i], i) for i in hits)[:4])
            raise Int16Uncovered(f"--int16 {pattern!r} names nodes ({names}) that read and write no quantized "
                                 "activation here (kept in float, or not quantized by this target's placement); "
                                 "name a quantized node (quantship sensitivity lists them)", pattern)
        chosen |= found
    return [t for t in layout.tensors if t in _with_ties(chosen, layout)]


def keep_float_weights(layout: place.Plan, tensors: list[str]) -> list[str]:
    """Drop from ``layout.weighted`` the MatMul nodes that read one of ``tensors`` (see
    ``REQUANTIZING_READERS``), before ``place.insert`` writes their weights; returns their labels."""
    wide = set(tensors)
    kept = [i for i in layout.weighted if layout.nodes[i].op_type in REQUANTIZING_READERS
            and layout.nodes[i].inputs[0] is not None and layout.nodes[i].inputs[0].name in wide]
    layout.weighted = [i for i in layout.weighted if i not in kept]
    return [selection.node_label(layout.nodes[i], i) for i in kept]


def _with_ties(chosen: set[str], layout: place.Plan) -> set[str]:
    grown, changed = set(chosen), True
    while changed:
        changed = False
        for members in (*layout.ties, *layout.concat_ties):
            if grown.intersection(members) and not grown.issuperset(members):
                grown.update(members)
                changed = True
    return grown


def qparams_16(members: list[TensorObserver], dtype: str, symmetric: bool) -> tuple[float, int]:
    """(scale, stored zero-point) on the 16-bit grid covering the exact range every member saw (and 0)."""
    qmin, qmax = GRID[dtype]
    seen = [m for m in members if m.low != np.inf]
    if not seen:
        return 1.0, 0 if dtype == "int16" else 32768
    low, high = min(0.0, min(m.low for m in seen)), max(0.0, max(m.high for m in seen))
    if all(m.integral for m in seen) and high - low <= qmax - qmin and (not symmetric or max(-low, high) <= 32767):
        scale = 1.0  # integer values (shape arithmetic, codes) stay exact
    elif symmetric:
        scale = max(-low, high) / 32767.0
    else:
        scale = (high - low) / float(qmax - qmin)
    if not np.isfinite(scale) or scale < np.finfo(np.float32).tiny:
        scale = 1.0
    if symmetric:
        zero = 0 if dtype == "int16" else 32768
    else:
        zero = int(np.clip(qmin - np.round(low / scale), qmin, qmax))
    return float(scale), zero


def values_of(layout: place.Plan, tensors: list[str]) -> dict[str, ir.Value]:
    """The values named ``tensors``, taken before ``place.insert`` (which renames a quantized graph output's
    float value ``{name}_float`` and gives its name to the DequantizeLinear)."""
    wanted = set(tensors)
    found = {v.name: v for n in layout.nodes for v in (*n.inputs, *n.outputs) if v is not None and v.name in wanted}
    return {name: found[name] for name in tensors}


def widen(model: ir.Model, values: dict[str, ir.Value], observers: dict[str, TensorObserver], layout: place.Plan,
          dtype: str, symmetric: bool) -> list[str]:
    """Rewrite the Q/DQ pair of each value in ``values`` (planned name -> value, ``values_of``; the pairs
    written by ``place.insert``) to ``dtype``, one 16-bit scale per tie group; returns the names the
    widened QuantizeLinear nodes read in the file, in graph order."""
    tensors = list(values)
    wanted = set(tensors)
    groups: list[list[str]] = []
    placed: set[str] = set()
    for name in tensors:
        if name in placed:
            continue
        group = sorted(_with_ties({name}, layout) & wanted)
        placed.update(group)
        groups.append(group)
    qparams = {}
    for group in groups:
        qp = qparams_16([observers[m] for m in group], dtype, symmetric)
        qparams.update(dict.fromkeys(group, qp))
    numpy_type = np.int16 if dtype == "int16" else np.uint16
    ir_type = ir.DataType.INT16 if dtype == "int16" else ir.DataType.UINT16
    planned = {id(v): name for name, v in values.items()}
    written = []
    for node in list(model.graph):
        if node.op_type != "QuantizeLinear" or node.domain not in normalize.DEFAULT_DOMAINS:
            continue
        source = node.inputs[0]
        if source is None or id(source) not in planned:
            continue
        scale, zero = qparams[planned[id(source)]]
        s, z = node.inputs[1], node.inputs[2]
        s.const_value = ir.tensor(np.array(scale, dtype=np.float32), name=s.name)
        z.const_value = ir.tensor(np.array(zero, dtype=numpy_type), name=z.name)
        z.type = ir.TensorType(ir_type)
        node.outputs[0].dtype = ir_type
        written.append(source.name)
    return written
