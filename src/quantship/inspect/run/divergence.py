"""Where a QDQ file and the pt2e model it was exported from part ways, quantized tensor by quantized tensor.

Every per-tensor QuantizeLinear of the file (ONNX Runtime, optimizations off) is paired with the
``quantize_per_tensor`` of the converted torch graph at the same position, and compared in integer
steps (each side relative to its own zero-point, so uint8 and int8 files read alike). Two figures
per quantized tensor:

- *propagated*: file and torch each run on the sample from the input on; what the output error is
  made of, including every earlier disagreement carried forward;
- *local*: the torch ops between two quantize nodes fed the file's own quantized inputs; the file's
  arithmetic for that stretch alone. A file that computes what torch computes has local errors of
  at most one step, on a handful of elements (float32 sums in another order land a value a hair on
  the other side of a rounding midpoint); any wrong scale, pooling mode or decomposition shows up
  as a larger or widespread local error at the first layer it touches.

A network that amplifies a one-step change (deep, untrained, exploding activations) turns a single
local flip into many propagated steps at the output; this report tells the two cases apart.
torch is imported only inside the functions that run a torch model.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quantship.inspect.read.counts import constant_values
from quantship.inspect.run.consumers import ort_session, run_session

__all__ = ["DivergenceReport", "LayerDivergence", "trace_divergence"]

_SCALE_RTOL = 1e-6  # float32 scales written to the file and read back


@dataclass(frozen=True)
class LayerDivergence:
    """One quantized tensor: its file name, the tensor it quantizes, and both disagreements in steps."""

    order: int
    name: str  # the QuantizeLinear output in the file
    source: str  # the tensor that QuantizeLinear reads
    scale: float
    size: int
    propagated_max: int
    propagated_count: int  # elements whose integer differs, end-to-end runs
    local_max: int
    local_count: int  # elements whose integer differs, torch fed the file's quantized inputs


@dataclass(frozen=True)
class DivergenceReport:
    """Every quantized tensor in graph order; ``first_local`` is where the file's own arithmetic first differs."""

    rows: list[LayerDivergence]

    @property
    def max_local(self) -> int:
        return max((r.local_max for r in self.rows), default=0)

    @property
    def n_local(self) -> int:
        """Elements, over all quantized tensors, where the file's arithmetic alone gives another integer."""
        return sum(r.local_count for r in self.rows)

    @property
    def first_local(self) -> LayerDivergence | None:
        return next((r for r in self.rows if r.local_count), None)

    @property
    def first_propagated(self) -> LayerDivergence | None:
        return next((r for r in self.rows if r.propagated_count), None)

    def as_dict(self) -> dict:
        return {"max_local": self.max_local, "n_local": self.n_local, "rows": [asdict(r) for r in self.rows]}

    def table(self, only_divergent: bool = True) -> str:
        """A markdown table (by default the rows where either figure is non-zero)."""
        lines = ["| # | quantized tensor | reads | scale | propagated max / count | local max / count | size |",
                 "|---|---|---|---|---|---|---|"]
        for r in self.rows:
            if only_divergent and not (r.propagated_count or r.local_count):
                continue
            lines.append(f"| {r.order} | {r.name} | {r.source} | {r.scale:.4g} | {r.propagated_max} / "
                         f"{r.propagated_count} | {r.local_max} / {r.local_count} | {r.size} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        first = self.first_local
        where = f"first at #{first.order} {first.name} (reads {first.source})" if first else "none"
        worst = max(self.rows, key=lambda r: r.propagated_max, default=None)
        prop = f"{worst.propagated_max} steps at #{worst.order} {worst.name}" if worst else "n/a"
        return (f"{len(self.rows)} quantized tensors; local (file arithmetic): max {self.max_local} step(s) on "
                f"{self.n_local} element(s), {where}; propagated: max {prop}")


def _file_quantizers(model: onnx.ModelProto) -> list[tuple[str, str, float, int]]:
    """(output, input, scale, zero-point) of every per-tensor QuantizeLinear, in graph order."""
    values = constant_values(model)
    found = []
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear":
            continue
        scale = values.get(node.input[1])
        zero = values.get(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
        if scale is None or zero is None or scale.size != 1:
            continue  # a per-channel or computed scale: not an activation quantizer of a pt2e file
        found.append((node.output[0], node.input[0], float(scale.reshape(())), int(zero.reshape(()))))
    return found


def _file_integers(model: onnx.ModelProto, names: list[str], inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The file's quantized tensors ``names``, read by ONNX Runtime with optimizations off."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in present)
    session = ort_session(probe)
    outs = dict(zip([o.name for o in session.get_outputs()], run_session(session, inputs)))
    return {n: outs[n] for n in names}


def _torch_quantizers(graph_module: Any) -> list:
    import torch

    qd = torch.ops.quantized_decomposed
    targets = {qd.quantize_per_tensor.default, qd.quantize_per_tensor.tensor}
    return [n for n in graph_module.graph.nodes if n.op == "call_function" and n.target in targets]


def _node_float(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


def _run_torch(graph_module: Any, inputs: tuple, quantizers: list, forced: dict | None) -> dict:
    """Integers of every quantize node (relative to its zero-point); ``forced`` replaces each with the file's."""
    import torch

    seen: dict = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            if node in seen or node not in index:
                return result
            zero = int(_node_float(self.env[node.args[2]] if isinstance(node.args[2], torch.fx.Node)
                                   else node.args[2]))
            seen[node] = result.detach().cpu().numpy().astype(np.int64) - zero
            if forced is not None:
                result = torch.from_numpy(forced[node] + zero).to(result.dtype)
            return result

    index = set(quantizers)
    with torch.no_grad():
        Recorder(graph_module).run(*inputs)
    return seen


def trace_divergence(model: Any, path: str | Path, sample: Any) -> DivergenceReport:
    """Compare every quantized tensor of the file at ``path`` with the pt2e ``model`` it came from, on ``sample``.

    ``model``: the converted pt2e ``GraphModule`` (``Quantizer.quantize``'s result); ``sample``: a
    tensor or a tuple of tensors at the file's batch size. The quantizers are paired by position
    and must agree in scale; a file that does not pair up with the model is refused.
    """
    import torch

    if not isinstance(model, torch.fx.GraphModule):
        raise ValueError(f"trace_divergence reads a pt2e-converted GraphModule, got {type(model).__name__}; "
                         "pass the model Quantizer(backend='pt2e').quantize returned")
    proto = onnx.load(str(path))
    file_q = _file_quantizers(proto)
    torch_q = _torch_quantizers(model)
    if len(file_q) < len(torch_q):  # the exporter merges identical subgraphs (Swin's patch-merge slices): so do we
        from torch.fx.passes.dialect.common.cse_pass import CSEPass

        model = CSEPass()(copy.deepcopy(model)).graph_module
        torch_q = _torch_quantizers(model)
    if len(file_q) != len(torch_q):
        raise ValueError(f"{path} has {len(file_q)} per-tensor QuantizeLinear nodes, the model {len(torch_q)} "
                         "quantize_per_tensor nodes: the file was not exported from this model")
    for (name, _, scale, _), node in zip(file_q, torch_q):
        theirs = _node_float(node.args[1]) if not isinstance(node.args[1], torch.fx.Node) else None
        if theirs is not None and abs(theirs - scale) > _SCALE_RTOL * abs(theirs):
            raise ValueError(f"{path}: QuantizeLinear {name!r} has scale {scale:.8g}, the model's quantizer at the "
                             f"same position {node.name!r} has {theirs:.8g}: the file was not exported from this model")
    inputs = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
    arrays = [x.detach().cpu().numpy() for x in inputs]
    raw = _file_integers(proto, [q[0] for q in file_q], arrays)
    file_int = {node: raw[name].astype(np.int64) - zero for (name, _, _, zero), node in zip(file_q, torch_q)}
    free = _run_torch(model, inputs, torch_q, None)
    fed = _run_torch(model, inputs, torch_q, file_int)
    rows = []
    for order, ((name, source, scale, _), node) in enumerate(zip(file_q, torch_q)):
        propagated = np.abs(free[node] - file_int[node])
        local = np.abs(fed[node] - file_int[node])
        rows.append(LayerDivergence(order, name, source, scale, int(local.size), int(propagated.max(initial=0)),
                                    int(np.count_nonzero(propagated)), int(local.max(initial=0)),
                                    int(np.count_nonzero(local))))
    return DivergenceReport(rows)
