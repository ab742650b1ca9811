"""torchvision's classification zoo through the onnxruntime-cpu preset; results in zoo_results.json, table in ZOO.md.

For every model of ``torchvision.models.list_models(module=torchvision.models)`` (``weights=None``,
the smallest square input its float forward accepts among SIZES): prepare the untrained model the
same way for every model (see ``prepare_untrained``), quantize with
``Quantizer.for_target('onnxruntime-cpu')``, export with ``target='onnxruntime-cpu'``, then read the
file: Conv/Gemm/MatMul that still read a float input, error vs the torch quantized model in output
LSB (ORT literal and ORT default optimizations), ONNX Runtime's integer-kernel census, and the
time spent. Models above GIANT_PARAMS parameters are listed as left out.

Each model's result is one record of bench/zoo_results.json (with the commit and UTC time it was
measured at), saved as soon as the model is done; ``--models`` re-measures only those records and
ZOO.md is always rendered from every record, so partial runs merge and an interrupted run keeps
what it measured.

    python bench/zoo.py --observer minmax                     # the whole zoo
    python bench/zoo.py --observer minmax --models resnet18 vit_b_16
    python bench/zoo.py --render                              # ZOO.md from the records only
    python bench/zoo.py --smoke [--out FILE] [--results FILE]  # resnet18 only, into a fresh records file
                                                              # and table (bench/_smoke.py)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import onnx
import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
RESULTS = ROOT / "bench" / "zoo_results.json"
SIZES = (32, 64, 96, 128, 160, 224, 299)
GIANT_PARAMS = 300e6
COMPUTE_OPS = {"Conv", "Gemm", "MatMul", "Einsum"}
CENSUS = ("QLinearConv", "QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "QAttention")
BN_BATCH = 8  # random images whose statistics replace BatchNorm's initial running mean 0 / variance 1
REINIT_STD = 0.01  # weights given to a layer initialised at exactly zero
# float output spread (max - min over the calibration images) below which the signal counts as vanished:
# 1024 steps of the observers' smallest scale (float32 eps)
VANISHED = 1024 * torch.finfo(torch.float32).eps
PREPARATION = (
    f"every Linear/Conv whose weight is exactly zero re-initialised from N(0, {REINIT_STD}) (seed 3); then, only "
    f"if the float output's spread (max - min) over the 2 calibration images is below {VANISHED:.1e} (1024 steps "
    f"of the observers' smallest scale, float32 eps), every BatchNorm's running statistics re-estimated from "
    f"one batch of {BN_BATCH} random images at the model's input size (seed 2)"
)


@dataclass
class ZooRow:
    model: str
    params_m: float
    size: int | None = None
    n_compute: int = 0
    n_float_compute: int = 0
    lsb_literal: float | None = None
    lsb_fused: float | None = None
    census: dict | None = None
    float_in_ort: int = 0  # Conv/Gemm/MatMul/FusedConv... still float in ORT's optimized graph
    seconds: float = 0.0
    no_rule: str = ""  # ops the annotator has no rule for, by module
    status: str = "ok"
    # provenance and preparation (None on records imported from the table of an earlier run)
    commit: str = ""
    measured_utc: str = ""
    observer: str | None = None
    load_avg: float | None = None  # 1-minute load average when the model finished (2 cores)
    bn_reestimated: int | None = None  # BatchNorm modules whose statistics were re-estimated
    zero_reinit: int | None = None  # layers whose all-zero weight was re-initialised
    out_span_lsb: float | None = None  # (max - min) of the torch quantized output on the sample, in output LSB
    # where the literal reading is above 4 LSB: the file's own arithmetic, tensor by tensor
    # (quantship.inspect.trace_divergence: torch fed the file's quantized inputs), max steps / elements
    local_max: int | None = None
    local_count: int | None = None
    n_quantized: int | None = None  # elements over all quantized tensors compared


def float_compute_ops(path: Path) -> tuple[int, int]:
    """(Conv/Gemm/MatMul in the file, how many of them read something other than DequantizeLinear)."""
    model = onnx.load(str(path), load_external_data=False)
    producer = {out: node.op_type for node in model.graph.node for out in node.output}
    compute = [n for n in model.graph.node if n.op_type in COMPUTE_OPS]
    n_float = sum(any(producer.get(i) != "DequantizeLinear" for i in n.input[:2]) for n in compute)
    return len(compute), n_float


def smallest_size(model: torch.nn.Module) -> int | None:
    """The smallest square input in SIZES the float model runs on (batch 1)."""
    for size in SIZES:
        try:
            with torch.no_grad():
                model(torch.randn(1, 3, size, size))
            return size
        except Exception:  # too small for this architecture: try the next size
            continue
    return None


def prepare_untrained(model: torch.nn.Module, size: int, calib: list[torch.Tensor]) -> tuple[int, int]:
    """Make an untrained model's output depend on its input; returns (BatchNorms re-estimated, layers re-initialised).

    torchvision initialises depthwise convolutions with ``kaiming_normal_(mode="fan_out")``, whose fan-out
    counts every output channel although each sees one input channel: the weights are about sqrt(C) times
    too small, and with BatchNorm at its initial statistics (mean 0, variance 1) the signal shrinks at
    every block, to ~1e-9..1e-15 at the head of MobileNet/MNASNet/EfficientNet, below the observers'
    smallest scale, so the quantized output is constant. ViT initialises its head at zero. A zero weight
    gets small random values; where the signal has vanished (VANISHED), re-estimating BatchNorm on random
    images puts every normalised activation back at unit spread. Not everywhere: a random network whose
    BatchNorms all normalise amplifies a 1-LSB rounding difference layer after layer (regnet_y_1_6gf: 0 ->
    61 LSB literal), so the re-estimation is kept to the models that need it. Dropout and stochastic depth
    stay in eval mode (only BatchNorm is switched).
    """
    gen = torch.Generator().manual_seed(3)
    n_reinit = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and not module.weight.detach().any():
            with torch.no_grad():
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * REINIT_STD)
            n_reinit += 1
    with torch.no_grad():
        outs = torch.cat([torch.as_tensor(model(x)).flatten() for x in calib])
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if float(outs.max() - outs.min()) >= VANISHED or not norms:
        return 0, n_reinit
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average: one batch gives exactly its statistics
        m.train()
    with torch.no_grad():
        model(torch.randn(BN_BATCH, 3, size, size, generator=torch.Generator().manual_seed(2)))
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
        m.eval()
    return len(norms), n_reinit


def run_model(name: str, workdir: Path, observer: str | None) -> ZooRow:
    import torchvision

    from quantship import Quantizer, export_qdq
    from quantship.inspect.read.lsb import output_scales
    from quantship.inspect.run.consumers import ort_optimized_ops
    from quantship.inspect.run.verify import compare_logits
    from quantship.quantize.pt2e import describe_float_ops

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).eval()
    row = ZooRow(name, sum(p.numel() for p in model.parameters()) / 1e6, observer=observer)
    if row.params_m * 1e6 > GIANT_PARAMS:
        row.status = f"left out: {row.params_m:.0f}M parameters (> {GIANT_PARAMS / 1e6:.0f}M on this machine)"
        return row
    row.size = smallest_size(model)
    if row.size is None:
        row.status = f"no float forward at any of {SIZES}"
        return row
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(1, 3, row.size, row.size, generator=gen) for _ in range(2)]
    row.bn_reestimated, row.zero_reinit = prepare_untrained(model, row.size, calib)
    sample = torch.randn(1, 3, row.size, row.size, generator=gen)
    start = time.perf_counter()
    try:
        extra = {"act_observer": observer} if observer else {}
        quantizer = Quantizer.for_target("onnxruntime-cpu", **extra)
        qmodel = quantizer.quantize(model, calib)
        if quantizer.report is not None and quantizer.report.float_ops:
            row.no_rule = describe_float_ops(quantizer.report)
        path = export_qdq(qmodel, sample, workdir / f"{name}.onnx", target="onnxruntime-cpu")
    except Exception as exc:
        row.seconds = time.perf_counter() - start
        # the reason, without the spec's parameter dict some messages carry before it
        first = re.sub(r" \(\{.*?\}\)", "", str(exc).strip().splitlines()[0])[:300] if str(exc).strip() else ""
        row.status = f"failed: {type(exc).__name__}" + (f": {first}" if first else "")
        traceback.print_exc()
        return row
    row.seconds = time.perf_counter() - start
    row.n_compute, row.n_float_compute = float_compute_ops(path)
    try:
        row.lsb_literal = compare_logits(qmodel, path, sample).max_lsb
        row.lsb_fused = compare_logits(qmodel, path, sample, optimized=True).max_lsb
    except ValueError as exc:
        row.status = f"LSB not measured: {exc}"
    if round(row.lsb_literal or 0) > 4:  # is it the file, or one rounding flip that the network amplifies?
        from quantship.inspect.run.divergence import trace_divergence

        try:
            trace = trace_divergence(qmodel, path, sample)
            row.local_max, row.local_count = trace.max_local, trace.n_local
            row.n_quantized = sum(r.size for r in trace.rows)
        except ValueError as exc:
            row.status += f"; per-tensor trace not measured: {exc}"
    with torch.no_grad():
        out = qmodel(sample)
    out = torch.as_tensor(out[0] if isinstance(out, (tuple, list)) else out).float()
    scale = next(iter(output_scales(path).values()), None)
    if scale:
        row.out_span_lsb = float(out.max() - out.min()) / scale
    if float(out.max() - out.min()) == 0:  # the check stays whatever the preparation does
        row.status = "ok; LSB vacuous: the output is constant"
    ops = ort_optimized_ops(path)
    row.census = {k: ops[k] for k in CENSUS}
    row.float_in_ort = sum(ops[k] for k in ("Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul"))
    return row


# ---------------------------------------------------------------- records

def head_commit() -> str:
    """HEAD's short hash, with ``+dirty`` when src/ or bench/zoo.py differ from it (what this process runs)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "src", "bench/zoo.py")
    return git("rev-parse", "--short=7", "HEAD") + ("+dirty" if dirty else "")


