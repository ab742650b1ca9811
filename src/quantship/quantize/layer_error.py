"""Per-layer quantization error: where in the graph a pt2e model loses its signal.

A *layer output* here is a tensor the converted graph quantizes: the result of an annotated
partition (conv or linear with its folded batch-norm and fused ReLU, an add with its ReLU, a
pooling...), taken after its quantize -> dequantize pair, so the figure includes the rounding of
that output. The float reference is the same tensor in the float model captured the same way
(node names match; a batch-norm that pt2e folded into its convolution is applied on the float
side). SQNR = 10 log10(sum ref^2 / sum (ref - quantized)^2), accumulated over all inputs.

Errors compound: a layer's figure includes everything upstream of it, which is what a user who
chooses layers to keep in float needs (``suggest_skip``; ``skip_effect.measure_skip`` measures the choice).
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Iterable

import torch
from torch.fx import GraphModule, Interpreter, Node

from quantship.fidelity import sqnr_db
from quantship.precision import smallest_names
from quantship.quantize.algorithms.sensitivity import LayerError, LayerErrorReport
from quantship.quantize.annotator import BATCH_NORM_OPS, fused_head, module_path
from quantship.quantize.capture import capture

qd = torch.ops.quantized_decomposed
_QUANTIZE = {qd.quantize_per_tensor.default, qd.quantize_per_tensor.tensor}
_DEQUANTIZE = {qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor}


def _upstream(node: Node, producers: dict[str, int]) -> set[int]:
    """The rows whose producer ``node`` reads, through dequantize/quantize and other ops that are not rows."""
    found, seen, todo = set(), set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.name in producers:
            found.add(producers[n.name])
            continue
        todo.extend(n.all_input_nodes)
    return found


class _Recorder(Interpreter):
    """Runs a graph and keeps the values of the nodes named in ``keep``."""

    def __init__(self, gm: GraphModule, keep: set[str]):
        super().__init__(gm)
        self.keep, self.values = keep, {}

    def run_node(self, n: Node):
        out = super().run_node(n)
        if n.name in self.keep:
            self.values[n.name] = out.detach().double() if isinstance(out, torch.Tensor) else out
        return out


def _quantized_outputs(gm: GraphModule) -> list[tuple[Node, Node]]:
    """(producer, dequantize-after-its-quantize) for every quantized non-input tensor, graph order."""
    pairs = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _QUANTIZE:
            continue
        producer = node.args[0]
        if not isinstance(producer, Node) or producer.op == "placeholder":
            continue
        dq = next((u for u in node.users if u.op == "call_function" and u.target in _DEQUANTIZE), None)
        if dq is not None:
            pairs.append((producer, dq))
    return pairs


def _float_equivalent(node: Node) -> Node:
    """The float-graph node holding what pt2e's folded graph computes at ``node`` (after its BN)."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.op == "call_function" and (user.target in BATCH_NORM_OPS or user.target is operator.getitem):
            node = user
        else:
            break
    return node


def skip_name(node: Node) -> str:
    """The module name that ``skip_activations`` needs to keep this output in float: a ReLU fused into a
    conv/linear or an add belongs to that op's annotation (``fused_head``), so the name is that op's module."""
    return module_path(fused_head(node))


def _units(producers: list[Node], upstream: list[set[int]], own: list[float]) -> list[str]:
    """For each output, the smallest name that changes it alone (``LayerError.unit``): its module when no other
    of ``producers`` is in that module or below it, else its op (``fused_head``). An op that reads no quantized
    value itself (a float op after a quantized one: a log, a power) only shows a loss made upstream, which it may
    magnify: its unit is that of the worst output it reads (``upstream``, ``own`` their SQNRs), where the loss is
    made and can be repaired."""
    heads = [fused_head(p) for p in producers]
    units = smallest_names([module_path(h) for h in heads], [h.name for h in heads])
    reads = [any(a.op == "call_function" and a.target in _DEQUANTIZE for a in h.all_input_nodes) for h in heads]
    return [units[i] if reads[i] or not upstream[i] else units[min(upstream[i], key=lambda u: own[u])]
            for i in range(len(units))]


