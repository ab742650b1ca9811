"""Latency of a row's FP32 and INT8 files for bench/real.py: steady by default on a shared machine.

The steady method gives each ONNX Runtime session one intra-op and one inter-op thread, so every kernel runs on
the thread that calls ``run``, and times each run by that thread's CPU time (``time.thread_time()``): time spent
waiting for a core another process holds is not counted, so the figure holds under load where wall time spreads
2-10x. The files run in turn, round after round (a change in the machine reaches all of them alike), for a
number of rounds chosen from a probe round; each file's figure is the median. The older method (default
threads, wall time, a fixed count) stays for ``--wall-threads``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from quantship.inspect import single_thread_session

STEADY = "1 thread, CPU time"
WALL = "default threads, wall time"


@dataclass(frozen=True)
class Rounds:
    """How many interleaved rounds to time: enough for ``target_s`` of timing per file (from a probe round),
    within ``least``..``most``, and never more than ``budget_s`` in all (at least ``least_slow`` rounds)."""

    target_s: float = 0.75
    least: int = 10
    most: int = 3000
    budget_s: float = 40.0
    least_slow: int = 3

    def count(self, probe_s: list[float]) -> int:
        per_file = statistics.fmean(probe_s)
        wanted = math.ceil(self.target_s / per_file) if per_file > 0 else self.most
        rounds = min(max(wanted, self.least), self.most)
        affordable = math.floor(self.budget_s / sum(probe_s)) if sum(probe_s) > 0 else rounds
        return max(min(rounds, affordable), min(self.least_slow, rounds))


DEFAULT_ROUNDS = Rounds()
SMOKE_ROUNDS = Rounds(target_s=0.0, least=1, most=1, least_slow=1)


@dataclass(frozen=True)
class Timing:
    """Each session's median ms over ``rounds`` interleaved runs, and the samples it is the median of."""

    median_ms: list[float]
    rounds: int
    samples_ms: list[list[float]]


def session(path: Path | str, threads: int | None = 1):
    """A CPU session at ONNX Runtime's default optimizations: one thread (quantship's timing session, what
    ``quantize-onnx --speed-search`` times with), or ``threads=None``: ORT's default thread counts."""
    if threads == 1:
        return single_thread_session(path)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads is not None:
        options.intra_op_num_threads = options.inter_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _run_once(sessions: list, feeds: list[dict], clock) -> list[float]:
    seconds = []
    for s, feed in zip(sessions, feeds):
        start = clock()
        s.run(None, feed)
        seconds.append(clock() - start)
    return seconds


def steady_ms(sessions: list, feed: np.ndarray, rounds: Rounds = DEFAULT_ROUNDS) -> Timing:
    """``sessions`` (one thread each, :func:`session`) on ``feed`` (their first input), timed by the calling
    thread's CPU time: one warm-up run each, one probe round that sets the count, then that many rounds."""
    feeds = [{s.get_inputs()[0].name: feed} for s in sessions]
    _run_once(sessions, feeds, time.thread_time)  # warm-up: allocations, the first kernels' set-up
    n = rounds.count(_run_once(sessions, feeds, time.thread_time))
    samples: list[list[float]] = [[] for _ in sessions]
    for _ in range(n):
        for i, seconds in enumerate(_run_once(sessions, feeds, time.thread_time)):
            samples[i].append(seconds * 1e3)
    return Timing([statistics.median(t) for t in samples], n, samples)


def wall_ms(sessions: list, feed: np.ndarray, n: int) -> Timing:
    """The older reading: wall time (``perf_counter``), sessions at default threads, ``n`` rounds after one
    warm-up run each."""
    feeds = [{s.get_inputs()[0].name: feed} for s in sessions]
    _run_once(sessions, feeds, time.perf_counter)
    samples: list[list[float]] = [[] for _ in sessions]
    for _ in range(n):
        for i, seconds in enumerate(_run_once(sessions, feeds, time.perf_counter)):
            samples[i].append(seconds * 1e3)
    return Timing([statistics.median(t) for t in samples], n, samples)


def latency(float_path: Path, int8_path: Path, x: np.ndarray, *, fixed_batch: int | None, method: str = STEADY,
            rounds: Rounds = DEFAULT_ROUNDS, wall_reps: tuple[int, int] = (20, 10)) -> tuple[dict, dict]:
    """(ms, rounds): "b1"/"b8" -> [FP32 ms, INT8 ms] (or why there is no figure) and -> the rounds timed,
    FP32 and INT8 interleaved, by ``method`` (:data:`STEADY` or :data:`WALL`)."""
    if method not in (STEADY, WALL):
        raise ValueError(f"latency method {method!r}: use {STEADY!r} or {WALL!r}")
    threads = 1 if method == STEADY else None
    sessions = [session(float_path, threads), session(int8_path, threads)]
    ms, counts = {}, {}
    for label, batch, reps in (("b1", 1, wall_reps[0]), ("b8", 8, wall_reps[1])):
        if fixed_batch is not None and fixed_batch != batch:
            ms[label] = f"the file has a static batch of {fixed_batch}"
            continue
        if len(x) < batch:
            ms[label] = f"fewer than {batch} samples"
            continue
        timing = steady_ms(sessions, x[:batch], rounds) if method == STEADY else wall_ms(sessions, x[:batch], reps)
        ms[label], counts[label] = timing.median_ms, timing.rounds
    return ms, counts
