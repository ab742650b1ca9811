"""Placement by profile, the default for ONNX Runtime targets: which weighted ops to keep float on this CPU,
read from one profiled run of the float file and one of the plain INT8 file at each batch, then verified
once by timing the whole file.

``inspect.run.node_costs`` charges each run's time to the weighted nodes: in the INT8 file a node's
integer kernel with the Q/DQ and layout nodes ORT runs around it, in the float file its float kernel. A
node kept float must cross back to the integer path where a weighted neighbour stays integer: a
DequantizeLinear on its input, a QuantizeLinear and a layout change on its output, priced as those nodes
cost in the INT8 run: a fixed part per node and a part per element (``node_costs.fixed_and_per_element``). Adjacent candidates share their crossings (a stem of small Convs
kept float together crosses once), so the candidates are found as a fixed point: every node whose
integer cost exceeds its float kernel's, then, until nothing changes, only those whose integer cost
still exceeds their float cost with the crossings the current set leaves them (geometric mean over the
batches, and by more than the profiler's clock can tell: ``MIN_SAVING_MS``). A crossing into a pool or
concat that stays integer is priced, not predicted: what the whole file does with it is what the
verification reads.

The candidates are kept float in one more file, which must keep the fidelity budget; it is timed side by
side with the plain file (``speed_gate.time_files``: one thread, CPU time, interleaved) and chosen only when
``speed_gate.faster`` (the search's rule) says so; otherwise the plain file stays. A profile that cannot run
leaves the plain file, said so.

A chosen set then grows along its run (``next_along_run``, at most ``GROW_STEPS`` more files): the weighted
neighbour of the set whose integer kernel the profile read as slower than its float one (by any margin: on a model of a few
microseconds per node, below what the estimate can tell) is kept float too, one at a time, each file timed
against the best so far by the same rule, until one is not faster or only one weighted op would stay integer.
The estimate of a crossing is what this measures: keeping a run float moves its crossings to the run's ends,
and a pool between two float Convs leaves the integer path with them (MTCNN PNet: its first Conv alone kept
float, 0.82x FP32; with the second, a MaxPool between them, 0.92x; the crossing estimate said no).
"""

from __future__ import annotations

import glob
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quantship.errors import QuantshipError, one_line
from quantship.export.speed_gate import SEARCH_KEY, faster, time_files
from quantship.fidelity import missed
from quantship.inspect.read import external
from quantship.inspect.run.node_costs import run_costs
from quantship.inspect.run.timing import cpu_line

PROFILE_SECONDS = 0.5  # CPU time each file is profiled for, at each batch
VERIFY_SECONDS = 0.4  # CPU time per file and batch in the one verification (the speed search's per step)
MIN_SAVING_MS = 0.01  # per batch: ten steps of the profiler's 1 us clock; a smaller difference is not read
GROW_STEPS = 3  # files a chosen set may grow by along its run (module docstring)


@dataclass(frozen=True)
class NodeCost:
    """One weighted node, per batch: its integer cost (kernel + its Q/DQ and layout share) in the plain INT8
    file, its float kernel's cost in the float file, and the elements it reads and writes there."""

    node: str
    int_ms: dict[int, float]
    float_ms: dict[int, float]
    in_elements: dict[int, int]
    out_elements: dict[int, int]

    def as_dict(self) -> dict:
        return {"node": self.node, "int_ms": _keyed(self.int_ms), "float_ms": _keyed(self.float_ms),
                "in_elements": _keyed(self.in_elements), "out_elements": _keyed(self.out_elements)}


