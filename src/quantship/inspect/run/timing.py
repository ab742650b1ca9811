"""How long ONNX Runtime takes to run files, measured so that a shared machine does not move the ratios.

Each file gets a CPU session at ONNX Runtime's default optimizations (what ``InferenceSession(path)``
runs) with one intra-op and one inter-op thread, so every kernel runs on the calling thread and
``time.thread_time()`` around ``session.run`` is the CPU time of the whole run: another process on the
same cores stretches the wall clock, not that. The files run in turn, round after round (a change in
the machine reaches all of them alike), and each file's figure is the median over the rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from quantship.inspect.run.consumers import cpu_info

INT8_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")  # what the int8 kernels use
MIN_ROUNDS, MAX_ROUNDS = 5, 3000


def single_thread_session(path: str | Path, profile_prefix: str | Path | None = None,
                          optimized_to: str | Path | None = None):
    """A CPU session at ONNX Runtime's default optimizations, one intra-op and one inter-op thread;
    ``profile_prefix``: ONNX Runtime's profiler on, its trace written under that prefix; ``optimized_to``:
    the optimized graph it runs saved there (the names the profiler's events carry)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile_prefix)
    if optimized_to is not None:
        options.optimized_model_filepath = str(optimized_to)
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def int8_flags() -> tuple[str, ...]:
    """The int8-relevant flags (``INT8_FLAGS``) this CPU has, in that order."""
    _, flags = cpu_info()
    return tuple(f for f in INT8_FLAGS if f in flags)


def cpu_line() -> str:
    """This CPU's name and the int8-relevant flags it has (the figures hold for this CPU only)."""
    name, _ = cpu_info()
    return f"{name} ({', '.join(int8_flags()) or 'no avx2'})"


def median_ms(sessions: Sequence[Any], feed: Mapping[str, np.ndarray], seconds: float = 0.5,
              rounds: int | None = None, min_rounds: int = MIN_ROUNDS) -> tuple[list[float], int]:
    """The median ms of each session (``single_thread_session``) on ``feed`` (input name -> array),
    interleaved round by round (in turn reversed, so that no session always follows the same one and
    inherits its cache); ``rounds`` (else enough for about ``seconds`` of CPU time per session,
    within ``min_rounds``..MAX_ROUNDS: a lower bound keeps a large file within a budget). Returns the medians, in the order given, and the rounds run."""
    for s in sessions:  # warm-up: allocations, the first run's kernel choices
        s.run(None, dict(feed))
    if rounds is None:
        start = time.thread_time()
        for s in sessions:
            s.run(None, dict(feed))
        probe = max((time.thread_time() - start) / len(sessions), 1e-6)
        rounds = int(min(MAX_ROUNDS, max(min_rounds, seconds / probe)))
    times: list[list[float]] = [[] for _ in sessions]
    order = list(enumerate(sessions))
    for r in range(rounds):
        for k, s in order if r % 2 == 0 else order[::-1]:  # no file always runs right after the same one
            start = time.thread_time()
            s.run(None, dict(feed))
            times[k].append((time.thread_time() - start) * 1e3)
    return [statistics.median(t) for t in times], rounds
