"""Per-node SQNR of a quantized ONNX file against its float file: where quantize-onnx loses the signal.

``node_sqnr`` plans the file as ``quantize_onnx_file`` does (same normalisation, probe and
``place.plan``), writes the quantized file (or reads one already written from the same float file
and options), then runs both in ONNX Runtime with every planned node's output exposed, batch by
batch (signal and noise power summed per batch, never the tensors kept), and reports one row per
node the plan quantizes.

What a figure measures (the same definition as ``quantize.layer_error``): the node's output in the
quantized file, taken after its QuantizeLinear -> DequantizeLinear pair when it has one (a fused
Relu/Clip included), against the same tensor of the normalised float model on the same inputs:
SQNR = 10 log10(sum ref^2 / sum (ref - quantized)^2) over all samples. The error is **accumulated
up to this node** (everything upstream is quantized too), not this node's error alone.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantship.errors import ExportRefused
from quantship.export.roles import role_of
from quantship.fidelity import own_loss_db, sqnr_db
from quantship.inspect.read.feeds import as_feeds, model_inputs
from quantship.inspect.read.loading import load_onnx
from quantship.quantize.algorithms.sensitivity import LayerError, LayerErrorReport
from quantship.quantize_onnx import calibrate, place, recurrent, selection
from quantship.quantize_onnx.calibrate import MEMORY_BUDGET, Feed
from quantship.quantize_onnx.quantizer import feeds_for, placement_for, prepare, quantize_onnx_file, refuse_unusable
from quantship.targets import Target

MEASURE = "accumulated"  # each figure includes the error of every quantized node upstream (quantize.layer_error's)
MEASURE_TEXT = "SQNR of the node's (dequantized) output vs float, error accumulated up to this node"
# roles whose rows are candidates to keep in float: ops that add a rounding of their own (data movement
# with a shared scale adds none: its figure is its input's)
# (and an LSTM in integer form: ``recurrent``, its int8 weights and the kernel's own activation rounding)
OWN_ROUNDING = ("weighted", "matmul", "integer_capable", "concat", "recurrent")


@dataclass(frozen=True)
class NodeSqnr:
    """One quantized node: ``node`` is the name ``--exclude`` takes, ``tensor`` the output measured."""

    order: int
    node: str
    op: str
    role: str
    tensor: str
    sqnr_db: float
    upstream_db: float = math.inf  # the worst SQNR among the measured tensors it reads (inf: only float inputs)

    @property
    def own_loss_db(self) -> float:
        """What this node itself loses (``fidelity.own_loss_db``)."""
        return own_loss_db(self.upstream_db, self.sqnr_db)


@dataclass
class NodeSqnrReport:
    """Every quantized node's SQNR (accumulated, see ``MEASURE``), in graph order, and every output's:
    ``output_sqnr_db`` is the worst output's, ``per_output_sqnr_db`` each one by graph output name."""

    rows: list[NodeSqnr]
    output_sqnr_db: float
    n_samples: int
    target: str
    excluded: list[str] = field(default_factory=list)  # nodes kept float while measuring
    unmatched: list[str] = field(default_factory=list)  # planned tensors the written file does not hold
    per_output_sqnr_db: dict[str, float] = field(default_factory=dict)

    def candidates(self) -> list[NodeSqnr]:
        """Rows that add a rounding of their own, worst (lowest SQNR) first: what to keep in float."""
        return sorted((r for r in self.rows if r.role in OWN_ROUNDING), key=lambda r: (r.sqnr_db, r.order))

    def worst(self, k: int = 3) -> list[NodeSqnr]:
        return self.candidates()[:k]

    def by_own_loss(self) -> list[NodeSqnr]:
        """Candidates that lose signal themselves, the largest loss first (a node that only carries an
        upstream loss does not rank): where keeping a node float gives back the most."""
        rows = [r for r in self.rows if r.role in OWN_ROUNDING and r.own_loss_db > 0]
        return sorted(rows, key=lambda r: (-r.own_loss_db, r.order))

    def suggest_exclude(self, k: int = 3) -> list[str]:
        """Node names for ``quantize-onnx --exclude``: the ``k`` worst candidates, leaving at least one weighted
        node quantized (a file with every weighted node float has nothing to run as an integer kernel)."""
        if k < 1:
            raise ValueError(f"k={k!r}: ask for at least one node (k >= 1)")
        weighted = sum(r.role in ("weighted", "recurrent") for r in self.rows)
        worst = self.worst(k)
        while worst and sum(r.role in ("weighted", "recurrent") for r in worst) >= weighted:
            worst.pop()
        return [r.node for r in worst]

    def as_dict(self) -> dict:
        return {"version": 1, "measure": MEASURE, "measure_text": MEASURE_TEXT, "target": self.target,
                "n_samples": self.n_samples, "output_sqnr_db": self.output_sqnr_db,
                "per_output_sqnr_db": dict(self.per_output_sqnr_db),
                "rows": [asdict(r) for r in self.rows], "worst": [r.node for r in self.worst()],
                "excluded": list(self.excluded), "unmatched": list(self.unmatched)}

    def to_markdown(self, worst: int = 3) -> str:
        marked = {r.node for r in self.worst(worst)}
        lines = [f"| # | node | op | tensor | SQNR (dB, {MEASURE}) |", "|---:|---|---|---|---:|"]
        for r in self.rows:
            flag = " **worst**" if r.node in marked else ""
            lines.append(f"| {r.order} | {r.node} | {r.op} | {r.tensor} | {r.sqnr_db:.1f}{flag} |")
        each = ("" if len(self.per_output_sqnr_db) < 2 else " (the worst output; per output: "
                + ", ".join(f"{name} {db:.1f} dB" for name, db in self.per_output_sqnr_db.items()) + ")")
        lines.append(f"\n{MEASURE_TEXT}; model output SQNR {self.output_sqnr_db:.1f} dB{each} over {self.n_samples} "
                     "sample(s)")
        return "\n".join(lines)

    def plot(self, path: str | Path, worst: int = 3) -> Path:
        """A PNG bar chart, graph order, the worst candidates in red (``LayerErrorReport.plot``)."""
        marked = {r.node for r in self.worst(worst)}
        rows = [LayerError(r.order, r.node, r.node, r.op, r.sqnr_db) for r in self.rows]
        return _Chart(rows, self.output_sqnr_db, self.n_samples, marked=marked).plot(path, worst=worst)


