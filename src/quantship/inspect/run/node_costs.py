"""Where one run's time goes, by weighted node of the file: ONNX Runtime's profiler on the optimized graph,
each kernel charged to the file's node it came from, and the Q/DQ and layout nodes ORT runs around an
integer kernel charged to the weighted node they feed (else the one that feeds them).

What a placement by profile compares: a weighted node's integer cost (its kernel, the QuantizeLinear,
DequantizeLinear, Transpose and Reorder nodes around it) against its float cost in the float file (its
NCHWc kernel and Reorders), both read at ONNX Runtime's default optimizations on one thread.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from quantship.inspect.read import external
from quantship.inspect.read.counts import COMPUTE_OPS
from quantship.inspect.run.speed import source_of, sources, traced_nodes

RUNS = (3, 20)  # profiled runs of a file, at least and at most (a warm-up before, dropped)
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
LAYOUT_OPS = ("Transpose", "ReorderInput", "ReorderOutput")  # what ORT adds to move between NCHW, NHWC, NCHWc


@dataclass(frozen=True)
class Kernel:
    """One node of the optimized graph as profiled: median ms per run, the element counts of its first
    input and first output, its input and output tensors."""

    name: str
    op_type: str
    ms: float
    in_elements: int
    out_elements: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class WeightedCost:
    """A weighted node's share of one run: its kernels' ms, the Q/DQ and layout ms charged to it, the
    element counts of its input and output (as its kernel reads and writes them)."""

    node: str
    kernel_ms: float = 0.0
    qdq_ms: float = 0.0
    layout_ms: float = 0.0
    in_elements: int = 0
    out_elements: int = 0

    @property
    def ms(self) -> float:
        return self.kernel_ms + self.qdq_ms + self.layout_ms


@dataclass(frozen=True)
class RunCosts:
    """One profiled run of a file: each weighted node's cost, the whole run's node time, and what a
    QuantizeLinear/DequantizeLinear and a layout node cost in it: a fixed part per node (the cheapest such
    node's time: what running one costs whatever its size) and a part per element beyond it (None: none ran).
    On a small input the fixed part dominates; priced per element alone, a crossing of a few hundred
    elements would be charged as if each cost what the whole node did."""

    weighted: dict[str, WeightedCost]
    total_ms: float
    qdq_ns_per_element: float | None
    layout_ns_per_element: float | None
    qdq_fixed_ms: float = 0.0
    layout_fixed_ms: float = 0.0


def fixed_and_per_element(kernels: Iterable[tuple[float, int]]) -> tuple[float, float | None]:
    """(ms per node, ns per element beyond it) of nodes given as (ms, elements): the cheapest node's ms is the
    fixed part, what each spends beyond it is spread over the elements."""
    kernels = list(kernels)
    if not kernels:
        return 0.0, None
    fixed = min(ms for ms, _ in kernels)
    elements = sum(n for _, n in kernels)
    return fixed, (sum(ms - fixed for ms, _ in kernels) * 1e6 / elements if elements else 0.0)


def _elements(shapes: object) -> int:
    if not isinstance(shapes, list) or not shapes or not isinstance(shapes[0], dict):
        return 0
    dims = next(iter(shapes[0].values()), [])
    return int(np.prod(dims)) if dims else 1


def profiled_kernels(path: str | Path, feed: Mapping[str, np.ndarray], seconds: float) -> list[Kernel]:
    """ONNX Runtime's profiler on ``path`` (one thread, default optimizations): each node of the optimized
    graph, median ms over the runs that fit in ``seconds`` of CPU time (within ``RUNS``) after a warm-up
    (dropped), with its tensors as the graph names them."""
    with tempfile.TemporaryDirectory(prefix="quantship-optimized-") as folder:
        optimized = Path(folder) / "optimized.onnx"
        traced = traced_nodes(path, feed, RUNS, seconds, optimized_to=optimized)
        graph = external.graph_without_weights(optimized).graph
    wiring = {n.name: (tuple(n.input), tuple(n.output)) for n in graph.node}
    out = []
    for name, (durations, args) in traced.items():
        ins, outs = wiring.get(name, ((), ()))
        out.append(Kernel(name, str(args.get("op_name", "?")), float(np.median(durations[1:] or durations)),
                          _elements(args.get("input_type_shape")), _elements(args.get("output_type_shape")),
                          ins, outs))
    if not out:
        raise RuntimeError(f"ONNX Runtime's profiler recorded no node of {Path(path).name}")
    return out


def owners(model: onnx.ModelProto) -> dict[str, str]:
    """``inspect.run.speed.sources``, with chains followed: a node that reads only its producer's output (its
    other inputs constants), alone, belongs to that producer's weighted node (a Conv's BatchNormalization
    and HardSwish, which ORT fuses into the float Conv and runs beside the integer one)."""
    names = sources(model)
    constant = {t.name for t in model.graph.initializer} | {o for n in model.graph.node if n.op_type == "Constant"
                                                           for o in n.output}
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    owner: dict[int, onnx.NodeProto] = {}
    for n in model.graph.node:  # graph order: a producer's owner is known before its readers'
        before = producer.get(n.input[0]) if n.input else None
        mine = n
        if (n.op_type not in COMPUTE_OPS and before is not None and readers.get(n.input[0]) == 1
                and all(not i or i in constant for i in n.input[1:])):
            upstream = owner.get(id(before), before)
            mine = upstream if upstream.op_type in COMPUTE_OPS else n
        owner[id(n)] = mine
        for name in (n.name, *n.output):
            if name and mine is not n:
                names[name] = mine.name
    return names


def _glue(kernel: Kernel, source: str | None, file_ops: Mapping[str, str]) -> bool:
    """A node ORT runs to enter or leave an integer kernel or a blocked layout, not one of the model's own."""
    if kernel.op_type in QDQ_OPS:
        return True
    return kernel.op_type in LAYOUT_OPS and (source is None or file_ops.get(source) in QDQ_OPS)


