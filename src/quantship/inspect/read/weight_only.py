"""Weight-only quantization read off a file: which weights are stored in low bits, in which form, and
what stays float.

Three forms hold a weight in 2, 4 or 8 bits while the activations stay float:

- ``com.microsoft.MatMulNBits``: a MatMul whose B input is packed codes with per-block scales
  (attributes ``bits``, default 4, and ``block_size``; ``accuracy_level`` picks the activations'
  precision inside the kernel: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8);
- a ``DequantizeLinear`` of a stored integer weight (int2/int4/int8 and their unsigned forms; per
  axis, or blocked with ``block_size``) read by a MatMul, Gemm, Conv or Gather, with no activation
  quantized;
- ``com.microsoft.GatherBlockQuantized``: an embedding table stored blocked (``bits``, default 4, for
  a packed uint8 table; the element type otherwise).

A stored tensor may reach its reader through ops that only move or recast its values (a Reshape, a
Transpose, a Cast to int8 for a Gather): the bits are the stored tensor's. quantship writes all three
(``export.weight_only``, ``export.embedding``), as does ONNX Runtime's ``MatMulNBitsQuantizer``. ``weight_only_facts`` finds every such weight, and every weight that stays float.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import onnx

from quantship.inspect.read.view import DEQUANTIZE, SHAPE_ONLY, TABLE_READERS, GraphView, dtype_name, node_label

MS_DOMAIN = "com.microsoft"
MATMUL_NBITS = "MatMulNBits"
GATHER_BLOCK_QUANTIZED = "GatherBlockQuantized"
# MatMulNBits's accuracy_level: the precision of its activations inside the kernel (0: unset, read as float)
ACCURACY_LEVELS = {0: "unset: float", 1: "fp32", 2: "fp16", 3: "bf16", 4: "int8"}
BITS_OF_DTYPE = {"int2": 2, "uint2": 2, "int4": 4, "uint4": 4, "int8": 8, "uint8": 8}
# ops between a stored weight's DequantizeLinear and the op that computes with it, values unchanged
_WEIGHT_PATH_OPS = SHAPE_ONLY | {"Transpose", "Cast"}
# the operand of each op kind that holds a weight: MatMul either side, Gemm A or B (not C), Conv W, a table
_WEIGHT_SLOTS = {"MatMul": (0, 1), "Gemm": (0, 1), "Conv": (1,), "ConvTranspose": (1,),
                 **{op: (0,) for op in TABLE_READERS}}


@dataclass(frozen=True)
class LowBitWeight:
    """One weight stored in low bits: the node that computes with it and how it is stored."""

    node: str  # the MatMulNBits / GatherBlockQuantized node, or the op that reads the DequantizeLinear
    kind: str  # what it computes: "MatMul", "Gemm", "Conv", "Gather"
    form: str  # "MatMulNBits", "DequantizeLinear" or "GatherBlockQuantized"
    bits: int
    group: int | None  # weights per scale along the reduced axis; None: one scale per channel (or tensor)
    signed: bool | None = None  # stored type signed (None: MatMulNBits / packed, unsigned codes)
    accuracy_level: int | None = None  # MatMulNBits only: its attribute (0 when absent)


@dataclass(frozen=True)
class FloatWeight:
    """A weighted op whose weight stays float in a weight-only file (an embedding table, an excluded layer)."""

    node: str
    kind: str
    tensor: str


@dataclass(frozen=True)
class WeightOnlyFacts:
    """Every low-bit weight of a file and every float weight beside them; ``describe()`` names the format."""

    weights: tuple[LowBitWeight, ...]
    float_weights: tuple[FloatWeight, ...]

    @property
    def bits(self) -> list[int]:
        return sorted({w.bits for w in self.weights})

    @property
    def forms(self) -> list[str]:
        return sorted({w.form for w in self.weights})

    @property
    def groups(self) -> list[int | None]:
        """Distinct group sizes (None: per channel), grouped ones first."""
        return sorted({w.group for w in self.weights}, key=lambda g: (g is None, g or 0))

    @property
    def accuracy_levels(self) -> dict[int, int]:
        """MatMulNBits accuracy_level -> how many nodes carry it."""
        return dict(sorted(Counter(w.accuracy_level for w in self.weights if w.accuracy_level is not None).items()))

    def counts(self) -> dict[str, int]:
        """Quantized weights by the op that computes with them (MatMul, Gemm, Gather...)."""
        return dict(sorted(Counter(w.kind for w in self.weights).items()))

    def float_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(w.kind for w in self.float_weights).items()))

    def describe(self) -> str:
        """``weight-only int4, MatMulNBits, group 32`` (several of a kind joined by ``/``)."""
        groups = "/".join("per channel" if g is None else str(g) for g in self.groups)
        word = "group" if len(self.groups) == 1 and self.groups[0] is not None else "groups"
        grouping = groups if self.groups == [None] else f"{word} {groups}"
        return (f"weight-only {'/'.join(f'int{b}' for b in self.bits)}, {' + '.join(self.forms)}, {grouping}")

    def as_dict(self) -> dict[str, Any]:
        return {"description": self.describe(), "bits": self.bits, "forms": self.forms, "groups": self.groups,
                "quantized": self.counts(), "float": self.float_counts(),
                "accuracy_levels": {str(k): v for k, v in self.accuracy_levels.items()},
                "weights": [asdict(w) for w in self.weights], "float_weights": [asdict(w) for w in self.float_weights]}


def _int_attributes(node: onnx.NodeProto) -> dict[str, int]:
    """The node's integer attributes (one of another type is left out: its default stands, the rules judge it)."""
    return {a.name: int(a.i) for a in node.attribute if a.type == onnx.AttributeProto.INT}


