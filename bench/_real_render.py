"""REAL.md from bench/real.py's records: the header, the accuracy and speed summaries, one table per model."""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path

from _real_records import MODELS, PRESETS, SPEED_TOOL, Row, latency_method_of, row_keys
from _real_timing import DEFAULT_ROUNDS, STEADY, WALL

WALL_MARK = " (wall)"  # after a latency figure measured by the older method


FIDELITY_RECORD = Path(__file__).resolve().parent / "fidelity_results.md"  # written by bench/fidelity.py

def _pct(k: int, n: int) -> str:
    from quantship.inspect import wilson_interval

    if not n:
        return "0/0"
    lo, hi = wilson_interval(k, n)
    return f"{k}/{n} {100 * k / n:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def _cell(row: Row, reading: str, metric: str) -> str:
    value = row.scores.get(reading)
    if value is None:
        return "-"
    if isinstance(value, str):
        return f"not run: {value}"
    if metric not in value:
        return "-"
    return _pct(*value[metric])


def _latency(row: Row, key: str) -> str:
    value = row.latency_ms.get(key)
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    fp32, int8 = value
    mark = WALL_MARK if latency_method_of(row) == WALL else ""
    if row.tool == "fp32":
        return f"{fp32:.3g}{mark}"
    return f"{fp32:.3g} / {int8:.3g} ({fp32 / int8:.2f}x){mark}"


def _short_note(note: str) -> str:
    """A long 'kept in float' list as its count and its first entries."""
    head = "kept in float (no role): "
    if note.startswith(head):
        items = note.removeprefix(head).split("; ")
        if len(items) > 3:
            return f"{head}{len(items)} ops ({'; '.join(items[:3])}; ...)"
    return note


def _size(row: Row) -> str:
    if not row.size_bytes:
        return "-"
    if row.float_size_bytes and row.size_bytes != row.float_size_bytes:
        return f"{row.size_bytes / 1e6:.2f} MB ({row.size_bytes / row.float_size_bytes:.2f}x FP32)"
    return f"{row.size_bytes / 1e6:.2f} MB"


def _timed(row: Row) -> bool:
    return any(isinstance(v, list) for v in row.latency_ms.values())


def _span(values: list) -> str:
    return f"{min(values)}..{max(values)}" if values else "-"


def latency_sentence(rows: list[Row]) -> str:
    """The header's account of how each row's latency was measured: the method, its rounds and the load."""
    timed = [r for r in rows if _timed(r)]
    steady = [r for r in timed if latency_method_of(r) == STEADY]
    wall = [r for r in timed if latency_method_of(r) == WALL]
    plan = DEFAULT_ROUNDS
    text = ("- Latency: ONNX Runtime at default optimizations, FP32 file / INT8 file in ms (speed-up), batch 1 and "
            "batch 8 (a ratio above 1 is faster than FP32), the row's two files interleaved run by run, median. "
            "Size: the INT8 file on disk, and its size as a multiple of the FP32 file's.")
    if steady:
        rounds = [n for r in steady for n in r.latency_rounds.values()]
        load = [r.retimed_load if r.retimed_utc else r.load_avg for r in steady]
        text += (f" {len(steady)} of {len(timed)} timed rows by {STEADY}: each session with one intra-op and one "
                 "inter-op thread, so every kernel runs on the thread that calls `run`, and each run timed by "
                 "`time.thread_time()`, that thread's CPU time (time spent waiting for a core another process holds "
                 "is not counted, so the figure holds on a shared machine); rounds per batch chosen from a probe "
                 f"round for about {plan.target_s:g} s of timing per file ({plan.least}..{plan.most}, at most "
                 f"{plan.budget_s:g} s per batch): {_span(rounds)} here; 1-min load average when they were timed "
                 f"{_span([x for x in load if x is not None])}.")
    if wall:
        text += (f" {len(wall)} of {len(timed)} timed rows carry the older reading, marked `(wall)`: "
                 "ONNX Runtime's default threads, wall time (`perf_counter`), 20 runs at batch 1 and 10 at batch 8 "
                 "(fewer on the slowest models); it spreads 2-10x with the load of a shared machine and moves even "
                 "the ratios from row to row: never compare a `(wall)` figure with an unmarked one.")
    retimed = [r for r in rows if r.retimed_utc]
    if retimed:
        text += (f" Latency of {len(retimed)} of {len(rows)} rows re-timed from the same files in a later run "
                 f"(`--keep` then `--retime`), {min(r.retimed_utc for r in retimed)} .. "
                 f"{max(r.retimed_utc for r in retimed)}, 1-min load average "
                 f"{_span([r.retimed_load for r in retimed if r.retimed_load is not None])}.")
    return text


