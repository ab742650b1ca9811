"""ZOO.md from bench/zoo.py's records: one section and table per family, quantize time per stage in each row."""

from __future__ import annotations

import importlib.metadata
import platform

import torch
from _zoo_families import STAGES

EARLIER_CPU = "not recorded (AMD EPYC, the CPU the ZOO.md of those records named)"
STAGE_COLUMNS = ("capture", "prepare", "calibrate", "convert", "histogram search", "export", "checks", "other")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _prep(r) -> str:
    if r.family != "torchvision" and r.family != "timm":
        return "-"
    if r.bn_reestimated is None:
        return "none (earlier run)" if r.size else "-"
    parts = [f"BN {r.bn_reestimated} re-estimated" if r.bn_reestimated else "as initialised"]
    if r.zero_reinit:
        parts.append(f"{r.zero_reinit} zero weight(s) re-init")
    return ", ".join(parts)


def stage_seconds(r) -> dict[str, float] | None:
    """A record's seconds per stage with ``other`` (quantize + export time no marked stage holds; the histogram
    search is inside convert); None for a record measured before the stages were timed."""
    if not r.stages:
        return None
    marked = sum(v for k, v in r.stages.items() if k in STAGES and k != "histogram search")
    return {**{k: r.stages.get(k, 0.0) for k in STAGES}, "other": max(0.0, r.seconds - marked)}


def _stage_cells(r) -> str:
    seconds = stage_seconds(r)
    if seconds is None:
        return " | ".join("-" for _ in STAGE_COLUMNS)
    return " | ".join(f"{seconds[k]:.1f}" for k in STAGE_COLUMNS)


def _slowest(rows) -> str:
    timed = [(r, stage_seconds(r)) for r in rows if stage_seconds(r)]
    if not timed:
        return "no record of this family has its stages timed yet"
    parts = []
    for stage in STAGE_COLUMNS:
        r, seconds = max(timed, key=lambda t: t[1][stage])
        parts.append(f"{stage} {r.model} {seconds[stage]:.1f} s")
    return f"slowest per stage over the {len(timed)} timed record(s): " + ", ".join(parts)


def _summary(family: str, rows, zoo: list[str], records: dict, giant_params: float, census_keys) -> list[str]:
    names = ", ".join
    left_out = [r for r in rows if r.status.startswith("left out")]
    failed = [r for r in rows if r.status.startswith(("failed", "no float forward"))]
    exported = [r for r in rows if r.n_compute]
    full = [r for r in exported if r.n_float_compute == 0]
    vacuous = [r for r in rows if "vacuous" in r.status]
    over = [r for r in exported if round(r.lsb_literal or 0) > 4]  # 4.0000006 is 4 steps
    over_fused = [r for r in exported if round(r.lsb_fused or 0) > 4]
    commits = sorted({r.commit for r in rows}, key=lambda c: min(r.measured_utc for r in rows if r.commit == c))
    times = sorted(r.measured_utc for r in rows if r.measured_utc)
    imported = [r for r in rows if r.bn_reestimated is None and r.size and family == "torchvision"]
    loads = [r.load_avg for r in rows if r.load_avg is not None]
    census = {k: sum((r.census or {}).get(k, 0) for r in rows) for k in census_keys}
    not_run = [m for m in zoo if m not in records]
    return [
        f"- {len(rows)} of {len(zoo)} models run; {len(full)} of {len(exported)} exported files fully INT8 "
        f"(no float compute op); {len(over)} above 4 LSB literal"
        + (f" ({names(f'{r.model} {r.lsb_literal:.0f}' for r in over)})" if over else "")
        + f"; {len(over_fused)} above 4 LSB with ORT's default optimizations"
        + (f" ({names(f'{r.model} {r.lsb_fused:.0f}' for r in over_fused)})" if over_fused else ""),
        f"- per quantized tensor, for the {len(over)} above 4 LSB literal (`local`: torch fed the file's own quantized "
        "inputs, then compared integer by integer, `quantship.inspect.trace_divergence`): "
        + (names(f"{r.model} {r.local_max} step(s) on {r.local_count} of {r.n_quantized} elements"
                 for r in over if r.local_max is not None) or "not traced")
        + (f"; not traced yet: {names(r.model for r in over if r.local_max is None)}"
           if any(r.local_max is None for r in over) else ""),
        f"- left out ({len(left_out)}): " + (names(f"{r.model} ({r.params_m:.0f}M parameters)" for r in left_out)
                                              or "none")
        + f"; the rule: more than {giant_params / 1e6:.0f}M parameters (24 GiB machine)",
        f"- failed ({len(failed)}): " + (names(f"{r.model}: {r.status.removeprefix('failed: ')}" for r in failed) or "none"),
        f"- vacuous LSB ({len(vacuous)}): " + (names(r.model for r in vacuous) or "none"),
        f"- not run yet ({len(not_run)}): " + (names(not_run) or "none"),
        "- census totals: " + names(f"{k} {v}" for k, v in census.items()),
        f"- quantize time per stage: {_slowest(rows)}",
        f"- commits measured at: {names(commits) or '-'}; {times[0] if times else '-'} .. {times[-1] if times else '-'}"
        + (f". Records with `prep` 'none (earlier run)' ({len(imported)}) were imported once from an earlier "
           "ZOO.md table (commit named in their row), measured by the previous version of this script, "
           "without the preparation" if imported else ""),
        "- CPU: " + (names(sorted({r.cpu or EARLIER_CPU for r in rows})) or "-") + "; 1-min load average at the end of "
        "each model: "
        + (f"{min(loads):.1f}..{max(loads):.1f}" if loads else "not recorded"),
    ]