@dataclass
class ProfilePlacement:
    """What the profile read, what it kept float, and the one verification's reading."""

    cpu: str
    batches: tuple[int, ...]
    costs: list[NodeCost] = field(default_factory=list)
    crossing_ns: dict[int, float] = field(default_factory=dict)  # ns per element to enter or leave the integer path
    crossing_fixed_ms: dict[int, float] = field(default_factory=dict)  # and ms per crossing whatever its size
    candidates: tuple[str, ...] = ()
    estimated_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # candidate -> its float cost, crossings
    verified_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # "plain" / "profile" -> batch -> ms
    chosen: bool = False
    not_run: str | None = None  # why the plain file stays without a verification
    # PyTorch path: candidate node -> the module, or the op where its module holds others, kept float
    modules: dict[str, str] = field(default_factory=dict)
    grown: tuple[str, ...] = ()  # kept float after the candidates, each verified faster (``grow``)
    grown_ms: list[dict[str, dict[int, float]]] = field(default_factory=list)  # each growth step's timing

    @property
    def kept_float(self) -> tuple[str, ...]:
        """The weighted ops the written file keeps float for speed."""
        return (*self.candidates, *self.grown) if self.chosen else ()

    @property
    def kept_modules(self) -> list[str]:
        """The modules (or ops) the written file keeps float for speed (PyTorch path; empty on the ONNX path)."""
        return sorted({self.modules[n] for n in self.kept_float if n in self.modules})

    @property
    def gain(self) -> dict[int, float]:
        """Plain ms / profile ms per batch: the verification's, times each kept growth step's."""
        if not self.verified_ms:
            return {}
        gain = {b: self.verified_ms["plain"][b] / self.verified_ms["profile"][b] for b in self.verified_ms["plain"]}
        for step in self.grown_ms[:len(self.grown)]:
            gain = {b: g * step["before"][b] / step["grown"][b] for b, g in gain.items()}
        return gain

    def _named(self, node: str) -> str:
        """A node by the name ``--exclude`` takes when the PyTorch path recorded one (a module, or an op), else by
        its own."""
        return f"{self.modules[node]} ({node})" if node in self.modules else node

    def why(self) -> str:
        """Each op kept float by its full name and its measured per-node ms at the largest batch."""
        b = max(self.batches)
        by = {c.node: c for c in self.costs}
        said = [f"{self._named(n)}: integer {by[n].int_ms[b]:.3g} ms vs float {by[n].float_ms[b]:.3g} ms + "
                f"{self.estimated_ms[n][b] - by[n].float_ms[b]:.3g} ms to cross at b{b}" for n in self.candidates]
        said += [f"{self._named(n)}: integer {by[n].int_ms[b]:.3g} ms vs float {by[n].float_ms[b]:.3g} ms, kept "
                 "float with its neighbour, the file verified faster" for n in self.grown]
        return "; ".join(said)

    def describe(self) -> str:
        if self.not_run is not None:
            return f"plain placement: {self.not_run}"
        ratios = " / ".join(f"b{b} {g:.2f}x" for b, g in self.gain.items())
        if self.chosen:
            grown = f", {len(self.grown)} of them grown along the run" if self.grown else ""
            return (f"{len(self.kept_float)} weighted op(s) kept float for speed{grown} ({self.why()}); verified: "
                    f"{ratios} the plain file's speed (1 thread, CPU time); {self.cpu}")
        return (f"plain placement: keeping {', '.join(self.candidates)} float ran {ratios} the plain file's speed "
                f"(not faster by the search's rule); {self.cpu}")

    def as_dict(self) -> dict:
        return {"method": "profile", "cpu": self.cpu, "batches": list(self.batches),
                "nodes": [c.as_dict() for c in self.costs], "crossing_ns_per_element": _keyed(self.crossing_ns),
                "crossing_fixed_ms": _keyed(self.crossing_fixed_ms),
                "candidates": list(self.candidates), "grown": list(self.grown), "kept_float": list(self.kept_float),
                "grown_ms": [{k: _keyed(v) for k, v in step.items()} for step in self.grown_ms],
                "estimated_float_ms": {n: _keyed(v) for n, v in self.estimated_ms.items()},
                "verified_ms": {k: _keyed(v) for k, v in self.verified_ms.items()},
                "gain_vs_plain": _keyed(self.gain), "chosen": self.chosen, "not_run": self.not_run,
                **({"kept_float_modules": self.kept_modules} if self.modules else {})}

    def metadata(self) -> dict[str, str]:
        """The file's record (``speed.SEARCH_KEY``): what was kept float, why, and the verification."""
        record = {k: v for k, v in self.as_dict().items() if k != "nodes"} | {"why": self.why() if self.candidates
                                                                                 else None}
        return {SEARCH_KEY: json.dumps(record, sort_keys=True)}


