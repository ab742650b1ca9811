"""Float islands: the float tensors a fully integer target runs in float on purpose, as a structural fact
of the graph (the placement keeps them float, the ``fully_quantized`` rule does not count them).

- ``normalisation_statistics``: the per-row statistics of a written-out normalisation: a sum or mean
  reduction (with the squares it sums, for a second moment) and what is computed from reductions alone (E[x^2] - E[x]^2, + eps, sqrt, reciprocal, x gamma),
  kept when it is applied back to the tensor it summarises (a Sub/Mul/Div/Add whose other operand is
  not a statistic). One int8 scale cannot hold them: a variance spans orders of magnitude across rows
  and E[x^2] - E[x]^2 cancels (magika: 31 dB inputs, 7.6 dB variance). TensorRT runs a normalisation's
  arithmetic in float (its own normalisation layer); a global average pool (a mean read by a Conv or
  Gemm, never re-applied) is not an island.
- ``polynomial_interiors``: the inside of an activation function written out as a polynomial under a
  saturating op (GELU's tanh form: x*x, x^3, x + 0.044715 x^3, its scaling, up to the Tanh): a cube
  spans the cube of the input's range, so one int8 scale rounds x and 0.044715 x^3 to 0 for every
  moderate x (magika's second GELU: Conv_0's output reaches +-296, x^3 +-1e6, Tanh at 0.1 dB).
- ``detection_postprocess``: a detector's post-processing, everything that feeds a selection
  (``NonMaxSuppression``, ``TopK``, or an ``If``/``Loop`` whose body runs one) back to the compute ops
  that produced it (the head's Conv/Gemm outputs, which keep their own pair), and everything computed
  from that downstream until a compute op or a feature sampler (``RoiAlign``) reads it: anchor
  arithmetic, box decoding (Exp of the regressed sizes, pixel coordinates), softmax/sigmoid scores,
  thresholds, top-k, NMS. Box coordinates span the image (0..320) while the deltas they decode are
  O(1), scores that differ by a few 1e-4 decide the order of the top-k: one int8 scale per tensor
  rounds the ranking and moves boxes by pixels; these ops have no integer kernel anyway.
- ``dequantized_data``: values that are dequantized integers moved without arithmetic (a Concat, Slice,
  Transpose... of DequantizeLinear outputs): exact, so a float graph output written this way computes
  nothing in float (TiGrIS 0.12.1 compiles such a tail and runs it).

Both read op records (``Op``), so the planner (onnx_ir, before the pairs exist) and the checker (the
written protobuf) apply the same definition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2"})
STATISTIC_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Sqrt", "Reciprocal", "Pow", "Neg", "Abs",
                           "Reshape", "Expand", "Squeeze", "Unsqueeze", "Identity", "Flatten"})
REJOIN_OPS = frozenset({"Add", "Sub", "Mul", "Div"})
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Neg"})
SATURATING = frozenset({"Tanh", "Sigmoid", "Erf", "HardSigmoid", "Softsign"})
DATA_MOVEMENT = frozenset({"Concat", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Slice",
                           "Split", "Gather", "Expand", "Tile"})
DEQUANTIZE = "DequantizeLinear"


SELECTION_OPS = frozenset({"NonMaxSuppression", "TopK"})
# where the post-processing region ends: compute that reads it (its output is features, not boxes) and the
# Q/DQ of a written file
POSTPROCESS_BOUNDARY = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "RoiAlign", "MaxRoiPool",
                                  "QuantizeLinear", DEQUANTIZE})


@dataclass(frozen=True)
class Op:
    """One node as the island rules read it (inputs/outputs by tensor name, "" for an absent one). A node
    with subgraphs (If, Loop, Scan) lists the outer tensors its bodies read among its inputs, and the op
    types its bodies run in ``nested``."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nested: frozenset[str] = frozenset()

    @property
    def selects(self) -> bool:
        return self.op_type in SELECTION_OPS or bool(self.nested & SELECTION_OPS)


def detection_postprocess(ops: Sequence[Op], is_activation: Callable[[str], bool]) -> set[str]:
    """The float tensors of a detector's post-processing in ``ops`` (graph order): see the module docstring."""
    producer = {o: op for op in ops for o in op.outputs if o}
    region: set[str] = set()
    stack = [v for op in ops if op.selects for v in (*op.inputs, *op.outputs) if v and is_activation(v)]
    while stack:  # back from each selection to the compute ops
        name = stack.pop()
        op = producer.get(name)
        if name in region or op is not None and op.op_type in POSTPROCESS_BOUNDARY:
            continue
        region.add(name)
        if op is not None:
            stack.extend(v for v in op.inputs if v and is_activation(v))
    if not region:
        return region
    for op in ops:  # then forward, what is computed from it
        if op.op_type not in POSTPROCESS_BOUNDARY and any(v in region for v in op.inputs if v):
            region.update(o for o in op.outputs if o and is_activation(o))
    return region