def _table(rows, census_keys) -> list[str]:
    lines = [
        "| model | params M | input | prep | float compute / all | LSB literal / fused | span LSB | "
        + " | ".join(census_keys) + " | float in ORT | time s | " + " | ".join(f"{s} s" for s in STAGE_COLUMNS)
        + " | observer | load | ops without a rule (module: op) | commit | status |",
        "|---|---|---|---|---|---|---|" + "---|" * len(census_keys) + "---|---|" + "---|" * len(STAGE_COLUMNS)
        + "---|---|---|---|---|",
    ]
    for r in rows:
        c = r.census or {}
        size = r.input_shape or (str(r.size) if r.size else "-")
        lines.append(
            f"| {r.model} | {r.params_m:.1f} | {size} | {_prep(r)} | "
            f"{f'{r.n_float_compute} / {r.n_compute}' if r.n_compute else '-'} | "
            f"{_fmt(r.lsb_literal)} / {_fmt(r.lsb_fused)} | {_fmt(r.out_span_lsb)} | "
            + " | ".join(str(c.get(k, "-")) for k in census_keys)
            + f" | {r.float_in_ort if r.census else '-'} | {r.seconds:.0f} | {_stage_cells(r)} | "
            f"{r.observer or 'histogram'} | {'-' if r.load_avg is None else f'{r.load_avg:.1f}'} | {r.no_rule or '-'} | "
            f"{r.commit} | {r.status} |")
    return lines


# why the torchvision preparation exists and where it stops (measured; see bench/zoo.py prepare_untrained)
TORCHVISION_WHY = (
    "Why: torchvision's init for "
    "depthwise convolutions (`kaiming_normal_(mode='fan_out')` counts all output channels as fan-out) "
         "makes their weights ~sqrt(C) too small; with BatchNorm at mean 0 / variance 1 the signal shrinks at "
         "every block to 1e-9..1e-15 before the head of MobileNet, MNASNet and EfficientNet (the head itself "
         "is random, not zero: N(0, 0.01) or uniform), far below the observers' smallest scale (float32 eps, "
         "1.2e-7), so every activation near the head quantized to its zero-point, the quantized output was "
         "constant and the LSB figure vacuous. ViT's head is initialised at zero. Why only where the signal "
         "vanished: a random network whose BatchNorms all normalise to unit spread amplifies a 1-LSB rounding "
         "difference layer after layer (measured, LSB literal / fused: regnet_y_1_6gf 0 / 3 as initialised, "
         "61 / 72 re-estimated; regnet_y_16gf 2 / 2 and 28 / 68; regnet_y_400mf 0 / 0, and 0 / 29 or 14 / 30 "
         "re-estimated from 8 or 64 images), so its figures would say more about the random network than "
         "about the file. The same holds, less strongly, for the models that do get it: their fused figures grow from "
         "1-LSB differences in the first layers (mobilenet_v2, ORT's basic-level graph vs literal, per activation: "
         "1, 1, 1, 3, 2, 2, 4, 6 ... 28 LSB by the 35th quantized activation; 0 literal), and EfficientNet-B5/B6 "
         "and V2-M outputs span only 11-20 LSB after it. A record that still has a constant output says `LSB vacuous`; "
         "`span` says how many output steps the comparison sees."
)

