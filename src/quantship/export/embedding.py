"""The token embedding table of a weight-only file: one stored low-bit copy, read by its Gather and a tied LM head.

A table is a weight initializer a ``Gather`` reads by token ids (axis 0); a model whose LM head is tied to its
token embedding also reads it through ``Transpose -> MatMul``. ``export.weight_only`` stores the codes and
scales once and these rewrites point every reader at them:

- standard form: the Gather reads the rows of the codes (int4 through a ``Cast`` to int8: ONNX's Gather takes no
  int4) and the rows of the scales, then a blocked ``DequantizeLinear`` over the last axis gives the float
  rows; a tied head reads ``DequantizeLinear(Transpose(codes), Transpose(scales))``. Exact: the same floats
  as the float export's table. The Cast and Transposes read constants only, so ONNX Runtime folds them when
  it loads the file (the file keeps one copy) and then fuses the head into its MatMulNBits; dequantizing the
  whole table before the Gather, the other standard spelling, costs a full-table DequantizeLinear per call.
- MatMulNBits form: the Gather becomes ``com.microsoft.GatherBlockQuantized`` (uint8 codes, ``bits`` 4 or 8,
  codes offset by 2**(bits-1), ONNX Runtime's default zero-point, as MatMulNBits') over the table's own packed
  codes, or, when a tied head's MatMulNBits holds them, over its B reshaped to [vocab, bytes] (a constant
  Reshape ONNX Runtime folds), with the same scales tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from quantship.errors import ExportRefused
from quantship.export.ir_edit import MS_DOMAIN

GATHER_BLOCK_QUANTIZED = "GatherBlockQuantized"
TABLE_DEQUANTIZE = "table_dequantize"  # name prefix of the DequantizeLinear of a table's gathered rows


def _gather_axis(node: ir.Node) -> int:
    attr = node.attributes.get("axis")
    return int(attr.value) if attr is not None else 0


def _is_table_read(user: ir.Node, index: int) -> bool:
    return user.op_type == "Gather" and index == 0 and _gather_axis(user) == 0


def is_table(value: ir.Value) -> bool:
    """Whether a Gather reads ``value`` as its data, by indices along axis 0 (a token embedding's table)."""
    return any(_is_table_read(user, index) for user, index in value.uses())


def table_reads(value: ir.Value) -> list[ir.Node]:
    """The Gathers reading ``value`` as a table."""
    return [user for user, index in value.uses() if _is_table_read(user, index)]


def one_copy(model: ir.Model, found: list[tuple[Any, ir.Value, bool]]) -> list[tuple[Any, ir.Value, bool]]:
    """``found`` (weight, initializer, transposed) with a weight found twice, as a table and transposed (the
    exporter folded a tied head's Transpose into a second initializer: GPT-2), read from the table alone: the
    transposed copy becomes a Transpose of the table and leaves the file."""
    tables = {id(w): value for w, value, transposed in found if not transposed and is_table(value)}
    kept = []
    for w, value, transposed in found:
        table = tables.get(id(w))
        if not transposed or table is None:
            kept.append((w, value, transposed))
            continue
        flipped = _at_start(model, _typed(ir.node("Transpose", [table], attributes={"perm": [1, 0]},
                                                  name=f"{value.name}_from_table"), ir.DataType.FLOAT))
        flipped.shape = value.shape
        ir.convenience.replace_all_uses_with(value, flipped)
        model.graph.initializers.pop(value.name)
    return kept


def _typed(node: ir.Node, dtype: ir.DataType) -> ir.Node:
    node.outputs[0].type = ir.TensorType(dtype)
    return node


def _take_place(model: ir.Model, old: ir.Node, nodes: list[ir.Node]) -> None:
    """``nodes`` inserted before ``old``, the last one's output replacing ``old``'s (its name kept), ``old`` removed."""
    out, new = old.outputs[0], nodes[-1].outputs[0]
    new.type, new.shape = out.type, out.shape
    new.metadata_props.update(out.metadata_props)
    nodes[-1].metadata_props.update(old.metadata_props)  # the module it came from (name_scopes)
    model.graph.insert_before(old, nodes)
    ir.convenience.replace_all_uses_with(out, new, replace_graph_outputs=True)
    name = out.name
    model.graph.remove(old, safe=True)
    new.name = name


def _at_start(model: ir.Model, node: ir.Node) -> ir.Value:
    """A node reading constants only, placed first in the graph; its output."""
    model.graph.insert_before(model.graph[0], node)
    return node.outputs[0]


def dequantize_table(model: ir.Model, table: ir.Value, codes: ir.Value, scale: ir.Value, block: int,
                     index: int) -> tuple[int, int]:
    """Standard form: every reader of the float ``table`` [vocab, hidden] reads ``codes`` (int4/int8, the table's
    orientation) and ``scale`` [vocab, hidden // block] instead; (gathers, tied heads) rewritten. Refuses a
    reader that is neither a Gather of rows nor a Transpose (the tied head)."""
    rows_source = codes
    if codes.const_value is not None and codes.const_value.dtype == ir.DataType.INT4:
        rows_source = _at_start(model, _typed(ir.node("Cast", [codes], attributes={"to": ir.DataType.INT8},
                                                      name=f"table_codes_int8_{index}"), ir.DataType.INT8))
    gathers = heads = 0
    for user, slot in list(table.uses()):
        if _is_table_read(user, slot):
            ids = user.inputs[1]
            rows = _typed(ir.node("Gather", [rows_source, ids], attributes={"axis": 0},
                                  name=f"table_rows_{index}_{gathers}"), ir.DataType.INT8)
            row_scales = _typed(ir.node("Gather", [scale, ids], attributes={"axis": 0},
                                        name=f"table_row_scales_{index}_{gathers}"), ir.DataType.FLOAT)
            dq = ir.node("DequantizeLinear", [rows.outputs[0], row_scales.outputs[0]],
                         attributes={"axis": -1, "block_size": block}, name=f"{TABLE_DEQUANTIZE}_{index}_{gathers}")
            _take_place(model, user, [rows, row_scales, dq])
            gathers += 1
        elif user.op_type == "Transpose" and slot == 0 and _perm(user) == [1, 0]:
            codes_t = _at_start(model, ir.node("Transpose", [codes], attributes={"perm": [1, 0]},
                                               name=f"head_codes_transposed_{index}_{heads}"))
            codes_t.type = ir.TensorType(codes.const_value.dtype)
            scale_t = _at_start(model, _typed(ir.node("Transpose", [scale], attributes={"perm": [1, 0]},
                                                      name=f"head_scales_transposed_{index}_{heads}"), ir.DataType.FLOAT))
            dq = ir.node("DequantizeLinear", [codes_t, scale_t], attributes={"axis": 0, "block_size": block},
                         name=f"weight_dequantize_{index}_head{heads}")
            _take_place(model, user, [dq])
            heads += 1
        else:
            raise ExportRefused(f"the token embedding table {table.name!r} is read by a {user.op_type} node (input "
                                f"{slot}); only a Gather of its rows and a tied head's Transpose can read it stored "
                                "as integers")
    model.graph.initializers.pop(table.name)
    return gathers, heads


def _perm(node: ir.Node) -> list[int]:
    attr = node.attributes.get("perm")
    return list(attr.value) if attr is not None else [1, 0]  # rank 2: the default reverses the axes


def gather_block_quantized(model: ir.Model, gather: ir.Node, data: ir.Value, scale: ir.Value, *, bits: int,
                           block: int, width: int, name: str) -> ir.Node:
    """MatMulNBits form: ``gather`` (rows of a float table of ``width`` columns) replaced by GatherBlockQuantized
    over ``data``: uint8 codes [vocab, width * bits / 8], or a MatMulNBits B [vocab, blocks, blob], read through
    a Reshape to [vocab, blocks * blob] (and the rows cut to ``width`` when the blocks pad them)."""
    nodes = []
    shape = data.const_value.shape if data.const_value is not None else data.shape
    if len(shape) == 3:
        flat = ir.Value(name=f"{data.name}_rows", const_value=ir.Tensor(np.array([shape[0], -1], np.int64),
                                                                          name=f"{data.name}_rows"))
        model.graph.register_initializer(flat)
        data = _at_start(model, _typed(ir.node("Reshape", [data, flat], name=f"{name}_table"), ir.DataType.UINT8))
        padded = shape[1] * shape[2] * 8 // bits
    else:
        padded = shape[1] * 8 // bits
    if padded != width and len(shape) != 3:
        raise ExportRefused(f"GatherBlockQuantized: a table of {width} columns packed into {shape[1]} bytes per row "
                            f"at {bits} bits; store an even width")
    node = ir.node(GATHER_BLOCK_QUANTIZED, [data, gather.inputs[1], scale], domain=MS_DOMAIN, name=name,
                   attributes={"bits": bits, "block_size": block, "gather_axis": 0, "quantize_axis": 1})
    nodes.append(node)
    if padded != width:  # MatMulNBits pads each row to whole blocks; the padded codes sit at the zero-point
        axes = ir.Value(name=f"{name}_axes", const_value=ir.Tensor(np.array([-1], np.int64), name=f"{name}_axes"))
        starts = ir.Value(name=f"{name}_starts", const_value=ir.Tensor(np.array([0], np.int64), name=f"{name}_starts"))
        ends = ir.Value(name=f"{name}_ends", const_value=ir.Tensor(np.array([width], np.int64), name=f"{name}_ends"))
        for value in (axes, starts, ends):
            model.graph.register_initializer(value)
        nodes.append(ir.node("Slice", [node.outputs[0], starts, ends, axes], name=f"{name}_width"))
    _take_place(model, gather, nodes)
    return node
