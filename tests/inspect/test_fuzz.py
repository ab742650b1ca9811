"""A seeded, bounded fuzz of the readers: ~300 mutants of a small QDQ file through inspect_file,
check_file (static, four targets) and qdq_stats, in process. Every answer is a result or a
documented refusal (QuantshipError, FileNotFoundError); nothing else escapes, and --json stays strict."""

from __future__ import annotations

import time

from tests.inspect.fuzzing import run

N_FILES, SEED = 300, 15


def test_fuzzed_files_raise_only_documented_refusals(small_qdq, tmp_path):
    start = time.perf_counter()
    summary = run(small_qdq, N_FILES, SEED, tmp_path)
    assert summary["uncaught"] == 0, summary["examples"]
    assert summary["qdq_stats_vs_inspect_disagree"] == 0  # one reader: both read a file or both refuse it
    # the mutants reach past the loader: a fuzz that only feeds garbage to the parser proves little
    assert N_FILES * 0.15 < N_FILES - summary["refused_by_qdq_stats"] < N_FILES
    assert time.perf_counter() - start < 60
