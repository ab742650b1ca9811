"""bench/real.py's latency and REAL.md: the steady timer on two tiny files, the records' method field, the header's
account of the method and the speed summary (rendered from synthetic records: rendering, not measurement)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # bench/real.py imports its siblings (_real_records, _real_timing, ...) by name

import _real_records  # noqa: E402
import _real_render  # noqa: E402
import _real_timing  # noqa: E402
from _real_records import Row  # noqa: E402
from _real_timing import STEADY, WALL, Rounds  # noqa: E402


def _matmul_file(path: Path, width: int, layers: int, batch: int | str = "N") -> Path:
    """A dynamic-batch (or fixed-batch) chain of ``layers`` MatMul + Relu on [batch, width]."""
    rng = np.random.default_rng(width + layers)
    nodes, inits, name = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [name, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        name = f"r{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, [batch, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_steady_timer_times_two_files_interleaved_with_positive_medians(tmp_path):
    small, large = _matmul_file(tmp_path / "small.onnx", 32, 1), _matmul_file(tmp_path / "large.onnx", 256, 4)
    x = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
    sessions = [_real_timing.session(small), _real_timing.session(_matmul_file(tmp_path / "b.onnx", 32, 64))]
    plan = Rounds(target_s=0.02, least=10, most=400)
    timing = _real_timing.steady_ms(sessions, x[:1], plan)
    assert plan.least <= timing.rounds <= plan.most
    assert [len(s) for s in timing.samples_ms] == [timing.rounds, timing.rounds]  # every round ran both files
    assert all(m > 0 and math.isfinite(m) for m in timing.median_ms)
    assert timing.median_ms[1] > timing.median_ms[0]  # 64 layers of the same MatMul cost more CPU than 1

    ms, rounds = _real_timing.latency(small, small, x, fixed_batch=None, rounds=plan)
    assert set(ms) == set(rounds) == {"b1", "b8"} and all(plan.least <= n <= plan.most for n in rounds.values())
    assert all(v > 0 for pair in ms.values() for v in pair)
    x_large = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    fixed = _matmul_file(tmp_path / "fixed.onnx", 256, 4, batch=1)
    ms, rounds = _real_timing.latency(large, fixed, x_large, fixed_batch=1, rounds=plan)
    assert ms["b8"] == "the file has a static batch of 1" and "b8" not in rounds and len(ms["b1"]) == 2

    ms, rounds = _real_timing.latency(small, small, x, fixed_batch=None, method=WALL, wall_reps=(3, 2))
    assert rounds == {"b1": 3, "b8": 2} and all(v > 0 for pair in ms.values() for v in pair)
    with pytest.raises(ValueError, match="latency method"):
        _real_timing.latency(small, small, x, fixed_batch=None, method="wall")


def test_rounds_follow_the_probe_within_their_bounds():
    plan = Rounds(target_s=0.75, least=10, most=3000, budget_s=40.0, least_slow=3)
    assert plan.count([0.001, 0.002]) == math.ceil(0.75 / 0.0015)  # about 0.75 s of timing per file
    assert plan.count([1e-6, 1e-6]) == 3000  # a tiny file: the ceiling
    assert plan.count([0.2, 0.3]) == 10  # above the target in one round: the floor
    assert plan.count([4.0, 5.0]) == math.floor(40.0 / 9.0)  # slow files: the budget for all rounds
    assert plan.count([30.0, 40.0]) == 3  # slower still: never fewer than least_slow
    assert _real_timing.SMOKE_ROUNDS.count([1e-6, 1e-6]) == 1


def _row(tool: str, b1: list | str | None, b8: list | str | None, method: str = STEADY, path: str = "onnx",
         model: str = "mtcnn_pnet", load: float = 3.2) -> Row:
    latency = {k: v for k, v in (("b1", b1), ("b8", b8)) if v is not None}
    rounds = {k: 500 for k, v in latency.items() if isinstance(v, list)} if method else {}
    return Row(model, path, tool, scores={"ort": {"face accuracy": [9, 10]}}, size_bytes=10, float_size_bytes=40,
               latency_ms=latency, latency_method=method, latency_rounds=rounds, load_avg=load,
               measured_utc="2026-12-02 00:00 UTC", commit="abc1234")


def _records() -> dict[str, Row]:
    rows = [
        _row("fp32", [1.0, 1.0], [4.0, 4.0]),
        _row("ort-defaults", [1.5, 3.0], [4.0, 10.0]),  # its FP32 ran slower than in the other rows
        _row("ort-per-channel", [1.1, 2.5], "the file has a static batch of 1"),
        _row("nncf", [1.2, 3.0], [5.0, 6.0], method=""),  # a record from before the method was recorded
        _row("quantship:onnxruntime-cpu", [1.0, 0.8], [4.0, 2.5]),
        _row("quantship-speed", [1.0, 0.5], [4.0, 2.0], method=WALL),
        _row("quantship:tensorrt", [1.0, 4.0], [4.0, 16.0]),
        _row("quantship:onnxruntime-cpu", [1.0, 1.25], [4.0, 5.0], path="pt2e"),
    ]
    return {r.key: r for r in rows}


TASKS = {"mtcnn_pnet": {"title": "PNet", "data": "crops", "metrics": ["face accuracy"], "subset": None}}


def _speed_lines(text: str) -> list[str]:
    part = text.split("## Summary: speed in ONNX Runtime (1 thread, CPU time)\n", 1)[1].split("\n## ", 1)[0]
    return [ln for ln in part.splitlines() if ln.startswith("|")]


def test_speed_summary_follows_the_accuracy_summary_with_every_tool_for_ort():
    text = _real_render.render(_records(), TASKS)
    accuracy = text.index("## Summary: the task metric of each file")
    speed = text.index("## Summary: speed in ONNX Runtime (1 thread, CPU time)")
    assert accuracy < speed < text.index("## PNet") and "\n## " not in text[accuracy + 3:speed]
    assert f"by up to {1.5 / 1.0:.2f}x, mtcnn_pnet at batch 1" in text  # the FP32 file's own spread over rows
    head, rule, b1, b8 = _speed_lines(text)
    columns = [c.strip() for c in head.strip("|").split("|")]
    assert columns == ["model", "batch", "FP32 ms, median over rows", "ORT defaults", "ORT per-channel", "NNCF",
                       "quantship ONNX path, onnxruntime-cpu", "quantship ONNX path, quantship-speed",
                       "quantship PyTorch path, onnxruntime-cpu", "quantship ONNX path, onnxruntime-cpu vs ORT defaults",
                       "quantship ONNX path, quantship-speed vs ORT defaults"]  # no tensorrt: not a file for ORT
    assert rule.count("---") == len(columns)
    cells = dict(zip(columns, (c.strip() for c in b1.strip("|").split("|"))))
    # the FP32 row's method (steady): 1.0 in four rows, 1.1 and 1.5 in one each
    assert cells["batch"] == "1" and cells["FP32 ms, median over rows"] == f"{1.0:.3g}"
    assert cells["ORT defaults"] == f"{1.5 / 3.0:.2f}x" and cells["ORT per-channel"] == f"{1.1 / 2.5:.2f}x"
    assert cells["NNCF"] == f"{1.2 / 3.0:.2f}x (wall)"  # no method recorded: the older one, and said
    assert cells["quantship ONNX path, onnxruntime-cpu"] == f"{1.0 / 0.8:.2f}x"
    assert cells["quantship ONNX path, quantship-speed"] == f"{1.0 / 0.5:.2f}x (wall)"
    assert cells["quantship PyTorch path, onnxruntime-cpu"] == f"{1.0 / 1.25:.2f}x"
    # speed-up over speed-up, each against its own row's FP32: not the raw 3.0 / 0.8
    assert cells["quantship ONNX path, onnxruntime-cpu vs ORT defaults"] == f"{(1.0 / 0.8) / (1.5 / 3.0):.2f}x"
    assert cells["quantship ONNX path, quantship-speed vs ORT defaults"] == "- (timed by different methods)"
    cells8 = dict(zip(columns, (c.strip() for c in b8.strip("|").split("|"))))
    assert cells8["ORT per-channel"] == "-"  # a static-batch file has no batch-8 figure
    assert cells8["quantship ONNX path, onnxruntime-cpu vs ORT defaults"] == f"{(4.0 / 2.5) / (4.0 / 10.0):.2f}x"


def test_speed_summary_says_dash_where_a_row_is_missing_or_not_produced():
    records = _records()
    records.pop("mtcnn_pnet|onnx|ort-defaults")
    records["mtcnn_pnet|onnx|nncf"].status = "nncf failed"
    head, _, b1, _ = _speed_lines(_real_render.render(records, TASKS))
    cells = dict(zip((c.strip() for c in head.strip("|").split("|")), (c.strip() for c in b1.strip("|").split("|"))))
    assert cells["ORT defaults"] == cells["NNCF"] == cells["quantship ONNX path, onnxruntime-cpu vs ORT defaults"] == "-"
    assert _real_render.ort_quantship_tools([]) == ["quantship:onnxruntime-cpu"]


def test_header_says_how_latency_was_measured_and_marks_the_older_reading():
    records = _records()
    text = _real_render.render(records, TASKS)
    header = text.split("## Summary", 1)[0]
    latency = next(ln for ln in header.splitlines() if ln.startswith("- Latency:"))
    timed = len(records)
    assert f"{timed - 2} of {timed} timed rows by 1 thread, CPU time" in latency
    assert "one intra-op and one inter-op thread" in latency and "`time.thread_time()`" in latency
    assert f"{2} of {timed} timed rows carry the older reading, marked `(wall)`" in latency
    assert "1-min load average when they were timed 3.2..3.2" in latency and ": 500..500 here" in latency
    assert "default threads;" not in header and "under a load above the core count" not in header
    assert "int8-relevant flags:" in header and "(1-min load average when each row finished: 3.2..3.2)" in header
    table = text.split("## PNet", 1)[1]
    assert f"| {1.2:.3g} / {3.0:.3g} ({1.2 / 3.0:.2f}x) (wall) |" in table  # the older method, in the model's table
    assert f"| {1.0:.3g} / {0.8:.3g} ({1.0 / 0.8:.2f}x) |" in table

    steady_only = {k: r for k, r in records.items() if r.latency_method == STEADY}
    latency = next(ln for ln in _real_render.render(steady_only, TASKS).splitlines() if ln.startswith("- Latency:"))
    assert "older reading" not in latency and f"{len(steady_only)} of {len(steady_only)} timed rows" in latency


def test_records_keep_the_method_and_rounds_and_read_an_older_record_as_wall(tmp_path):
    path = tmp_path / "real_results.json"
    row = _row("quantship:onnxruntime-cpu", [1.0, 0.8], [4.0, 2.5])
    records, _ = _real_records.save_records([row], path, TASKS)
    assert _real_records.load_records(path)[0] == records and records[row.key].latency_rounds == {"b1": 500, "b8": 500}
    assert _real_records.latency_method_of(records[row.key]) == STEADY
    older = path.read_text().replace('"latency_method": "1 thread, CPU time",', "")
    assert '"latency_method"' not in older
    path.write_text(older)
    assert _real_records.latency_method_of(_real_records.load_records(path)[0][row.key]) == WALL


def test_the_header_names_each_rows_cpu_and_a_record_keeps_it(tmp_path):
    """Rows measured on two machines: the header says which CPU measured how many rows of which models (a
    ratio is of one machine; across machines rows are not comparable), and a record saved keeps its CPU."""
    records = _records()
    first, *rest = records.values()
    first.cpu = "CPU A (avx2)"
    for r in rest:
        r.cpu = "CPU B (avx2, avx512_vnni)"
    line = next(ln for ln in _real_render.render(records, TASKS).splitlines() if ln.startswith("- CPU of each row"))
    assert f"CPU B (avx2, avx512_vnni): {len(rest)} row(s) ({first.model})" in line
    assert f"CPU A (avx2): 1 row(s) ({first.model})" in line
    path = tmp_path / "real_results.json"
    saved, _ = _real_records.save_records([first], path, TASKS)
    assert _real_records.load_records(path)[0][first.key].cpu == "CPU A (avx2)"


def test_no_ratio_to_ort_defaults_across_two_cpus():
    """quantship's speed-up over ORT defaults' divides two rows' speed-ups: on two CPUs (their int8 kernels
    differ) that is no comparison, and the cell says so instead of a figure."""
    records = _records()
    same = _speed_lines(_real_render.render(records, TASKS))
    records["mtcnn_pnet|onnx|quantship:onnxruntime-cpu"].cpu = "another CPU (avx2)"
    other = _speed_lines(_real_render.render(records, TASKS))
    assert "timed on different CPUs" not in " ".join(same)
    assert all(ln.split("|")[-3].strip() == "- (timed on different CPUs)" for ln in other[2:4]), other
