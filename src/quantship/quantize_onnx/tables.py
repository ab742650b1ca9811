"""Stored tables read by data movement: an embedding's word table, a lookup read by computed indices.

A ``Gather`` (``roles.TABLE_OPS``) whose data input is a float initializer and whose indices are
computed from the inputs (token ids) moves rows of a stored tensor: the table is a constant, so the
activation roles never reach it and it would stay float (a BERT encoder's 30522 x 256 word table is
three quarters of its file). Here the table is stored as 8-bit integers, per tensor and symmetric
(``absmax / TABLE_BOUND``), and the op's output is quantized under that same scale and zero-point:
``DequantizeLinear -> Gather -> QuantizeLinear`` with one (scale, zero-point) on both sides is
exact (a per-tensor DequantizeLinear commutes with moving values), and ONNX Runtime's QDQ
transformer drops that pair, gathering the 8-bit rows themselves: no run-time dequantization of the
whole table, only of the gathered rows. The indices stay integer, as the file has them.

The output keeps the table's scale unless the tensors tied to it (``place.Plan.ties``) reach beyond
the table's grid; then the table is stored under its own scale and the output's QuantizeLinear
requantizes (still right, no longer dropped by ONNX Runtime).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from quantship.export.roles import TABLE_OPS
from quantship.quantize_onnx.calibrate import QMAX, QMIN, TensorObserver

__all__ = ["MIN_TABLE_VALUES", "TABLE_BOUND", "read_table", "table_scale", "tie_to_tables", "write_tables"]

# a smaller stored lookup stays float: it gains little in size, and may be a table of scales or anchors
# whose range one 8-bit grid per tensor cannot hold (an embedding is thousands of rows)
MIN_TABLE_VALUES = 4096
# the full symmetric int8 range, whatever reduce_range says: the 7-bit bound keeps u8s8 kernels from
# saturating, and no kernel multiplies a table (its rows are moved, then dequantized). Measured on the
# BERT encoder's output vs FP32 (batch 1): mean abs error 0.0054 with a float table, 0.0128 at 63 steps,
# 0.0078 at 127.
TABLE_BOUND = 127


def read_table(node: ir.Node, constant: set[str]) -> ir.Value | None:
    """The float table ``node`` reads by computed indices (None: not a table read)."""
    if node.op_type not in TABLE_OPS or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    table, indices = node.inputs[0], node.inputs[1]
    if table is None or indices is None or table.const_value is None or table.is_graph_input():
        return None
    if table.const_value.dtype != ir.DataType.FLOAT or indices.name in constant:
        return None
    if table.const_value.size < MIN_TABLE_VALUES:
        return None
    return table


def table_scale(array: np.ndarray, bound: int) -> float:
    """The table's own per-tensor symmetric scale: its largest magnitude on ``bound`` steps."""
    top = float(np.abs(array).max()) if array.size else 0.0
    return top / bound if np.isfinite(top) and top > 0 else 1.0


def tie_to_tables(nodes: list[ir.Node], tables: list[int], groups: list[list[str]],
                  qparams: dict[str, tuple[float, int]], observers: dict[str, TensorObserver], bound: int) -> int:
    """Give each table read's output group (``groups``: the tensors sharing one scale) the table's
    (scale, 0) where every member's observed range fits that grid (several tables in one group: the
    widest scale); returns the groups retied."""
    group_of = {m: k for k, members in enumerate(groups) for m in members}
    wanted: dict[int, float] = {}
    for i in tables:
        out = nodes[i].outputs[0].name
        if out not in group_of:
            continue
        scale = table_scale(nodes[i].inputs[0].const_value.numpy(), bound)
        wanted[group_of[out]] = max(wanted.get(group_of[out], 0.0), scale)
    retied = 0
    for k, scale in wanted.items():
        seen = [observers[m] for m in groups[k] if m in observers and observers[m].low != np.inf]
        if all(o.low >= QMIN * scale and o.high <= QMAX * scale for o in seen):
            for m in groups[k]:
                qparams[m] = (scale, 0)
            retied += 1
    return retied


def write_tables(nodes: list[ir.Node], tables: list[int], qparams: dict[str, tuple[float, int]], bound: int,
                 stored_zero: Callable[[int], np.ndarray], initializer: Callable[[str, np.ndarray], ir.Value],
                 name: Callable[[str], str], graph: ir.Graph) -> int:
    """Store each table as 8-bit integers read through a DequantizeLinear (the output's (scale, 0) when it
    covers the table within ``bound`` steps, else the table's own); returns the tables written."""
    memo: dict[tuple[str, float], ir.Value] = {}
    written = 0
    for i in tables:
        node = nodes[i]
        table, out = node.inputs[0], node.outputs[0]
        array = table.const_value.numpy()
        own = table_scale(array, bound)
        scale, zero = qparams.get(out.name, (own, 0))
        if zero != 0 or scale < own * (1 - 1e-6):
            scale = own  # the output's grid cannot hold the table within bound: requantized at its Q
        key = (table.name, scale)
        if key not in memo:
            stored = stored_zero(0)
            q = np.clip(np.rint(array / np.float32(scale)), -bound, bound).astype(np.int64) + int(stored)
            dq = ir.Node("", "DequantizeLinear", [
                initializer(f"{table.name}_quantized", q.astype(stored.dtype)),
                initializer(f"{table.name}_scale", np.array(scale, dtype=np.float32)),
                initializer(f"{table.name}_zero_point", stored)], name=name(f"{table.name}_DequantizeLinear"))
            value = dq.outputs[0]
            value.name, value.dtype = name(f"{table.name}_dequantized"), ir.DataType.FLOAT
            value.shape = ir.Shape(array.shape)
            graph.insert_before(node, dq)
            memo[key] = value
            written += 1
        node.replace_input_with(0, memo[key])
    return written