@dataclass
class _Chart(LayerErrorReport):
    """The PyTorch report's chart, with this report's worst rows (candidates only) marked."""

    marked: set[str] = field(default_factory=set)

    def worst(self, k: int = 3) -> list[LayerError]:
        return [r for r in self.rows if r.node in self.marked]


@dataclass(frozen=True)
class _Row:
    order: int
    node: str
    op: str
    role: str
    tensor: str  # in the normalised float model
    upstream: tuple[int, ...] = ()  # rows whose measured tensor this node reads (through unplanned ops)


def _upstream(node: ir.Node, measured: dict[str, int]) -> tuple[int, ...]:
    """The rows whose measured tensor reaches ``node``'s inputs through nodes that are not rows."""
    found, seen, todo = set(), set(), [v for v in node.inputs if v is not None]
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if value.name in measured:
            found.add(measured[value.name])
            continue
        producer = value.producer()
        if producer is not None:
            todo.extend(v for v in producer.inputs if v is not None)
    return tuple(sorted(found))


def planned_rows(model: ir.Model, layout: place.Plan, recurrent_nodes: Iterable[int] = ()) -> list[_Row]:
    """One row per node the plan runs on quantized inputs, and per recurrent node written in integer form
    (``recurrent_nodes``: their first named output); a fused Relu/Clip is folded into its producer (the
    measured tensor is then the Relu's output: the quantization point)."""
    nodes = layout.nodes
    index = {id(n): i for i, n in enumerate(nodes)}
    lstm = set(recurrent_nodes)
    planned = {*layout.integer_nodes, *layout.weighted, *lstm}
    folded: set[int] = set()
    rows, sources = [], []
    for i in sorted(planned):
        if i in folded:
            continue
        node = nodes[i]
        if i in lstm:
            out = next(o for o in node.outputs if o.name and (o.uses() or o.is_graph_output()))
            rows.append(_Row(len(rows), selection.node_label(node, i), node.op_type, "recurrent", out.name))
            sources.append(node)
            continue
        if not node.outputs or not node.outputs[0].name:
            continue
        out = node.outputs[0]
        uses = out.uses()
        if len(uses) == 1 and not out.is_graph_output():
            nxt = index.get(id(uses[0].node))
            if nxt in planned and role_of(nodes[nxt].op_type, nodes[nxt].domain) == "fused_activation":
                folded.add(nxt)
                out = nodes[nxt].outputs[0]
        role = role_of(node.op_type, node.domain)
        if role == "weighted" and i not in layout.weighted:
            role = "matmul"  # a MatMul of two activations
        if role == "fused_activation":
            continue  # its producer's row holds it
        rows.append(_Row(len(rows), selection.node_label(node, i), node.op_type, role, out.name))
        sources.append(node)
    measured = {r.tensor: r.order for r in rows}
    return [_Row(r.order, r.node, r.op, r.role, r.tensor,
                 tuple(u for u in _upstream(node, measured) if u != r.order)) for r, node in zip(rows, sources)]


def _quantized_names(quantized: onnx.ModelProto, tensors: Iterable[str]) -> dict[str, str]:
    """Float tensor -> the tensor of the quantized file holding its value as the file computes it:
    the DequantizeLinear after its QuantizeLinear, else the tensor itself (an output left float)."""
    graph = quantized.graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    produced = {o for n in graph.node for o in n.output}
    dq_outputs = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    outputs = {o.name for o in graph.output}
    found = {}
    for name in tensors:
        if name in outputs and name in dq_outputs:
            found[name] = name  # a quantized graph output: the pair's DequantizeLinear kept the name
            continue
        q = next((n for n in readers.get(name, []) if n.op_type == "QuantizeLinear"), None)
        dq = next((n for n in readers.get(q.output[0], []) if n.op_type == "DequantizeLinear"), None) if q else None
        if dq is not None:
            found[name] = dq.output[0]
        elif name in produced:
            found[name] = name
    return found