def load_records(path: Path = RESULTS) -> dict[str, ZooRow]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    names = {f.name for f in fields(ZooRow)}
    return {r["model"]: ZooRow(**{k: v for k, v in r.items() if k in names}) for r in data["records"]}


def save_records(updates: list[ZooRow], order: list[str], path: Path = RESULTS) -> dict[str, ZooRow]:
    """Merge ``updates`` into the file under a lock (re-read first: another run may have saved since)."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = load_records(path)
        records.update({r.model: r for r in updates})
        rank = {m: i for i, m in enumerate(order)}
        ordered = sorted(records.values(), key=lambda r: rank.get(r.model, len(rank)))
        doc = {"version": 1, "generator": "bench/zoo.py", "records": [asdict(r) for r in ordered]}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
    return {r.model: r for r in ordered}


def import_table(md: Path, commit: str, measured: str, observer: str | None) -> list[ZooRow]:
    """Records from the table of an earlier ZOO.md (the format this script wrote before the records file)."""
    rows = []
    for line in md.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 9 + len(CENSUS) or cells[0] in ("model", "---"):
            continue
        model, params, size, compute, lsb = cells[:5]
        census = cells[5:5 + len(CENSUS)]
        in_ort, secs, no_rule, status = cells[5 + len(CENSUS):]

        def num(text: str) -> float | None:
            return None if text == "-" else float(text)
        n_float, n_all = (int(x) for x in compute.split(" / ")) if compute != "-" else (0, 0)
        lit, fused = (num(x) for x in lsb.split(" / "))
        rows.append(ZooRow(
            model, float(params), None if size == "-" else int(size), n_all, n_float, lit, fused,
            None if census[0] == "-" else dict(zip(CENSUS, map(int, census))), 0 if in_ort == "-" else int(in_ort),
            float(secs), "" if no_rule == "-" else no_rule, status, commit, measured, observer))
    return rows


# ---------------------------------------------------------------- ZOO.md

def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _prep(r: ZooRow) -> str:
    if r.bn_reestimated is None:
        return "none (earlier run)" if r.size else "-"
    parts = [f"BN {r.bn_reestimated} re-estimated" if r.bn_reestimated else "as initialised"]
    if r.zero_reinit:
        parts.append(f"{r.zero_reinit} zero weight(s) re-init")
    return ", ".join(parts)


def render(records: dict[str, ZooRow], zoo: list[str]) -> str:
    import onnxruntime as ort
    import torchvision

    from quantship.inspect.run.consumers import cpu_info

    cpu, flags = cpu_info()
    vnni = "VNNI" if {"avx512_vnni", "avx_vnni"} & flags else "no VNNI"
    rows = [records[m] for m in zoo if m in records]
    left_out = [r for r in rows if r.status.startswith("left out")]
    failed = [r for r in rows if r.status.startswith(("failed", "no float forward"))]
    exported = [r for r in rows if r.n_compute]
    full = [r for r in exported if r.n_float_compute == 0]
    vacuous = [r for r in rows if "vacuous" in r.status]
    over = [r for r in exported if round(r.lsb_literal or 0) > 4]  # 4.0000006 is 4 steps
    over_fused = [r for r in exported if round(r.lsb_fused or 0) > 4]
    commits = sorted({r.commit for r in rows}, key=lambda c: min(r.measured_utc for r in rows if r.commit == c))
    times = sorted(r.measured_utc for r in rows if r.measured_utc)
    imported = [r for r in rows if r.bn_reestimated is None and r.size]
    loads = [r.load_avg for r in rows if r.load_avg is not None]
    census = {k: sum((r.census or {}).get(k, 0) for r in rows) for k in CENSUS}
    not_run = [m for m in zoo if m not in records]
    names = ", ".join
    lines = [
        "# torchvision zoo through the onnxruntime-cpu preset", "",
        "Generated by `python bench/zoo.py` from `bench/zoo_results.json` (one record per model, with the commit "
        "and UTC time it was measured at); do not edit by hand.",
        "",
        "Untrained models (`weights=None`, seed 0), batch 1, the smallest square input the float model accepts, "
        "2 random calibration batches, one random sample for the readings. `float compute` counts "
        "Conv/Gemm/MatMul/Einsum of the file that read anything other than DequantizeLinear on their first two "
        "inputs. LSB: max error of the file vs the torch quantized model on the sample, in output LSB, ORT read "
        "literally (optimizations off) / ORT default optimizations; `span`: max - min of that output, in LSB "
        "(how many steps the comparison sees). Census: integer kernels in ORT's optimized graph; `float in "
        "ORT`: Conv/Gemm/MatMul (plain or fused) ORT still runs in float. Time: quantize + export, seconds.",
        "",
        f"Preparation of the untrained model (column `prep`): {PREPARATION}. Why: torchvision's init for "
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
        "`span` says how many output steps the comparison sees.",
        "",
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
        + f"; the rule: more than {GIANT_PARAMS / 1e6:.0f}M parameters (24 GiB machine)",
        f"- failed ({len(failed)}): " + (names(f"{r.model}: {r.status.removeprefix('failed: ')}" for r in failed) or "none"),
        f"- vacuous LSB ({len(vacuous)}): " + (names(r.model for r in vacuous) or "none"),
        f"- not run yet ({len(not_run)}): " + (names(not_run) or "none"),
        "- census totals: " + names(f"{k} {v}" for k, v in census.items()),
        f"- commits measured at: {names(commits)}; {times[0] if times else '-'} .. {times[-1] if times else '-'}"
        + (f". Records with `prep` 'none (earlier run)' ({len(imported)}) were imported once from an earlier "
           "ZOO.md table (commit named in their row), measured by the previous version of this script, "
           "without the preparation" if imported else ""),
        f"- CPU: {cpu} ({vnni}), 2 cores shared by up to 7 engineers: the time column was measured under load "
        f"(1-min load average at the end of each model: "
        f"{f'{min(loads):.1f}..{max(loads):.1f}' if loads else 'not recorded'}), and is no speed figure; "
        f"Python {platform.python_version()}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
        f"onnxruntime {ort.__version__}",
        "",
        "| model | params M | input | prep | float compute / all | LSB literal / fused | span LSB | "
        + " | ".join(CENSUS) + " | float in ORT | time s | load | ops without a rule (module: op) | commit | status |",
        "|---|---|---|---|---|---|---|" + "---|" * len(CENSUS) + "---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.census or {}
        lines.append(
            f"| {r.model} | {r.params_m:.1f} | {r.size or '-'} | {_prep(r)} | "
            f"{f'{r.n_float_compute} / {r.n_compute}' if r.n_compute else '-'} | "
            f"{_fmt(r.lsb_literal)} / {_fmt(r.lsb_fused)} | {_fmt(r.out_span_lsb)} | "
            + " | ".join(str(c.get(k, "-")) for k in CENSUS)
            + f" | {r.float_in_ort if r.census else '-'} | {r.seconds:.0f} | "
            f"{'-' if r.load_avg is None else f'{r.load_avg:.1f}'} | {r.no_rule or '-'} | {r.commit} | {r.status} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import _smoke
    import torchvision

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="re-measure these models only (default: all of the zoo)")
    parser.add_argument("--observer", default=None, help="act_observer override, e.g. minmax (faster calibration)")
    parser.add_argument("--out", type=Path, default=None, help="default: ZOO.md")
    parser.add_argument("--results", type=Path, default=None, help="the records file (default: bench/zoo_results.json)")
    parser.add_argument("--render", action="store_true", help="only render ZOO.md from the records")
    parser.add_argument("--import-md", type=Path, metavar="ZOO_MD", help="import the table of an earlier ZOO.md once")
    parser.add_argument("--import-commit", default="", help="the commit the imported table was measured at")
    args = _smoke.parse_args(parser, argv, models=["resnet18"], observer="minmax")
    args.out = _smoke.output(args, args.out, ROOT / "ZOO.md")
    if args.smoke and args.results is None:
        args.results = args.out.with_name("zoo_results.json")
    args.results = _smoke.output(args, args.results, RESULTS)
    zoo = torchvision.models.list_models(module=torchvision.models)
    if args.import_md:
        text = args.import_md.read_text()
        when = re.search(r"measured (\d{4}-\d\d-\d\d \d\d:\d\d UTC)", text)
        observer = re.search(r"activation observer: (\w+)", text)
        rows = import_table(args.import_md, args.import_commit, when.group(1) if when else "",
                            observer.group(1) if observer else None)
        args.out.write_text(render(save_records(rows, zoo, args.results), zoo))
        print(f"imported {len(rows)} records from {args.import_md}")
        return 0
    if args.render:
        args.out.write_text(render(load_records(args.results), zoo))
        return 0
    chosen = args.models or zoo
    unknown = [m for m in chosen if m not in zoo]
    if unknown:
        parser.error(f"not in torchvision's classification zoo: {unknown}")
    commit = head_commit()
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(chosen):
            print(f"[{i + 1}/{len(chosen)}] {name}", flush=True)
            row = run_model(name, Path(tmp), args.observer)
            row.commit = commit
            row.measured_utc = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            row.load_avg = round(os.getloadavg()[0], 1)
            print(f"    {row}", flush=True)
            args.out.write_text(render(save_records([row], zoo, args.results), zoo))
            (Path(tmp) / f"{name}.onnx").unlink(missing_ok=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
