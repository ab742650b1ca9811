"""Calibration in bounded memory and ``--max-memory`` (issue 40, item 2).

A file whose weights are in external data is quantized from a mapping of that data (not read whole) and
gives the same file as when read whole; calibration cut into slices and tensor groups gives the same
ranges; a budget below what one layer needs is refused in one line before anything is written; the
estimate the refusal uses is at least the peak a fresh process measures.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from quantship.errors import DataRefused
from quantship.inspect.read.feeds import as_feeds, model_inputs
from quantship.inspect.run import literal
from quantship.quantize_onnx import calibrate, memory, quantize_onnx_file
from tests.quantize_onnx import graphs

SRC = Path(__file__).resolve().parents[2] / "src"
WIDTH, TOKENS = 64, 6


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, TOKENS, WIDTH), dtype=np.float32)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> tuple[Path, Path]:
    """The same encoder block twice: one file, and a graph with every weight in one data file beside it."""
    folder = tmp_path_factory.mktemp("encoder")
    (folder / "whole").mkdir()
    whole = graphs.save(graphs.encoder_block(WIDTH, TOKENS), folder / "whole" / "float.onnx")
    (folder / "external").mkdir()
    external = folder / "external" / "float.onnx"
    onnx.save_model(onnx.load(str(whole)), str(external), save_as_external_data=True, location="float.onnx.data",
                    size_threshold=0)
    return whole, external


def test_a_file_with_external_data_is_mapped_and_gives_the_file_a_whole_read_gives(encoder, tmp_path):
    whole, external = encoder
    assert memory.is_mapped(external) and not memory.is_mapped(whole)
    before = _digest(external.parent)
    x = _tokens(16)
    outs = {}
    for name, source in (("whole", whole), ("mapped", external)):
        outs[name] = tmp_path / f"{name}.onnx"
        quantize_onnx_file(source, outs[name], x, target="onnxruntime-cpu", run_check=False)
    assert _digest(external.parent) == before  # the input and its data file untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mapped.onnx", "whole.onnx"]  # no data file beside them
    read = {name: onnx.load(str(path)) for name, path in outs.items()}
    stored = {name: {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer} for name, m in read.items()}
    assert stored["mapped"].keys() == stored["whole"].keys()
    for key, array in stored["whole"].items():  # the same weights, scales and zero-points, byte for byte
        assert array.dtype == stored["mapped"][key].dtype and np.array_equal(array, stored["mapped"][key]), key
    assert [n.op_type for n in read["whole"].graph.node] == [n.op_type for n in read["mapped"].graph.node]


def test_calibration_in_one_tensor_groups_and_one_row_slices_gives_the_same_ranges(encoder):
    whole, _ = encoder
    model = onnx.load(str(whole))
    feeds = as_feeds(_tokens(8), model_inputs(model))
    info = calibrate.probe(model, feeds[0])
    tensors = ["x", "q", "k", "v", "ctx", "h", "f2", "pooled"]
    assert calibrate.tensor_groups(tensors, info, 1) == [[name] for name in tensors]
    assert calibrate.tensor_groups(tensors, info, memory.MEMORY_BUDGET) == [tensors]
    wide = calibrate.observe(model, feeds, tensors, info, observer="minmax", symmetric=False)
    narrow = calibrate.observe(model, feeds, tensors, info, observer="minmax", symmetric=False, budget=1)
    for name in tensors:  # every sample seen either way: the same range, to ONNX Runtime's float rounding (its
        # ReduceMean sums in another order for one row than for eight: 2e-6 apart on 17.8 here)
        assert np.allclose([wide[name].low, wide[name].high], [narrow[name].low, narrow[name].high], rtol=1e-6,
                           atol=0), name
        (scale_a, zero_a), (scale_b, zero_b) = wide[name].qparams(False), narrow[name].qparams(False)
        assert abs(scale_a - scale_b) <= 1e-6 * scale_a and zero_a == zero_b, name


def test_a_budget_below_one_layer_is_refused_and_one_just_above_it_runs(encoder, tmp_path, monkeypatch):
    _, external = encoder
    x = _tokens(16)
    before = _digest(external.parent)
    needed = memory.refuse_if_too_large(external, [{"x": x}], max_memory=1 << 40)
    widest = 4 * WIDTH * TOKENS * 4  # the feed-forward's hidden tensor, one sample, float32
    out = tmp_path / "q.onnx"
    with pytest.raises(DataRefused, match=r"--max-memory .* one sample of .* alone needs"):
        quantize_onnx_file(external, out, x, target="onnxruntime-cpu", run_check=False,
                           max_memory=needed.fixed + widest // 2)
    assert not out.exists() and not list(tmp_path.iterdir()) and _digest(external.parent) == before
    # a budget that leaves room for one row of one tensor at a time: sliced, not refused; the written file is
    # read literally in parts (each of at most what the budget leaves: a weight and its float copy alone)
    parts = []
    whole_run = literal.SplitSession.run_feeds

    def counted(session, feeds, output_names=None):
        parts.append(session.n_parts)
        return whole_run(session, feeds, output_names)

    monkeypatch.setattr(literal.SplitSession, "run_feeds", counted)
    done = quantize_onnx_file(external, out, x, target="onnxruntime-cpu", run_check=False,
                              max_memory=needed.fixed + widest)
    assert done.path == out.resolve() and out.is_file()
    assert parts and min(parts) > 4, parts  # the encoder's weights each in a part of its own (same bytes as one
    # session: tests/inspect/test_literal_parts.py)


def test_cli_max_memory_below_the_weights_exits_2_with_one_line_and_writes_nothing(encoder, tmp_path):
    _, external = encoder
    np.save(tmp_path / "cal.npy", _tokens(8))
    before = _digest(external.parent)
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-m", "quantship", "quantize-onnx", str(external), "--calib",
                           str(tmp_path / "cal.npy"), "--out", str(out), "--max-memory", "100M"],
                          capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "--max-memory" in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not list(out.parent.iterdir()) and _digest(external.parent) == before


def test_the_estimate_is_at_least_the_peak_a_fresh_process_measures(encoder, tmp_path):
    _, external = encoder
    x = _tokens(16)
    np.save(tmp_path / "cal.npy", x)
    estimate = memory.refuse_if_too_large(external, [{"x": x}], max_memory=1 << 40)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    # spawned through a small launcher: Linux keeps the spawning process's peak RSS in a child's ru_maxrss across
    # exec, so a child of this (large) test process would report this process's peak, not its own
    launcher = ("import os, subprocess, sys\n"
                "child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
                "_, status, usage = os.wait4(child.pid, 0)\n"
                "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)\n")
    done = subprocess.run([sys.executable, "-c", launcher, sys.executable, "-m", "quantship", "quantize-onnx",
                           str(external), "--calib", str(tmp_path / "cal.npy"), "--out", str(tmp_path / "q.onnx"),
                           "--no-speed"], capture_output=True, text=True, env=env, timeout=900)
    code, maxrss_kb = (int(v) for v in done.stdout.split())
    assert code == 0, done.stderr
    peak = maxrss_kb * 1024
    assert peak <= estimate.total, (peak, estimate.describe())