def normalisation_statistics(ops: Sequence[Op], is_activation: Callable[[str], bool]) -> set[str]:
    """The statistic tensors of every written-out normalisation in ``ops`` (in graph order)."""
    group: dict[str, int] = {}  # statistic tensor -> its reduction's group
    parent: list[int] = []

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    rejoined: set[int] = set()
    squares: set[str] = set()  # x * x (or x ** 2): a reduction of it is a second moment
    scaled = _Scaled()
    for op in ops:
        acts = [v for v in op.inputs if v and is_activation(v)]
        stats = [v for v in acts if v in group]
        scaled.see(op, acts)
        if not stats and scaled.is_square(op, acts):
            squares.update(o for o in op.outputs if o)
        if op.op_type in REDUCTIONS and acts and acts[0] not in group:
            parent.append(len(parent))
            for o in op.outputs:
                if o:
                    group[o] = len(parent) - 1
            if acts[0] in squares:  # its squares hold twice the dynamic range: the same island
                group[acts[0]] = len(parent) - 1
        elif stats and op.op_type in STATISTIC_OPS and len(stats) == len(acts):
            roots = {find(group[v]) for v in stats}
            first = roots.pop()
            for r in roots:
                parent[r] = first
            for o in op.outputs:
                if o:
                    group[o] = first
        elif stats and op.op_type in REJOIN_OPS:
            rejoined.update(find(group[v]) for v in stats)
    kept = {find(r) for r in rejoined}
    return {name for name, k in group.items() if find(k) in kept}


class _Scaled:
    """The activation each tensor is a constant multiple of (x, c*x, -x, x/c, and x through a Q/DQ pair:
    the same base)."""

    def __init__(self) -> None:
        self.base: dict[str, str] = {}

    def of(self, name: str) -> str:
        return self.base.get(name, name)

    def see(self, op: Op, acts: list[str]) -> None:
        if op.op_type in ("QuantizeLinear", DEQUANTIZE) and op.inputs and op.outputs and op.outputs[0]:
            self.base[op.outputs[0]] = self.of(op.inputs[0])  # a pair keeps the value it rounds
        elif op.op_type in ("Mul", "Div", "Neg") and len(acts) == 1 and (op.op_type != "Div" or op.inputs[0] == acts[0]):
            for o in op.outputs:
                if o:
                    self.base[o] = self.of(acts[0])

    def is_square(self, op: Op, acts: list[str]) -> bool:
        """x * x, x * (c x), or x ** k: a power of one activation."""
        return bool(acts) and (op.op_type == "Mul" and len(acts) == 2 and self.of(acts[0]) == self.of(acts[1])
                               or op.op_type == "Pow" and acts == [op.inputs[0]])


def polynomial_interiors(ops: Sequence[Op], is_activation: Callable[[str], bool]) -> set[str]:
    """The tensors of every polynomial (from a square of an activation) that a saturating op reads."""
    chain: dict[str, int] = {}  # interior tensor -> the square it grew from
    closed: set[int] = set()
    scaled = _Scaled()
    for op in ops:
        acts = [v for v in op.inputs if v and is_activation(v)]
        inside = [v for v in acts if v in chain]
        scaled.see(op, acts)
        if not inside and scaled.is_square(op, acts):
            for o in op.outputs:
                if o:
                    chain[o] = len(chain)
        elif inside and op.op_type in ELEMENTWISE:
            for o in op.outputs:
                if o:
                    chain[o] = chain[inside[0]]
        elif inside and op.op_type in SATURATING:
            closed.update(chain[v] for v in inside)
    # a chain is one square's descendants: keep those that end under a saturating op
    return {name for name, k in chain.items() if k in closed}


def dequantized_data(ops: Iterable[Op], is_activation: Callable[[str], bool]) -> set[str]:
    """Float tensors holding dequantized integers only: DequantizeLinear outputs, and data movement of them."""
    exact: set[str] = set()
    for op in ops:
        if op.op_type == DEQUANTIZE:
            exact.update(o for o in op.outputs if o)
        elif op.op_type in DATA_MOVEMENT:
            data = [v for v in (op.inputs[:1] if op.op_type != "Concat" else op.inputs) if v and is_activation(v)]
            if data and all(v in exact for v in data):
                exact.update(o for o in op.outputs if o)
    return exact