def ort_quantship_tools(rows: list[Row]) -> list[str]:
    """The ONNX path's quantship tools whose file is meant for ONNX Runtime: ``quantship:onnxruntime-cpu``
    first, then any other kind the records hold (a tool named without a preset, or for onnxruntime-cpu)."""
    other = {p for p in PRESETS if p != "onnxruntime-cpu"}
    found = {r.tool for r in rows if r.path == "onnx" and r.tool.startswith("quantship")
             and r.tool.partition(":")[2] not in other}
    return sorted(found | {"quantship:onnxruntime-cpu"}, key=lambda t: (t != "quantship:onnxruntime-cpu", t))


def _tool_label(tool: str) -> str:
    if tool == SPEED_TOOL:
        return "onnxruntime-cpu `--speed-search`"
    return tool.removeprefix("quantship:") if tool.startswith("quantship:") else tool


def _ms(row: Row | None, batch: str) -> tuple[float, float] | None:
    value = row.latency_ms.get(batch) if row is not None and row.status == "ok" else None
    return tuple(value) if isinstance(value, list) else None


def _mark(row: Row) -> str:
    return WALL_MARK if latency_method_of(row) == WALL else ""


def _fp32_spread(rows: list[Row], models: list[str]) -> str:
    """The largest max / min of the FP32 file's time over one model's rows timed steadily, said in a clause."""
    worst = None
    for model in models:
        for batch in ("b1", "b8"):
            fp32 = [ms[0] for r in rows if r.model == model and latency_method_of(r) == STEADY and (ms := _ms(r, batch))]
            if len(fp32) > 1 and (worst is None or max(fp32) / min(fp32) > worst[0]):
                worst = (max(fp32) / min(fp32), model, batch, min(fp32))
    if worst is None:
        return ""
    spread, model, batch, fastest = worst
    return (f" (the FP32 file's own time, {STEADY}, still moves between the rows of one model: by up to "
            f"{spread:.2f}x, {model} at batch {batch.removeprefix('b')}, "
            + (f"{fastest * 1e3:.3g} us" if fastest < 1 else f"{fastest:.3g} ms") + " at the fastest)")