def _stored_origin(view: GraphView, tensor: str) -> str:
    """The stored tensor whose values ``tensor`` carries, through ops that only move or recast them."""
    producer = view.node_of(tensor)
    while producer is not None and producer.op_type in _WEIGHT_PATH_OPS and producer.input:
        tensor, producer = producer.input[0], view.node_of(producer.input[0])
    return tensor


def _matmul_nbits(node: onnx.NodeProto, label: str) -> LowBitWeight:
    attrs = _int_attributes(node)
    block = attrs.get("block_size", 0)
    return LowBitWeight(label, "MatMul", MATMUL_NBITS, attrs.get("bits", 4), block if block > 0 else None,
                        accuracy_level=attrs.get("accuracy_level", 0))


def _gather_block_quantized(view: GraphView, node: onnx.NodeProto, label: str) -> LowBitWeight:
    attrs = _int_attributes(node)
    stored = dtype_name(view.elem_type.get(_stored_origin(view, node.input[0]), 0)) if node.input else "undefined"
    bits = BITS_OF_DTYPE.get(stored, 8) if stored != "uint8" else attrs.get("bits", 4)  # uint8: packed codes
    signed = stored.startswith("int") if stored in BITS_OF_DTYPE and stored != "uint8" else None
    block = attrs.get("block_size", 128)
    return LowBitWeight(label, "Gather", GATHER_BLOCK_QUANTIZED, bits, block if block > 0 else None, signed)


def _readers(view: GraphView, tensor: str) -> list[tuple[onnx.NodeProto, int]]:
    """(op, input index) of each op computing with ``tensor``, looking through ops that only move its values."""
    found, stack = [], [tensor]
    while stack:
        current = stack.pop()
        for node in view.consumer_nodes(current):
            if node.op_type in _WEIGHT_PATH_OPS and node.input and node.input[0] == current:
                stack.extend(o for o in node.output if o)
            else:
                found.extend((node, i) for i, name in enumerate(node.input) if name == current)
    return found


def _stored_dequantize(view: GraphView, node: onnx.NodeProto, label: str) -> list[LowBitWeight]:
    """The weights a DequantizeLinear of a stored integer tensor feeds (a table gathered before it: Gather)."""
    if not node.input or not node.output:
        return []
    source, gathered = node.input[0], None
    producer = view.node_of(source)
    if producer is not None and producer.op_type in TABLE_READERS and producer.input \
            and producer.input[0] in view.constant:  # rows of a stored table gathered, then dequantized
        source, gathered = producer.input[0], node_label(producer, view.producer[node.input[0]])
    elif source not in view.constant:
        return []
    stored = dtype_name(view.elem_type.get(_stored_origin(view, source), 0))
    if stored not in BITS_OF_DTYPE:
        return []
    attrs = _int_attributes(node)
    block = attrs.get("block_size", 0)
    shape = view.shape.get(node.input[0]) or view.shape.get(_stored_origin(view, source))
    if block > 0 and shape and -len(shape) <= attrs.get("axis", 1) < len(shape) \
            and block >= shape[attrs.get("axis", 1)]:
        block = 0  # one block spans the axis: one scale per channel (a gathered row's scale)
    block = block if block > 0 else None
    weights = []
    uses = [("Gather", gathered)] if gathered else [(reader.op_type, node_label(reader, view.producer.get(reader.output[0], 0)))
                                         for reader, index in _readers(view, node.output[0])
                                         if index in _WEIGHT_SLOTS.get(reader.op_type, ()) and reader.output]
    for use, where in uses:
        weights.append(LowBitWeight(where, "Gather" if use in TABLE_READERS else use, "DequantizeLinear",
                                    BITS_OF_DTYPE[stored], block, stored.startswith("int")))
    return weights