def _as_batches(inputs: torch.Tensor | Iterable) -> list[torch.Tensor]:
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    batches = [b[0] if isinstance(b, (tuple, list)) else b for b in inputs]
    if not batches or not all(isinstance(b, torch.Tensor) for b in batches):
        raise TypeError("inputs must be a tensor or an iterable of tensors / (x, y) tuples at the captured batch size")
    return batches


def layer_error(float_model: torch.nn.Module, quantized_model: GraphModule,
                inputs: torch.Tensor | Iterable) -> LayerErrorReport:
    """SQNR of every quantized layer output of a pt2e model against its float model, same inputs.

    ``inputs``: a tensor or batches at the batch size the quantized model was captured with.
    """

    if not isinstance(quantized_model, GraphModule) or not _quantized_outputs(quantized_model):
        raise ValueError(
            f"quantized_model ({type(quantized_model).__name__}) has no quantize/dequantize pair: "
            "pass the result of Quantizer(backend='pt2e').quantize(...)"
        )
    batches = _as_batches(inputs)
    float_graph = capture(copy.deepcopy(float_model).eval(), batches[0]).graph
    by_name = {n.name: n for n in float_graph.graph.nodes}
    pairs, unmatched = [], []
    for producer, dq in _quantized_outputs(quantized_model):
        if producer.name in by_name:
            pairs.append((producer, dq, _float_equivalent(by_name[producer.name])))
        else:
            unmatched.append(producer.name)
    if not pairs:
        raise ValueError("no quantized tensor of quantized_model matches a node of float_model: "
                         "pass the float model that was quantized, unmodified")
    signal = [0.0] * len(pairs)
    noise = [0.0] * len(pairs)
    mismatched: set[int] = set()
    out_signal = out_noise = 0.0
    n_samples = 0
    with torch.no_grad():
        for x in batches:
            qrec = _Recorder(quantized_model, {dq.name for _, dq, _ in pairs})
            frec = _Recorder(float_graph, {f.name for _, _, f in pairs})
            q_out, f_out = qrec.run(x), frec.run(x)
            for i, (_, dq, f) in enumerate(pairs):
                ref, got = frec.values[f.name], qrec.values[dq.name]
                if ref.shape != got.shape:  # the same name, another tensor (a rewrite renamed the graph)
                    mismatched.add(i)
                    continue
                signal[i] += float((ref * ref).sum())
                noise[i] += float(((ref - got) ** 2).sum())
            ref_out, got_out = _first_tensor(f_out).double(), _first_tensor(q_out).double()
            out_signal += float((ref_out * ref_out).sum())
            out_noise += float(((ref_out - got_out) ** 2).sum())
            n_samples += x.shape[0]
    unmatched += [pairs[i][0].name for i in sorted(mismatched)]
    pairs = [pair for i, pair in enumerate(pairs) if i not in mismatched]
    signal = [v for i, v in enumerate(signal) if i not in mismatched]
    noise = [v for i, v in enumerate(noise) if i not in mismatched]
    own = [sqnr_db(signal[i], noise[i]) for i in range(len(pairs))]
    producers = {p.name: i for i, (p, _, _) in enumerate(pairs)}
    upstream = [_upstream(p, producers) - {i} for i, (p, _, _) in enumerate(pairs)]
    units = _units([p for p, _, _ in pairs], upstream, own)
    rows = [
        LayerError(order=i, node=p.name, module=skip_name(p), op=str(getattr(p.target, "__name__", p.target)),
                   sqnr_db=own[i], upstream_db=min((own[u] for u in upstream[i]), default=math.inf), unit=units[i])
        for i, (p, _, _) in enumerate(pairs)
    ]
    return LayerErrorReport(rows, sqnr_db(out_signal, out_noise), n_samples, unmatched)


def _first_tensor(out) -> torch.Tensor:
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out.detach()


def suggest_skip(report: LayerErrorReport, k: int = 1) -> list[str]:
    """Names for ``skip_activations`` covering the ``k`` worst layers (``LayerError.unit``: a module, or one op
    where its module holds other quantized outputs)."""
    if k < 1:
        raise ValueError(f"k={k!r}: ask for at least one layer (k >= 1)")
    return list(dict.fromkeys(r.unit for r in sorted(report.rows, key=lambda r: r.sqnr_db)))[:k]