def _keyed(d: Mapping[int, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in d.items()}


def neighbours(model: onnx.ModelProto, weighted: Iterable[str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """For each weighted node of ``model`` (by name): the weighted nodes it reads from and those that read it,
    through any number of other nodes (Q/DQ, pools, concats, activations)."""
    names = set(weighted)
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def walk(start: list, step: Callable[[Any], list]) -> set[str]:
        found, seen, todo = set(), {id(n) for n in start}, list(start)
        while todo:
            for nxt in step(todo.pop()):
                if id(nxt) in seen:
                    continue
                seen.add(id(nxt))
                if nxt.name in names:
                    found.add(nxt.name)
                else:
                    todo.append(nxt)
        return found

    after, before = {}, {}
    for node in model.graph.node:
        if node.name in names:
            after[node.name] = walk([node], lambda n: [r for o in n.output for r in readers.get(o, ())])
            before[node.name] = walk([node], lambda n: [producer[i] for i in n.input if i in producer])
    return before, after


def slower_as_integer(c: NodeCost, float_ms: Mapping[int, float]) -> bool:
    """``c``'s integer cost above ``float_ms`` at the geometric mean over the batches (a batch either side of 0 ms
    is not read)."""
    logs = [math.log(c.int_ms[b] / float_ms[b]) for b in float_ms if float_ms[b] > 0 and c.int_ms[b] > 0]
    return bool(logs) and sum(logs) > 0


def choose(costs: Iterable[NodeCost], crossing_ns: Mapping[int, float], before: Mapping[str, set[str]],
           after: Mapping[str, set[str]], crossing_fixed_ms: Mapping[int, float] | None = None
           ) -> tuple[tuple[str, ...], dict[str, dict[int, float]]]:
    """The candidates (module docstring's fixed point), in the order given, and each one's estimated float
    cost with the crossings the set leaves it: each crossing ``crossing_fixed_ms`` plus ``crossing_ns`` per
    element (per batch)."""
    costs = list(costs)
    fixed = crossing_fixed_ms or {}

    def float_cost(c: NodeCost, kept: set[str]) -> dict[int, float]:
        enters = bool(before.get(c.node, set()) - kept)
        leaves = bool(after.get(c.node, set()) - kept)
        return {b: c.float_ms[b] + (enters + leaves) * fixed.get(b, 0.0)
                + (enters * c.in_elements[b] + leaves * c.out_elements[b]) * crossing_ns[b] / 1e6
                for b in c.float_ms}

    def loses(c: NodeCost, float_ms: Mapping[int, float]) -> bool:
        saving = sum(c.int_ms[b] - float_ms[b] for b in float_ms)
        return slower_as_integer(c, float_ms) and saving > MIN_SAVING_MS * len(float_ms)

    kept = {c.node for c in costs if loses(c, c.float_ms)}
    while True:
        still = {c.node for c in costs if c.node in kept and loses(c, float_cost(c, kept))}
        if still == kept:
            break
        kept = still
    return tuple(c.node for c in costs if c.node in kept), {c.node: float_cost(c, kept) for c in costs
                                                           if c.node in kept}


def least_loss(candidates: tuple[str, ...], estimated_ms: Mapping[str, Mapping[int, float]],
               costs: Iterable[NodeCost], weighted: Iterable[str]) -> str | None:
    """When ``candidates`` cover every weighted op (a file with nothing integer left is no INT8 file: the
    quantizer refuses it), the one whose integer cost loses least to its float cost (the geometric mean of the
    ratios, as ``choose`` reads a loss): the fastest INT8 file here keeps it integer. None otherwise."""
    if not candidates or set(weighted) - set(candidates):
        return None
    by = {c.node: c for c in costs}
    loss = {n: math.fsum(math.log(max(by[n].int_ms[b], 1e-9) / max(estimated_ms[n][b], 1e-9)) for b in estimated_ms[n])
            for n in candidates}
    return min(candidates, key=lambda n: loss[n])


def profile_costs(float_path: Path, int8_path: Path, weighted: list[str], feeds: Mapping[int, Mapping[str, np.ndarray]],
                  seconds: float = PROFILE_SECONDS
                  ) -> tuple[list[NodeCost], dict[int, float], dict[int, float]]:
    """Each weighted node's integer and float cost per batch (nodes the float run does not name are left
    out), and the price of a crossing per batch: ns per element, and ms per crossing."""
    per_batch = {b: (run_costs(int8_path, feed, seconds, weighted), run_costs(float_path, feed, seconds, weighted))
                 for b, feed in feeds.items()}
    crossing = {b: (i.qdq_ns_per_element or 0.0) + (i.layout_ns_per_element or 0.0) for b, (i, _) in per_batch.items()}
    fixed = {b: i.qdq_fixed_ms + i.layout_fixed_ms for b, (i, _) in per_batch.items()}
    out = []
    for node in weighted:
        if all(node in i.weighted and node in f.weighted for i, f in per_batch.values()):
            out.append(NodeCost(node, {b: i.weighted[node].ms for b, (i, _) in per_batch.items()},
                                {b: f.weighted[node].ms for b, (_, f) in per_batch.items()},
                                {b: f.weighted[node].in_elements for b, (_, f) in per_batch.items()},
                                {b: f.weighted[node].out_elements for b, (_, f) in per_batch.items()}))
    return out, crossing, fixed


def place_by_profile(float_path: Path, plain: Any, feeds: Mapping[int, Mapping[str, np.ndarray]],
                     requantize: Callable[[tuple[str, ...]], Any], *, seconds: float = PROFILE_SECONDS,
                     verify_seconds: float = VERIFY_SECONDS, log: Callable[[str], None] = lambda _: None,
                     modules: Mapping[str, str] | None = None) -> tuple[Any, ProfilePlacement]:
    """The plain file (``plain``, an ``OnnxQuantizeResult``) or the one ``requantize(names)`` writes with the
    profile's candidates kept float by ``glob``-escaped name, whichever the module docstring's rules choose;
    returns it and the record. ``modules``: each node's module (the PyTorch path), named beside it."""
    record = ProfilePlacement(cpu_line(), tuple(feeds))
    weighted = list(plain.plan["weighted_nodes"])
    try:
        record.costs, record.crossing_ns, record.crossing_fixed_ms = profile_costs(float_path, plain.path, weighted,
                                                                                 feeds, seconds)
        before, after = neighbours(external.graph_without_weights(plain.path), weighted)
    except Exception as exc:  # ORT's own types, a trace it could not write: the plain file stays, said so
        record.not_run = f"the profile could not run ({one_line(exc)})"
        return plain, record
    record.candidates, record.estimated_ms = choose(record.costs, record.crossing_ns, before, after,
                                                    record.crossing_fixed_ms)
    least = least_loss(record.candidates, record.estimated_ms, record.costs, weighted)
    if least is not None:  # every weighted op float is no INT8 file: the one that loses least stays integer
        record.candidates, record.estimated_ms = choose([c for c in record.costs if c.node != least],
                                                        record.crossing_ns, before, after, record.crossing_fixed_ms)
    record.modules = {n: modules[n] for n in record.candidates if n in modules} if modules else {}
    if not record.candidates:
        record.not_run = f"no weighted op of {len(record.costs)} profiled costs more as an integer kernel here"
        return plain, record
    log(f"placement by profile: {len(record.candidates)} weighted op(s) cost more as integer kernels: {record.why()}")
    try:
        trial = requantize(tuple(glob.escape(n) for n in record.candidates))
    except QuantshipError as exc:
        record.not_run = f"keeping {', '.join(record.candidates)} float gives no file ({one_line(exc)})"
        return plain, record
    if missed(trial.fp32):
        record.not_run = f"keeping {', '.join(record.candidates)} float misses the fidelity budget"
        return plain, record
    plain_ms, trial_ms = time_files([Path(plain.path), Path(trial.path)], dict(feeds), verify_seconds)
    record.verified_ms = {"plain": plain_ms, "profile": trial_ms}
    record.chosen = faster(trial_ms, plain_ms)
    if record.chosen:
        trial = _grow(record, trial, before, after, weighted, feeds, requantize, verify_seconds, log)
    record.modules |= {n: modules[n] for n in record.grown if n in modules} if modules else {}
    log(f"placement by profile: {record.describe()}")
    return (trial if record.chosen else plain), record


def next_along_run(costs: Iterable[NodeCost], kept: Iterable[str], before: Mapping[str, set[str]],
                   after: Mapping[str, set[str]]) -> str | None:
    """The weighted neighbour of ``kept`` whose integer kernel the profile read as slower than its float one
    (geometric mean over the batches, as ``choose`` reads a loss, with no floor), the largest saving first (None
    when there is none)."""
    kept = set(kept)
    near = set().union(*(before.get(n, set()) | after.get(n, set()) for n in kept)) - kept if kept else set()
    losing = [(sum(c.int_ms[b] - c.float_ms[b] for b in c.float_ms), c.node) for c in costs
              if c.node in near and slower_as_integer(c, c.float_ms)]
    return max(losing)[1] if losing else None


def _grow(record: ProfilePlacement, best: Any, before: Mapping[str, set[str]], after: Mapping[str, set[str]],
          weighted: list[str], feeds: Mapping[int, Mapping[str, np.ndarray]],
          requantize: Callable[[tuple[str, ...]], Any], seconds: float, log: Callable[[str], None]) -> Any:
    """The chosen file grown along its run (module docstring): ``record.grown`` and the best file."""
    for _ in range(GROW_STEPS):
        node = next_along_run(record.costs, record.kept_float, before, after)
        if node is None or len(record.kept_float) + 1 >= len(weighted):
            break
        try:
            grown = requantize(tuple(glob.escape(n) for n in (*record.kept_float, node)))
        except QuantshipError:
            break
        if missed(grown.fp32):
            break
        best_ms, grown_ms = time_files([Path(best.path), Path(grown.path)], dict(feeds), seconds)
        record.grown_ms.append({"before": best_ms, "grown": grown_ms})
        if not faster(grown_ms, best_ms):
            break
        log(f"placement by profile: {record._named(node)} kept float too, with its neighbour: faster")
        record.grown, best = (*record.grown, node), grown
    return best