def float_weights_of(view: GraphView, node: onnx.NodeProto) -> list[str]:
    """The stored float tensors (at least 2-D) ``node`` reads in a weight slot, through ops that only move or
    recast them; none for the Gather of a quantized table's row scales (read by DequantizeLinear as its scale)."""
    if node.op_type in TABLE_READERS and node.output and _only_scales(view, node.output[0]):
        return []
    found = []
    for slot in _WEIGHT_SLOTS.get(node.op_type, ()):
        if slot >= len(node.input) or not node.input[slot]:
            continue
        origin = _stored_origin(view, node.input[slot])
        producer = view.node_of(origin)
        if origin in view.constant and view.is_float(origin) and (producer is None or producer.op_type != DEQUANTIZE) \
                and len(view.shape.get(origin) or ()) >= 2:
            found.append(origin)
    return found


def _float_weights(view: GraphView) -> list[FloatWeight]:
    """Weighted ops reading a float constant in a weight slot (an embedding table, an excluded Linear)."""
    return [FloatWeight(node_label(node, index), "Gather" if node.op_type in TABLE_READERS else node.op_type, origin)
            for index, node in enumerate(view.nodes) for origin in float_weights_of(view, node)]


def _only_scales(view: GraphView, tensor: str) -> bool:
    """Whether every reader of ``tensor`` is a DequantizeLinear taking it as its scale."""
    readers = [(node, [i for i, name in enumerate(node.input) if name == tensor]) for node in view.consumer_nodes(tensor)]
    return bool(readers) and all(node.op_type == DEQUANTIZE and slots == [1] for node, slots in readers)


def weight_only_facts(view: GraphView) -> WeightOnlyFacts | None:
    """The low-bit weights of the graph (None when it holds none). Whether the file is weight-only (no
    activation quantized) is the caller's call (``quantization.quant_facts``)."""
    weights: list[LowBitWeight] = []
    for index, node in enumerate(view.nodes):
        label = node_label(node, index)
        if node.op_type == MATMUL_NBITS and node.domain == MS_DOMAIN:
            weights.append(_matmul_nbits(node, label))
        elif node.op_type == GATHER_BLOCK_QUANTIZED and node.domain == MS_DOMAIN:
            weights.append(_gather_block_quantized(view, node, label))
        elif node.op_type == DEQUANTIZE:
            weights.extend(_stored_dequantize(view, node, label))
    if not weights:
        return None
    return WeightOnlyFacts(tuple(weights), tuple(_float_weights(view)))


def describe_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``inspect``'s rows for a weight-only file, from ``WeightOnlyFacts.as_dict()`` (what its JSON holds)."""
    floats = summary["float_weights"]
    total = len(summary["weights"]) + len(floats)
    quantized = ", ".join(f"{n} {kind}" for kind, n in summary["quantized"].items())
    rows = [("low-bit weights", f"{len(summary['weights'])} of {total}: {quantized} "
                                f"({'/'.join(f'int{b}' for b in summary['bits'])})")]
    if floats:
        names = ", ".join(w["tensor"] for w in floats[:4]) + (", ..." if len(floats) > 4 else "")
        kinds = ", ".join(f"{n} {kind}" for kind, n in summary["float"].items())
        rows.append(("float weights", f"{len(floats)} of {total}: {kinds} ({names})"))
    else:
        rows.append(("float weights", "none"))
    levels = summary["accuracy_levels"]
    if levels:
        rows.append(("accuracy_level", ", ".join(
            f"{level} ({ACCURACY_LEVELS.get(int(level), '?')}) on {n} MatMulNBits" for level, n in levels.items())))
    return rows
