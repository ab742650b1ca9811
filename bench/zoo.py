"""The model zoo through the onnxruntime-cpu preset, by family; results in zoo_results.json, tables in ZOO.md.

Families (bench/_zoo_families.py): ``torchvision`` (its classification zoo, ``weights=None``), ``timm`` (issue
29's architectures, when timm is installed), ``hf`` (transformers models from small configs), ``detection`` (the
torchvision detectors issue 29 names). For every model: for the image classifiers the smallest square input its
float forward accepts among SIZES and the same preparation of the untrained model (see ``prepare_untrained``);
quantize with ``Quantizer.for_target('onnxruntime-cpu')``, export with ``target='onnxruntime-cpu'``, then read
the file: Conv/Gemm/MatMul that still read a float input, error vs the torch quantized model in output LSB (ORT
literal and ORT default optimizations), ONNX Runtime's integer-kernel census, and the time spent, split into
stages by a timing hook (``_zoo_families.StageTimes``). Models above GIANT_PARAMS parameters are listed as left
out.

Each model's result is one record of bench/zoo_results.json (with its family, the commit and UTC time it was
measured at), saved as soon as the model is done; ``--models`` re-measures only those records and ZOO.md is
always rendered from every record (one table per family), so partial runs merge and an interrupted run keeps
what it measured.

    python bench/zoo.py --observer minmax                     # the torchvision zoo
    python bench/zoo.py --family hf                           # the Hugging Face family (the preset's observer)
    python bench/zoo.py --observer minmax --models resnet18 vit_b_16
    python bench/zoo.py --render                              # ZOO.md from the records only
    python bench/zoo.py --smoke [--family F] [--out FILE] [--results FILE]  # one small model of the family,
                                                              # into a fresh records file and table (bench/_smoke.py)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
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
from _zoo_families import FAMILIES, Entry, StageTimes, available, entries

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
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
    family: str = "torchvision"
    input_shape: str = ""  # the sample's shape where the input is not a square image (hf)
    stages: dict | None = None  # seconds per stage (_zoo_families.StageTimes); None on records from before
    cpu: str = ""  # the CPU the record was measured on ("" on records from before it was kept)
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


IMAGE_FAMILIES = ("torchvision", "timm")  # the square-image classifiers the preparation is for


def run_model(entry: Entry, family: str, workdir: Path, observer: str | None) -> ZooRow:
    from quantship import Quantizer, export_qdq
    from quantship.inspect import compare_logits, ort_optimized_ops, output_scales
    from quantship.quantize import describe_float_ops

    name = entry.name
    torch.manual_seed(0)
    try:
        model = entry.build()
    except Exception as exc:  # the library cannot build this config here: the record says so, the run goes on
        traceback.print_exc()
        return ZooRow(name, 0.0, family=family, observer=observer,
                      status=f"not built: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}")
    row = ZooRow(name, sum(p.numel() for p in model.parameters()) / 1e6, family=family, observer=observer)
    if row.params_m * 1e6 > GIANT_PARAMS:
        row.status = f"left out: {row.params_m:.0f}M parameters (> {GIANT_PARAMS / 1e6:.0f}M on this machine)"
        return row
    gen = torch.Generator().manual_seed(1)
    if entry.make_input is None:
        row.size = entry.size or smallest_size(model)
        if row.size is None:
            row.status = f"no float forward at any of {SIZES}"
            return row
        make = lambda g: torch.randn(1, 3, row.size, row.size, generator=g)  # noqa: E731
    else:
        make = entry.make_input
    calib = [make(gen) for _ in range(2)]
    if family in IMAGE_FAMILIES:
        row.bn_reestimated, row.zero_reinit = prepare_untrained(model, row.size, calib)
    sample = make(gen)
    if entry.make_input is not None:
        row.input_shape = "x".join(map(str, sample.shape)) + ("" if sample.is_floating_point() else " ids")
    stages = StageTimes()
    start = time.perf_counter()
    try:
        extra = {"act_observer": observer} if observer else {}
        with stages.hooked():
            quantizer = Quantizer.for_target("onnxruntime-cpu", **extra)
            qmodel = quantizer.quantize(model, calib)
            if quantizer.report is not None and quantizer.report.float_ops:
                row.no_rule = describe_float_ops(quantizer.report)
            path = export_qdq(qmodel, sample, workdir / f"{name}.onnx", target="onnxruntime-cpu")
    except Exception as exc:
        row.seconds = time.perf_counter() - start
        row.stages = stages.as_dict()
        # the reason, without the spec's parameter dict some messages carry before it
        first = re.sub(r" \(\{.*?\}\)", "", str(exc).strip().splitlines()[0])[:300] if str(exc).strip() else ""
        row.status = f"failed: {type(exc).__name__}" + (f": {first}" if first else "")
        traceback.print_exc()
        return row
    row.seconds = time.perf_counter() - start
    row.stages = stages.as_dict()
    row.n_compute, row.n_float_compute = float_compute_ops(path)
    try:
        row.lsb_literal = compare_logits(qmodel, path, sample).max_lsb
        row.lsb_fused = compare_logits(qmodel, path, sample, optimized=True).max_lsb
    except ValueError as exc:
        row.status = f"LSB not measured: {exc}"
    if round(row.lsb_literal or 0) > 4:  # is it the file, or one rounding flip that the network amplifies?
        from quantship.inspect import trace_divergence

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


def load_records(path: Path = RESULTS) -> dict[tuple[str, str], ZooRow]:
    """The records by (family, model): two families may hold a model of the same name (efficientnet_b0)."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    names = {f.name for f in fields(ZooRow)}
    rows = [ZooRow(**{k: v for k, v in r.items() if k in names}) for r in data["records"]]
    return {(r.family, r.model): r for r in rows}