def _exposed_bytes(names: Sequence[str], info: dict[str, calibrate.TensorInfo]) -> int:
    return sum(info[n].bytes_per_sample for n in names if n in info) or 1


def _accumulate(float_model: onnx.ModelProto, quantized: onnx.ModelProto, pairs: list[tuple[str, str]],
                feeds: Sequence[Feed], rows_per_run: int) -> tuple[list[float], list[float], int]:
    """Signal and noise power of every (float tensor, quantized tensor) pair over all feeds, in slices
    of ``rows_per_run`` samples (only one slice's tensors are alive at a time)."""
    float_names = [f for f, _ in pairs]
    quant_names = [q for _, q in pairs]
    float_session = calibrate.exposing_session(float_model, float_names)
    quant_session = calibrate.exposing_session(quantized, quant_names)
    signal, noise = [0.0] * len(pairs), [0.0] * len(pairs)
    n = 0
    for feed in feeds:
        size = len(next(iter(feed.values())))
        for start in range(0, size, rows_per_run):
            part = {k: v[start:start + rows_per_run] for k, v in feed.items()}
            refs = float_session.run(float_names, part)
            gots = quant_session.run(quant_names, part)
            for k, (ref, got) in enumerate(zip(refs, gots)):
                ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
                if ref.shape != got.shape:
                    raise ExportRefused(f"tensor {pairs[k][0]} has shape {list(ref.shape)} in the float file and "
                                        f"{list(got.shape)} in the quantized file: they are not the same model")
                signal[k] += float(np.square(ref).sum())
                noise[k] += float(np.square(ref - got).sum())
            del refs, gots
        n += size
    return signal, noise, n


def node_sqnr(float_path: str | Path, calibration: Any, *, target: str | Target, exclude: Iterable[str] = (),
              observer: str | None = None, per_tensor: bool = False, equalize: bool = False,
              bias_correction: bool = False, seq_mse: bool = False, adaround: bool | int = False,
              quantized_path: str | Path | None = None, smooth_quant: float | None = None) -> NodeSqnrReport:
    """Per-node SQNR (accumulated, see the module docstring) of the file ``quantize_onnx_file`` writes
    for these options, on ``calibration`` (its argument's forms: an array, a dict, or batches of either).

    ``quantized_path``: a file already written from ``float_path`` with the same options (the accuracy
    search passes its first step); otherwise one is quantized into a temporary folder and removed.
    """
    src = Path(float_path).expanduser()
    proto = load_onnx(src)
    refuse_unusable(proto, float_path)
    inputs = model_inputs(proto)
    placement, p, _ = placement_for(target, per_tensor=per_tensor)
    feeds = feeds_for(p, as_feeds(calibration, inputs))
    ready = prepare(proto, inputs, feeds, p, placement, exclude, equalize=equalize, smooth_quant=smooth_quant)
    del proto
    model, normal, info, excluded, layout = ready.model, ready.normal, ready.info, ready.excluded, ready.layout
    rows = planned_rows(model, layout, recurrent.integer_indices(layout.nodes, ready.recurrent_plan))
    skipped = sorted(selection.node_label(layout.nodes[i], i) for i in excluded)
    del model
    if quantized_path is None:
        with tempfile.TemporaryDirectory(prefix="quantship-sensitivity-") as scratch:
            written = quantize_onnx_file(src, Path(scratch) / "quantized.onnx", feeds, target=p, exclude=exclude,
                                         observer=observer, per_tensor=per_tensor, run_check=False,
                                         equalize=equalize, bias_correction=bias_correction, seq_mse=seq_mse,
                                         adaround=adaround, smooth_quant=smooth_quant)
            quantized = onnx.load(str(written.path))
    else:
        quantized = load_onnx(quantized_path)
    names = _quantized_names(quantized, [r.tensor for r in rows])
    measured = [r for r in rows if r.tensor in names]
    outputs = [o.name for o in normal.graph.output]  # the quantized file keeps them, in order
    pairs = [(r.tensor, names[r.tensor]) for r in measured] + list(zip(outputs, [o.name for o in quantized.graph.output]))
    rows_per_run = max(1, MEMORY_BUDGET // (2 * _exposed_bytes([f for f, _ in pairs], info)))
    signal, noise, n = _accumulate(normal, quantized, pairs, feeds, rows_per_run)
    own = [sqnr_db(signal[k], noise[k]) for k in range(len(measured))]
    position = {r.order: k for k, r in enumerate(measured)}
    result = [NodeSqnr(k, r.node, r.op, r.role, r.tensor, own[k],
                       min((own[position[u]] for u in r.upstream if u in position), default=math.inf))
              for k, r in enumerate(measured)]
    each = {name: sqnr_db(signal[len(measured) + k], noise[len(measured) + k]) for k, name in enumerate(outputs)}
    return NodeSqnrReport(result, min(each.values()), n, p.target, excluded=skipped,
                          unmatched=[r.tensor for r in rows if r.tensor not in names], per_output_sqnr_db=each)