FAMILY_TEXT = {
    "torchvision": "torchvision's classification zoo (`list_models(module=torchvision.models)`), `weights=None`, "
                   "the smallest square input the float model accepts.",
    "timm": "issue 29's timm architectures at their smallest variant, `timm.create_model(name, pretrained=False, "
            "num_classes=10)`, the smallest square input the float model accepts; the models built for 224 px only "
            "are built for 64 px where timm allows it (`img_size=64`; swin also `window_size=4`, eva02 `img_size=70`, "
            "5x5 patches of 14; `_zoo_families.TIMM_SMALL_INPUT`), efficientformer_l1 stays at 224 (its attention "
            "bias table is sized for 224). Random weights: graph coverage, not accuracy.",
    "hf": "transformers models from small configs (2 layers, hidden 64 where the config has one; random weights, "
          "seed 0), each returning its main tensor (`last_hidden_state` or `logits`); token models read 1 x 16 ids "
          "of a 128-word vocabulary. The preparation of the image families does not apply.",
    "detection": "the torchvision detectors issue 29 names (`weights=None, weights_backbone=None`), through the same "
                 "whole-model path as the classifiers (capture of the whole forward, post-processing included). "
                 "bench/detection.py (another bench) quantizes their backbones and heads with the post-processing "
                 "kept float; nudenet's YOLOv8n head choices are in ZOO-yolo.md.",
}


def render(records: dict[tuple[str, str], object], zoos: dict[str, list[str]], unavailable: dict[str, str], *,
           census_keys, giant_params: float, preparation: str) -> str:
    import onnxruntime as ort
    import torchvision

    from quantship.inspect import cpu_info

    cpu, flags = cpu_info()
    vnni = "VNNI" if {"avx512_vnni", "avx_vnni"} & flags else "no VNNI"
    lines = [
        "# The model zoo through the onnxruntime-cpu preset", "",
        "Generated by `python bench/zoo.py [--family F]` from `bench/zoo_results.json` (one record per model, with "
        "the commit and UTC time it was measured at); do not edit by hand. One section per family: "
        + ", ".join(f"[{f}](#{f})" for f in zoos) + ".",
        "",
        "Untrained models, batch 1, 2 random calibration batches, one random sample for the readings; "
        "`Quantizer.for_target('onnxruntime-cpu')` (activation observer: the `observer` column; `histogram` is the "
        "preset's) then `export_qdq(target='onnxruntime-cpu')`. `float compute` counts "
        "Conv/Gemm/MatMul/Einsum of the file that read anything other than DequantizeLinear on their first two "
        "inputs. LSB: max error of the file vs the torch quantized model on the sample, in output LSB, ORT read "
        "literally (optimizations off) / ORT default optimizations; `span`: max - min of that output, in LSB "
        "(how many steps the comparison sees). Census: integer kernels in ORT's optimized graph; `float in "
        "ORT`: Conv/Gemm/MatMul (plain or fused) ORT still runs in float. Time: quantize + export, seconds.",
        "",
        "Quantize time per stage (seconds, measured inside the run by a timing hook: a listener on the steps "
        "quantship marks, `quantship.progress`): `capture` torch.export; `prepare` prepare_pt2e (observers "
        "inserted); `calibrate` the calibration passes (two with histogram observers); `convert` convert_pt2e, "
        "of which `histogram search` is the histogram observers' range search "
        "(`quantship.quantize.histogram_search`, timed by a wrapper around it); `export` torch.onnx.export and "
        "writing the file; `checks` every `export check:` step (opset lowering, uint8 form, the spec, the target's "
        "rules, both ORT readings); `other` the rest of the time column (the torch reference outputs, the graph "
        "passes between steps). `-`: measured before the stages were timed.",
        "",
        f"CPU of this rendering: {cpu} ({vnni}) (each family's summary names the CPUs its records were measured on), "
        "2 cores shared by up to 7 engineers: the time columns were measured under load (the "
        "`load` column), and are no speed figure; "
        f"Python {platform.python_version()}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
        f"onnxruntime {ort.__version__}" + (f", timm {_version('timm')}" if _version("timm") else "") + ".",
    ]
    for family, zoo in zoos.items():
        rows = [records[family, m] for m in zoo if (family, m) in records]
        lines += ["", f"## {family}", "", FAMILY_TEXT[family], ""]
        if family == "torchvision":
            lines += [f"Preparation of the untrained model (column `prep`): {preparation}. {TORCHVISION_WHY}", ""]
        if family == "timm":
            lines += ["Preparation of the untrained model (column `prep`): the torchvision family's (above).", ""]
        if family in unavailable and not rows:
            lines += [f"Not run: {unavailable[family]}. Models listed: {', '.join(zoo)}."]
            continue
        lines += _summary(family, rows, zoo, {m: r for (f, m), r in records.items() if f == family}, giant_params,
                          census_keys)
        lines += ["", *_table(rows, census_keys)]
    return "\n".join(lines) + "\n"