def save_records(updates: list[ZooRow], order: list[tuple[str, str]], path: Path = RESULTS
                 ) -> dict[tuple[str, str], ZooRow]:
    """Merge ``updates`` into the file under a lock (re-read first: another run may have saved since)."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = load_records(path)
        records.update({(r.family, r.model): r for r in updates})
        rank = {key: i for i, key in enumerate(order)}
        ordered = sorted(records.values(), key=lambda r: rank.get((r.family, r.model), len(rank)))
        doc = {"version": 1, "generator": "bench/zoo.py", "records": [asdict(r) for r in ordered]}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
    return {(r.family, r.model): r for r in ordered}


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


SMOKE_MODELS = {"torchvision": "resnet18", "timm": "resnet18d", "hf": "bert", "detection": "ssdlite320_mobilenet_v3_large"}


def zoos() -> dict[str, list[str]]:
    """Every family's models, in table order."""
    return {f: [e.name for e in entries(f)] for f in FAMILIES}


def render_all(records: dict[tuple[str, str], ZooRow]) -> str:
    from _zoo_render import render

    unavailable = {f: why for f in FAMILIES if (why := available(f)) is not None}
    return render(records, zoos(), unavailable, census_keys=CENSUS, giant_params=GIANT_PARAMS,
                  preparation=PREPARATION)


def main(argv: list[str] | None = None) -> int:
    import _smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="torchvision", help="the family to measure")
    parser.add_argument("--models", nargs="*", help="re-measure these models only (default: all of the family)")
    parser.add_argument("--observer", default=None, help="act_observer override, e.g. minmax (faster calibration)")
    parser.add_argument("--out", type=Path, default=None, help="default: ZOO.md")
    parser.add_argument("--results", type=Path, default=None, help="the records file (default: bench/zoo_results.json)")
    parser.add_argument("--render", action="store_true", help="only render ZOO.md from the records")
    parser.add_argument("--import-md", type=Path, metavar="ZOO_MD", help="import the table of an earlier ZOO.md once")
    parser.add_argument("--import-commit", default="", help="the commit the imported table was measured at")
    args = _smoke.parse_args(parser, argv, observer="minmax")
    if args.smoke and not args.models:
        args.models = [SMOKE_MODELS[args.family]]
    args.out = _smoke.output(args, args.out, ROOT / "ZOO.md")
    if args.smoke and args.results is None:
        args.results = args.out.with_name("zoo_results.json")
    args.results = _smoke.output(args, args.results, RESULTS)
    order = [(f, m) for f, names in zoos().items() for m in names]
    if args.import_md:
        text = args.import_md.read_text()
        when = re.search(r"measured (\d{4}-\d\d-\d\d \d\d:\d\d UTC)", text)
        observer = re.search(r"activation observer: (\w+)", text)
        rows = import_table(args.import_md, args.import_commit, when.group(1) if when else "",
                            observer.group(1) if observer else None)
        args.out.write_text(render_all(save_records(rows, order, args.results)))
        print(f"imported {len(rows)} records from {args.import_md}")
        return 0
    if args.render:
        args.out.write_text(render_all(load_records(args.results)))
        return 0
    missing = available(args.family)
    if missing is not None:
        print(f"zoo.py: --family {args.family} cannot run here: {missing}", file=sys.stderr)
        return 2
    family = {e.name: e for e in entries(args.family)}
    chosen = args.models or list(family)
    unknown = [m for m in chosen if m not in family]
    if unknown:
        parser.error(f"not in the {args.family} family: {unknown} (its models: {', '.join(family)})")
    from quantship.inspect import cpu_info

    commit = head_commit()
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(chosen):
            print(f"[{i + 1}/{len(chosen)}] {args.family} {name}", flush=True)
            row = run_model(family[name], args.family, Path(tmp), args.observer)
            row.commit = commit
            row.measured_utc = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            row.load_avg = round(os.getloadavg()[0], 1)
            row.cpu = cpu_info()[0]
            print(f"    {row}", flush=True)
            args.out.write_text(render_all(save_records([row], order, args.results)))
            (Path(tmp) / f"{name}.onnx").unlink(missing_ok=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
