"""How fast a quantized file runs against its float reference on this CPU, and where its time goes.

INT8 exists to be faster, and ONNX Runtime's integer kernels are not faster everywhere (small channel
counts, Q/DQ and layout changes around them, a CPU without VNNI). ``measure_speed`` times both files with
the steady timer of ``timing`` (one thread, thread CPU time, interleaved rounds, median) at batch 1 and
the calibration batch (a fixed-batch file: its own), within a budget of a few seconds, and when the
INT8 file is slower at any batch, reads ONNX Runtime's profiler on both files at the worst batch:
per-node times of the optimized graphs, summed per node over a few runs, the slowest INT8 nodes named
with the file's node (and torch module, where the file records it) they came from.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quantship.inspect.read import external
from quantship.inspect.read.counts import COMPUTE_OPS
from quantship.inspect.read.float_ops import module_path
from quantship.inspect.run.consumers import cpu_info
from quantship.inspect.run.timing import int8_flags, median_ms, single_thread_session

BUDGET_SECONDS = 3.0  # CPU time the whole reading may take by default, profile included (sessions aside)
PROFILE_SHARE = 0.2  # of the budget, for the profile of a slower file
MIN_ROUNDS = 3  # a file whose one run eats the budget is still read on a median of 3
PROFILE_RUNS = (3, 20)  # profiled runs of each file (the first, a warm-up, is dropped)
TOP_NODES = 5
KERNEL_SUFFIX = "_kernel_time"  # ONNX Runtime's profiler: one event per node run, named NODE_kernel_time


@dataclass(frozen=True)
class NodeTime:
    """One node of ONNX Runtime's optimized INT8 graph, by its profiled time: mean ms per run, its share of
    the run's node time, the file's node it came from (before ORT's fusions; None: ORT's own, e.g. a
    layout Transpose), that node's torch module (where the file records it), and the float file's time for
    the node of the same name (None: no such node)."""

    node: str
    op_type: str
    ms: float
    share: float
    source: str | None = None
    module: str | None = None
    float_ms: float | None = None
    compute: bool = False  # its source is a compute op (Conv, MatMul, LSTM, ...): one that can be kept float

    def as_dict(self) -> dict:
        return {"node": self.node, "op_type": self.op_type, "ms": self.ms, "share": self.share,
                "source": self.source, "module": self.module, "float_ms": self.float_ms, "compute": self.compute}

    def describe(self) -> str:
        name = self.module or self.source or self.node
        vs = "" if self.float_ms is None else f", float {self.float_ms:.3g} ms"
        return f"{name} ({self.op_type} {self.ms:.3g} ms, {100 * self.share:.0f}%{vs})"


@dataclass(frozen=True)
class SpeedReading:
    """The INT8 file against its float reference on this CPU: ms per batch of each (medians), the rounds
    run, the CPU and its int8 flags; when slower, the slowest INT8 nodes (``profiled_batch``) and a hint of
    what would help (the caller's words: the flags differ by front-end). ``not_measured``: why no figure."""

    cpu: str
    flags: tuple[str, ...]
    batches: tuple[int, ...] = ()
    fp32_ms: dict[int, float] = field(default_factory=dict)
    int8_ms: dict[int, float] = field(default_factory=dict)
    rounds: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the whole reading
    slowest: tuple[NodeTime, ...] = ()
    profiled_batch: int | None = None
    hint: str = ""
    not_measured: str | None = None

    @property
    def speedup(self) -> dict[int, float]:
        """FP32 ms / INT8 ms, per batch."""
        return {b: self.fp32_ms[b] / self.int8_ms[b] for b in self.batches}

    @property
    def slower_at(self) -> tuple[int, ...]:
        """The batches at which the INT8 file ran slower than FP32."""
        return tuple(b for b, r in self.speedup.items() if r < 1.0)

    @property
    def slower(self) -> bool:
        return bool(self.slower_at)

    def keep_float_names(self) -> list[str]:
        """The slowest compute nodes by the names the quantizer takes (module, else file node), once each,
        except those that ran faster than their float form."""
        names: list[str] = []
        for n in self.slowest:
            name = n.module or n.source
            if n.compute and name and name not in names and (n.float_ms is None or n.ms > n.float_ms):
                names.append(name)
        return names

    def ratios(self) -> str:
        return " / ".join(f"{r:.2f}x" for r in self.speedup.values())

    def describe(self) -> str:
        if self.not_measured is not None:
            return f"not measured: {self.not_measured}"
        batches = " / ".join(f"b{b}" for b in self.batches)
        ms = " / ".join(f"{self.fp32_ms[b]:.3g} vs {self.int8_ms[b]:.3g} ms" for b in self.batches)
        return f"{self.ratios()} at {batches} (FP32 vs INT8: {ms}); {self.cpu_line()}"

    def cpu_line(self) -> str:
        return f"{self.cpu} ({', '.join(self.flags) or 'no avx2'})"

    def warning(self) -> str:
        """One line: how much slower, where the time goes, what would help."""
        at = " / ".join(f"b{b} {self.speedup[b]:.2f}x" for b in self.slower_at)
        where = "; slowest nodes: " + ", ".join(n.describe() for n in self.slowest[:3]) if self.slowest else ""
        return (f"the INT8 file runs slower than FP32 on this CPU (1 thread): {at}{where}"
                + (f"; {self.hint}" if self.hint else ""))

    def as_dict(self) -> dict:
        return {"cpu": self.cpu, "flags": list(self.flags), "batches": list(self.batches),
                "fp32_ms": {str(b): v for b, v in self.fp32_ms.items()},
                "int8_ms": {str(b): v for b, v in self.int8_ms.items()},
                "speedup": {str(b): v for b, v in self.speedup.items()}, "slower": self.slower,
                "rounds": {str(b): v for b, v in self.rounds.items()}, "seconds": self.seconds,
                "threads": 1, "clock": "thread CPU time, median of interleaved rounds",
                "slowest_nodes": [n.as_dict() for n in self.slowest], "profiled_batch": self.profiled_batch,
                "hint": self.hint or None, "not_measured": self.not_measured}

    def metadata(self) -> str:
        """The record as the file carries it (JSON, without the per-node table)."""
        return json.dumps({k: v for k, v in self.as_dict().items() if k != "slowest_nodes"}
                          | {"slowest_nodes": [n.describe() for n in self.slowest]}, sort_keys=True)


def unmeasured(reason: str) -> SpeedReading:
    """A reading that could not be made, saying why."""
    return SpeedReading(cpu_info()[0], int8_flags(), not_measured=reason)


def fixed_batch(session: Any) -> int | None:
    """The batch every input of ``session`` declares, None when any is symbolic."""
    dims = [i.shape[0] if i.shape else None for i in session.get_inputs()]
    fixed = {d for d in dims if isinstance(d, int) and d > 0}
    return fixed.pop() if len(fixed) == 1 and len(fixed) == len(set(dims)) else None


def measure_speed(int8_path: str | Path, float_path: str | Path, sample: Mapping[str, np.ndarray],
                  batches: Iterable[int], *, budget: float = BUDGET_SECONDS, top: int = TOP_NODES) -> SpeedReading:
    """Time ``int8_path`` against ``float_path`` (same inputs) at each of ``batches`` (a fixed-batch file:
    its own), feeding ``sample``'s first row of each input repeated; profile both when INT8 is slower."""
    started = time.perf_counter()
    int8, fp32 = single_thread_session(int8_path), single_thread_session(float_path)
    names = [i.name for i in int8.get_inputs()]
    if sorted(names) != sorted(i.name for i in fp32.get_inputs()) or set(names) - set(sample):
        raise ValueError(f"the INT8 file's inputs {names}, the float file's {[i.name for i in fp32.get_inputs()]} "
                         f"and the sample's {sorted(sample)} are not the same")
    fixed = fixed_batch(int8)
    sizes = (fixed,) if fixed else tuple(sorted(set(batches)))
    feeds = {b: {n: np.ascontiguousarray(np.repeat(np.asarray(sample[n])[:1], b, axis=0)) for n in names}
             for b in sizes}
    per_session = budget * (1 - PROFILE_SHARE) / (2 * len(sizes))
    fp32_ms, int8_ms, rounds = {}, {}, {}
    for b, feed in feeds.items():
        (fp32_ms[b], int8_ms[b]), rounds[b] = median_ms([fp32, int8], feed, per_session, min_rounds=MIN_ROUNDS)
    reading = SpeedReading(cpu_info()[0], int8_flags(), sizes, fp32_ms, int8_ms, rounds)
    if reading.slower:
        worst = min(reading.slower_at, key=lambda b: reading.speedup[b])
        runs = int(np.clip(budget * PROFILE_SHARE / 2 / max(int8_ms[worst], fp32_ms[worst]) * 1e3, *PROFILE_RUNS))
        slowest = slowest_nodes(int8_path, float_path, feeds[worst], runs, top)
        reading = replace(reading, slowest=slowest, profiled_batch=worst)
    return replace(reading, seconds=time.perf_counter() - started)


def traced_nodes(path: str | Path, feed: Mapping[str, np.ndarray], runs: tuple[int, int], seconds: float = 0.0,
                 optimized_to: str | Path | None = None) -> dict[str, tuple[list[float], dict]]:
    """ONNX Runtime's profiler on ``path`` (one thread, default optimizations): each node of the optimized graph,
    its ms in every profiled run (the warm-up's first: a reader drops it) and its first event's ``args``. At least
    ``runs[0]`` runs after the warm-up, then more while they fit in ``seconds`` of CPU time, at most ``runs[1]``."""
    import onnxruntime as ort

    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # a run that fails raises, one line, without ORT's own log on stderr
    with tempfile.TemporaryDirectory(prefix="quantship-profile-") as folder:
        session = single_thread_session(path, profile_prefix=Path(folder) / "trace", optimized_to=optimized_to)
        session.run(None, dict(feed), quiet)
        start, done = time.thread_time(), 0
        while done < runs[0] or (done < runs[1] and time.thread_time() - start < seconds):
            session.run(None, dict(feed), quiet)
            done += 1
        events = json.loads(Path(session.end_profiling()).read_text())
    nodes: dict[str, tuple[list[float], dict]] = {}
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") != "Node" or not name.endswith(KERNEL_SUFFIX):
            continue
        nodes.setdefault(name[:-len(KERNEL_SUFFIX)], ([], e.get("args", {})))[0].append(float(e.get("dur", 0)) / 1e3)
    return nodes


def profile(path: str | Path, feed: Mapping[str, np.ndarray], runs: int) -> dict[str, tuple[str, float]]:
    """ONNX Runtime's profiler on ``path``: each node of the optimized graph, its op type and median ms per
    run over ``runs`` runs after a warm-up (dropped)."""
    return {n: (str(args.get("op_name", "?")), float(np.median(d[1:] or d)))
            for n, (d, args) in traced_nodes(path, feed, (runs, runs)).items()}


def sources(model: onnx.ModelProto) -> dict[str, str]:
    """Every name an optimized-graph node may be known by (a file node's name, or its output's: ORT names
    an NCHWc Conv OUTPUT_nchwc), mapped to the file node; a fused activation's names lead to the compute
    op before it (ORT runs Conv + Relu as one Conv)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    out: dict[str, str] = {}
    for n in model.graph.node:
        owner = n
        before = producer.get(n.input[0]) if n.input else None
        if n.op_type not in COMPUTE_OPS and before is not None and before.op_type in COMPUTE_OPS \
                and readers.get(n.input[0]) == 1:
            owner = before
        for name in (n.name, *n.output):
            if name:
                out.setdefault(name, owner.name)
    return out


def source_of(ort_name: str, names: Mapping[str, str]) -> str | None:
    """The file node an optimized-graph node came from (``sources``): the same name, or the longest name
    it extends (ORT names a fused node NAME_token_K, an NCHWc Conv OUTPUT_nchwc)."""
    if ort_name in names:
        return names[ort_name]
    found = [n for n in names if ort_name.startswith(n + "_")]
    return names[max(found, key=len)] if found else None


def slowest_nodes(int8_path: str | Path, float_path: str | Path, feed: Mapping[str, np.ndarray], runs: int,
                  top: int = TOP_NODES) -> tuple[NodeTime, ...]:
    """The ``top`` slowest nodes of the INT8 file's optimized graph, with where each came from and the
    float file's time for its source node."""
    int8_model = external.graph_without_weights(int8_path)
    int8_nodes, int8_names = {n.name: n for n in int8_model.graph.node}, sources(int8_model)
    float_names = sources(external.graph_without_weights(float_path))
    int8, fp32 = profile(int8_path, feed, runs), profile(float_path, feed, runs)
    float_by_source: dict[str, float] = {}
    for name, (_, ms) in fp32.items():
        source = source_of(name, float_names)
        if source is not None:
            float_by_source[source] = float_by_source.get(source, 0.0) + ms
    total = sum(ms for _, ms in int8.values()) or 1.0
    out = []
    for name, (op_type, ms) in sorted(int8.items(), key=lambda kv: -kv[1][1])[:top]:
        source = source_of(name, int8_names)
        node = int8_nodes.get(source) if source is not None else None
        compute = node is not None and node.op_type in COMPUTE_OPS
        out.append(NodeTime(name, op_type, ms, ms / total, source, module_path(node) or None if node else None,
                            float_by_source.get(source), compute))
    return tuple(out)
