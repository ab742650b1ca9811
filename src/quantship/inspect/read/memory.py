"""The naive activation peak: liveness over a topological order, no scheduling, no tiling.

This is the figure TiGrIS calls "unscheduled": a tensor lives from the step that produces it to
its last consumer, inputs from step 0, outputs to the end; constants take no activation memory;
shape-only ops share their input's storage; every size is rounded up to 32 bytes. With
``one_byte=True`` Q/DQ pairs are folded (they share storage too) and every element takes one
byte: the file as an int8 runtime holds it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from quantship.inspect.read.view import DEQUANTIZE, QUANTIZE, SHAPE_ONLY, GraphView, dtype_name, dtype_size

ALIGN = 32


@dataclass(frozen=True)
class TensorSize:
    """One activation: name, static shape, stored dtype, bytes it occupies (aligned)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int

    def as_dict(self) -> dict:
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out


@dataclass(frozen=True)
class Liveness:
    """The result of one liveness pass."""

    peak_bytes: int
    peak_step: int
    largest: TensorSize | None
    n_activations: int
    unknown_shapes: tuple[str, ...]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def naive_peak(view: GraphView, *, one_byte: bool = False) -> Liveness:
    """Peak activation bytes over the file's topological order (see the module docstring)."""

    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.get(name, name) != name:
            name = parent[name]
        return name

    sharing = SHAPE_ONLY | ({QUANTIZE, DEQUANTIZE} if one_byte else frozenset())
    activations = [n for n in view.inputs] + [
        o for node in view.nodes for o in node.output if o and o not in view.constant
    ]
    for node in view.nodes:
        shares = node.op_type in sharing or (one_byte and view.fused_into_producer(node))
        if shares and node.input and node.input[0] not in view.constant:
            for out in node.output[:1]:
                if out:
                    parent[root(out)] = root(node.input[0])

    steps = len(view.nodes)
    start: dict[str, int] = {}
    end: dict[str, int] = {}
    size: dict[str, int] = {}
    largest: TensorSize | None = None
    unknown: list[str] = []
    outputs = set(view.outputs)
    for name in activations:
        group = root(name)
        shape = view.shape.get(name)
        if shape is None:
            unknown.append(name)
            nbytes = 0
        else:
            per = 1 if one_byte else dtype_size(view.elem_type.get(name, 0))
            nbytes = _aligned(math.prod(shape) * per)
            if largest is None or nbytes > largest.bytes:
                dtype = "int8" if one_byte else dtype_name(view.elem_type.get(name, 0))
                largest = TensorSize(name, tuple(shape), dtype, nbytes)
        first = view.producer.get(name, -1) + 1 if name in view.producer else 0
        last = steps if name in outputs else max(view.consumers.get(name, [first - 1]), default=first - 1) + 1
        start[group] = min(start.get(group, first), first)
        end[group] = max(end.get(group, last), last, first)
        size[group] = max(size.get(group, 0), nbytes)

    delta = [0] * (steps + 2)
    for group, nbytes in size.items():
        delta[start[group]] += nbytes
        delta[end[group] + 1] -= nbytes
    live, peak, peak_step = 0, 0, 0
    for step in range(steps + 1):
        live += delta[step]
        if live > peak:
            peak, peak_step = live, step
    return Liveness(peak, peak_step, largest, len(size), tuple(unknown))