def speed_summary(records: dict[str, Row], models: list[str]) -> list[str]:
    """Per model and batch, each INT8 file's speed-up over FP32 in ONNX Runtime (measured in its own row), and
    the quantship ONNX files' speed against ORT defaults' file where both rows were timed the same way."""
    rows = list(records.values())
    mine = ort_quantship_tools(rows)
    columns = ([("onnx", "ort-defaults", "ORT defaults"), ("onnx", "ort-per-channel", "ORT per-channel"),
                ("onnx", "nncf", "NNCF")] + [("onnx", t, f"quantship ONNX path, {_tool_label(t)}") for t in mine]
               + [("pt2e", "quantship:onnxruntime-cpu", "quantship PyTorch path, onnxruntime-cpu")])
    head = (["model", "batch", "FP32 ms, median over rows"] + [c[2] for c in columns]
            + [f"quantship ONNX path, {_tool_label(t)} vs ORT defaults" for t in mine])
    lines = [f"## Summary: speed in ONNX Runtime ({STEADY})", "",
             "Each INT8 file's speed-up over FP32 (FP32 ms / INT8 ms, the two interleaved in the file's own row; "
             "above 1 is faster than FP32). `vs ORT defaults`: ORT defaults' INT8 ms / quantship's INT8 ms, each "
             "first divided by the FP32 ms of its own row (the same FP32 file), i.e. quantship's speed-up over ORT "
             "defaults' speed-up: above 1, quantship's file is faster; the division cancels what drifts between "
             f"the two rows' runs{_fp32_spread(rows, models)}; only where both rows were timed by the same method, on "
             "the same CPU. "
             "FP32 ms: the median of the "
             "FP32 file's time over the model's rows timed by the same method as the FP32 row. "
             f"`{WALL_MARK.strip()}`: measured by the older method ({WALL}), not comparable with an unmarked "
             "figure. `-`: no figure (not run, not produced, or a static-batch file at the other batch).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models:
        for batch in ("b1", "b8"):
            fp32_row = records.get(f"{model}|onnx|fp32")
            fp32 = [ms[0] for r in rows if r.model == model and (ms := _ms(r, batch))
                    and latency_method_of(r) == latency_method_of(fp32_row)] if _ms(fp32_row, batch) else []
            cells = [model, batch.removeprefix("b"), f"{statistics.median(fp32):.3g}{_mark(fp32_row)}" if fp32 else "-"]
            for path, tool, _ in columns:
                row = records.get(f"{model}|{path}|{tool}")
                ms = _ms(row, batch)
                cells.append(f"{ms[0] / ms[1]:.2f}x{_mark(row)}" if ms else "-")
            ort_row = records.get(f"{model}|onnx|ort-defaults")
            ort_ms = _ms(ort_row, batch)
            for tool in mine:
                row = records.get(f"{model}|onnx|{tool}")
                ms = _ms(row, batch)
                if not (ms and ort_ms):
                    cells.append("-")
                elif latency_method_of(row) != latency_method_of(ort_row):
                    cells.append("- (timed by different methods)")
                elif row.cpu != ort_row.cpu:
                    cells.append("- (timed on different CPUs)")  # int8 speed-ups differ between CPUs
                else:
                    cells.append(f"{(ms[0] / ms[1]) / (ort_ms[0] / ort_ms[1]):.2f}x{_mark(row)}")
            lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


PENDING = "not measured yet: the run was stopped before this row (re-run `python bench/real.py --models MODEL`)"

TOOL_NAMES = {
    "fp32": "FP32", "ort-defaults": "ORT `quantize_static` (QDQ, defaults)",
    "ort-per-channel": "ORT `quantize_static` (QDQ, per_channel=True)", "nncf": "NNCF `nncf.quantize` (defaults)",
    "nncf-transformer": "NNCF (`model_type=TRANSFORMER`)",
    SPEED_TOOL: "quantship `onnxruntime-cpu --speed-search`",
}


def _cpus(rows: list[Row]) -> str:
    """Each CPU the rows were measured on, with how many rows and which models: ratios within a row are of
    one machine, across rows of two machines they are not comparable."""
    by: dict[str, list[Row]] = {}
    for r in rows:
        by.setdefault(r.cpu or "not recorded", []).append(r)
    return "; ".join(f"{cpu}: {len(rs)} row(s) ({', '.join(dict.fromkeys(r.model for r in rs))})"
                     for cpu, rs in sorted(by.items(), key=lambda kv: -len(kv[1])))


def render(records: dict[str, Row], tasks: dict[str, dict], smoke: bool = False) -> str:
    import onnxruntime as ort
    import torch

    from quantship.inspect import cpu_info

    cpu, flags = cpu_info()
    int8_flags = sorted(f for f in flags if f in {"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8",
                                                   "avx512_bf16", "amx_bf16", "avxvnni"})
    versions = []
    for module in ("onnxruntime", "nncf", "openvino", "onnx2torch", "tigris"):
        try:
            from importlib.metadata import version

            versions.append(f"{module} {version(module if module != 'tigris' else 'tigris-ml')}")
        except Exception:  # not installed: say so
            versions.append(f"{module} not installed")
    rows = list(records.values())
    commits = sorted({r.commit for r in rows if r.commit})
    times = sorted(r.measured_utc for r in rows if r.measured_utc)
    loads = [r.load_avg for r in rows if r.load_avg is not None]
    load_text = f"{min(loads):.1f}..{max(loads):.1f}" if loads else "-"
    flag_text = " ".join(int8_flags) or "no int8 flag found"
    lines = [
        "# Real pretrained models: FP32, ONNX Runtime's quantizer, NNCF and quantship on real tasks", "",
        "Generated by `python bench/real.py` from `bench/real_results.json` (one record per model x path x tool, "
        "with the commit and UTC time it was measured at); do not edit by hand."
        + (" **SMOKE RUN: tiny sizes, not figures.**" if smoke else ""), "",
        f"- CPU of each row (its latency's): {_cpus(rows)}; rendered on {cpu}, int8-relevant flags: {flag_text}; "
        f"{os.cpu_count()} cores, shared (1-min load average when each row finished: {load_text})",
        f"- Python {platform.python_version()}, torch {torch.__version__}, onnxruntime {ort.__version__}; "
        + ", ".join(versions),
        f"- commits: {', '.join(commits) or '-'}; measured {times[0] if times else '-'} .. {times[-1] if times else '-'}",
        "- Every cell of a metric is `k/n percent [Wilson 95% interval]`. Readings: **ORT** = the file in ONNX "
        "Runtime at its default optimizations (what `InferenceSession(path)` runs); **ORT literal** = optimizations "
        "off (the arithmetic the Q/DQ pairs describe), on the subset named per model; **torch** = the quantized "
        "model in PyTorch (PyTorch path), on the same subset; OpenVINO (CPU, f32 inference precision, as "
        "quantship's consumers run it) for the openvino preset's file, TiGrIS's host runtime (its compiled plan, "
        "subset) for the tigris preset's file. Second metric: agreement of the top-1 answer with FP32 (ORT) on "
        "the same samples.",
        latency_sentence(rows),
        "- Tools: ORT = `onnxruntime.quantization.quantize_static` after `quant_pre_process` as ORT documents "
        "(where pre-processing fails, the file as shipped, noted), QDQ format, MinMax; NNCF = `nncf.quantize` on "
        "the `onnx.ModelProto` (ONNX backend), `subset_size` = the calibration set; quantship ONNX path = the "
        "command `quantship quantize-onnx FLOAT.onnx --calib CAL.npy --out INT8.onnx --target T` in a subprocess, "
        "calibration array in the input's own dtype (`--speed-search` rows: the same command with `--target "
        "onnxruntime-cpu --speed-search`, its steps bounded by `--max-steps` on the models bench/real.py's "
        "SPEED_MAX_STEPS names, said in the row); quantship PyTorch path = what `quantship quantize` runs by default "
        "(`quantship.export.quantize_export_judged`: `Quantizer.for_target(T).quantize`, `export_qdq(..., target=T)`, "
        "the fidelity budget judged in-sample on the first calibration batch and repaired if missed, placement by "
        "profile on ONNX Runtime targets; rows measured before 2026-12-04 are `Quantizer` + `export_qdq` alone) "
        "on the PyTorch model (the wheel's for MTCNN; `onnx2torch` 1.5.15 after "
        "lifting Constants to initializers and freezing constant Reshape/Resize arguments, "
        "`quantship.examples.real.convert`, for the ONNX models). All tools get the same calibration data.",
        "",
    ]
    order = {m: i for i, m in enumerate(MODELS)}
    models = sorted({r.model for r in rows}, key=lambda m: order.get(m, 99))
    never = [m for m in MODELS if m not in models]
    if never:
        lines += [f"- Not measured yet (the run was stopped before them): {', '.join(never)}", ""]
    summary = [("onnx", "fp32"), ("onnx", "ort-defaults"), ("onnx", "ort-per-channel"), ("onnx", "nncf"),
               ("onnx", "quantship:onnxruntime-cpu"), ("onnx", SPEED_TOOL), ("pt2e", "quantship:onnxruntime-cpu")]
    lines += ["## Summary: the task metric of each file in ONNX Runtime (default optimizations)", "",
              "| model | metric | FP32 | ORT defaults | ORT per-channel | NNCF | quantship ONNX path, onnxruntime-cpu "
              "| quantship ONNX path, onnxruntime-cpu `--speed-search` | quantship PyTorch path, onnxruntime-cpu |",
              "|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        info = tasks.get(model, {})
        metric = (info.get("metrics") or ["-"])[0]
        cells = []
        for key in summary:
            r = records.get(f"{model}|{key[0]}|{key[1]}")
            if r is None:
                cells.append("not run")
            elif r.status != "ok":
                cells.append("not produced (reason below)")
            else:
                cells.append(_cell(r, "ort", metric))
        lines.append(f"| {model} | {metric} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += speed_summary(records, models)
    if FIDELITY_RECORD.is_file() and not smoke:  # bench/fidelity.py's table: the label-free figure beside the task's
        lines += [FIDELITY_RECORD.read_text().rstrip(), ""]
    for model in models:
        info = tasks.get(model, {})
        metrics = info.get("metrics") or sorted({m for r in rows if r.model == model for v in r.scores.values()
                                                 if isinstance(v, dict) for m in v})
        primary, secondary = metrics[0], (metrics[1] if len(metrics) > 1 else None)
        lines += [f"## {info.get('title', model)}", "", f"Data: {info.get('data', '-')}.", ""]
        if info.get("subset"):
            lines += [f"Slow readings (ORT literal, torch, TiGrIS) on the first {info['subset']} samples.", ""]
        head = (f"| path | tool / preset | {primary}, ORT | {primary}, ORT literal | {primary}, torch | "
                f"{primary}, OpenVINO / TiGrIS | " + (f"{secondary}, ORT | " if secondary else "")
                + "size | ms b1 FP32 / INT8 | ms b8 FP32 / INT8 | status, notes |")
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        keys = row_keys(model)
        mine = sorted((r for r in rows if r.model == model),
                      key=lambda r: keys.index((r.path, r.tool)) if (r.path, r.tool) in keys else 99)
        measured = {(r.path, r.tool) for r in mine}
        pending = [Row(model, p, t, status=PENDING) for p, t in keys if (p, t) not in measured]
        for r in mine + pending:
            consumer = next((c for c in ("openvino", "tigris") if c in r.scores), None)
            status = "ok" if r.status == "ok" else f"**not produced**: {r.status}"
            if r.notes:
                note = r.notes.replace("; vs FP32 at", "; its own final reading at quantize time, vs FP32 at") \
                    if r.tool == SPEED_TOOL else r.notes  # the search's reading, not the row's latency columns
                status += f"; {_short_note(note)}"
            tool = TOOL_NAMES.get(r.tool, f"quantship `{r.tool.removeprefix('quantship:')}`")
            if r.path == "pt2e" and r.tool == "fp32":
                tool = "FP32 in PyTorch"
            lines.append(
                f"| {'ONNX' if r.path == 'onnx' else 'PyTorch (pt2e)'} | {tool} | {_cell(r, 'ort', primary)} | "
                f"{_cell(r, 'ort-literal', primary)} | {_cell(r, 'torch', primary)} | "
                f"{(consumer + ': ' + _cell(r, consumer, primary)) if consumer else '-'} | "
                + (f"{'reference' if (r.path, r.tool) == ('onnx', 'fp32') else _cell(r, 'torch' if r.tool == 'fp32' else 'ort', secondary)} | "
                   if secondary else "")
                + f"{_size(r)} | {_latency(r, 'b1')} | {_latency(r, 'b8')} | {status} |")
        lines.append("")
    return "\n".join(lines) + "\n"