def run_costs(path: str | Path, feed: Mapping[str, np.ndarray], seconds: float, weighted: Iterable[str]) -> RunCosts:
    """Profile ``path`` on ``feed`` and charge the time to the file's ``weighted`` nodes (module docstring)."""
    wanted = set(weighted)
    model = external.graph_without_weights(path)
    names, sources_of_file = owners(model), sources(model)
    file_ops = {n.name: n.op_type for n in model.graph.node}
    del model
    kernels = profiled_kernels(path, feed, seconds)
    by_name = {k.name: k for k in kernels}
    owner = {k.name: source_of(k.name, names) for k in kernels}
    producer = {t: k.name for k in kernels for t in k.outputs}
    readers: dict[str, list[str]] = {}
    for k in kernels:
        for t in k.inputs:
            readers.setdefault(t, []).append(k.name)
    glue = {k.name for k in kernels if _glue(k, source_of(k.name, sources_of_file), file_ops)}

    def charged(name: str) -> str | None:
        for step in (lambda n: [r for t in by_name[n].outputs for r in readers.get(t, ())],
                     lambda n: [producer[t] for t in by_name[n].inputs[:1] if t in producer]):
            seen, todo = {name}, [name]
            while todo:
                for nxt in step(todo.pop(0)):
                    if nxt in seen:
                        continue
                    seen.add(nxt)
                    if owner[nxt] in wanted:
                        return owner[nxt]
                    if nxt in glue:
                        todo.append(nxt)
        return None

    costs: dict[str, dict] = {}
    qdq: list[tuple[float, int]] = []
    layout: list[tuple[float, int]] = []
    for k in kernels:
        if k.name in glue:
            (qdq if k.op_type in QDQ_OPS else layout).append((k.ms, k.in_elements))
            node = owner[k.name] if owner[k.name] in wanted else charged(k.name)
            key = "qdq_ms" if k.op_type in QDQ_OPS else "layout_ms"
        else:
            node, key = owner[k.name], "kernel_ms"
        if node not in wanted:
            continue
        c = costs.setdefault(node, {"kernel_ms": 0.0, "qdq_ms": 0.0, "layout_ms": 0.0})
        c[key] += k.ms
        if key == "kernel_ms" and "in_elements" not in c:
            c["in_elements"], c["out_elements"] = k.in_elements, k.out_elements
    (qdq_fixed, qdq_ns), (layout_fixed, layout_ns) = fixed_and_per_element(qdq), fixed_and_per_element(layout)
    return RunCosts({n: WeightedCost(n, **c) for n, c in costs.items()}, sum(k.ms for k in kernels),
                    qdq_ns, layout_ns, qdq_fixed, layout_fixed)
