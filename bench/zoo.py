"""torchvision's classification zoo through the onnxruntime-cpu preset; writes ZOO.md.

For every model of ``torchvision.models.list_models(module=torchvision.models)`` (``weights=None``,
the smallest square input its float forward accepts among SIZES): quantize with
``Quantizer.for_target('onnxruntime-cpu')``, export with ``target='onnxruntime-cpu'``, then read the
file: Conv/Gemm/MatMul that still read a float input, error vs the torch quantized model in output
LSB (ORT literal and ORT default optimizations), ONNX Runtime's integer-kernel census, and the
time spent. Models above GIANT_PARAMS parameters are listed as left out. ZOO.md is rewritten after
every model, so an interrupted run keeps what it measured.

    python bench/zoo.py                       # the whole zoo (about an hour on a quiet machine)
    python bench/zoo.py --models resnet18 vit_b_16 swin_t
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
SIZES = (32, 64, 96, 128, 160, 224, 299)
GIANT_PARAMS = 300e6
COMPUTE_OPS = {"Conv", "Gemm", "MatMul", "Einsum"}
CENSUS = ("QLinearConv", "QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "QAttention")


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


def run_model(name: str, workdir: Path, observer: str | None) -> ZooRow:
    import torchvision

    from quantship import Quantizer, export_qdq
    from quantship.inspect.consumers import ort_optimized_ops
    from quantship.inspect.verify import compare_logits
    from quantship.quantize.pt2e import describe_float_ops

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).eval()
    row = ZooRow(name, sum(p.numel() for p in model.parameters()) / 1e6)
    if row.params_m * 1e6 > GIANT_PARAMS:
        row.status = f"left out: {row.params_m:.0f}M parameters (> {GIANT_PARAMS / 1e6:.0f}M on this machine)"
        return row
    row.size = smallest_size(model)
    if row.size is None:
        row.status = f"no float forward at any of {SIZES}"
        return row
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(1, 3, row.size, row.size, generator=gen) for _ in range(2)]
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
        row.status = f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:240]}" if str(exc).strip() \
            else f"failed: {type(exc).__name__}"
        traceback.print_exc()
        return row
    row.seconds = time.perf_counter() - start
    row.n_compute, row.n_float_compute = float_compute_ops(path)
    try:
        row.lsb_literal = compare_logits(qmodel, path, sample).max_lsb
        row.lsb_fused = compare_logits(qmodel, path, sample, optimized=True).max_lsb
    except ValueError as exc:
        row.status = f"LSB not measured: {exc}"
    with torch.no_grad():
        out = qmodel(sample)
    if float(torch.as_tensor(out[0] if isinstance(out, (tuple, list)) else out).float().std()) == 0:
        row.status = "ok; LSB vacuous: the output is constant (untrained head initialised at zero)"
    ops = ort_optimized_ops(path)
    row.census = {k: ops[k] for k in CENSUS}
    row.float_in_ort = sum(ops[k] for k in ("Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul"))
    return row


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render(rows: list[ZooRow], not_run: list[str], observer: str | None) -> str:
    import onnxruntime as ort
    import torchvision

    from quantship.inspect.consumers import cpu_info

    cpu, flags = cpu_info()
    vnni = "VNNI" if {"avx512_vnni", "avx_vnni"} & flags else "no VNNI"
    done = [r for r in rows if r.status.startswith(("ok", "LSB"))]
    full = [r for r in done if r.n_float_compute == 0]
    lines = [
        "# torchvision zoo through the onnxruntime-cpu preset", "",
        "Generated by `python bench/zoo.py`; do not edit by hand. Untrained models (`weights=None`, seed 0),",
        "batch 1, the smallest square input the float model accepts, 2 random calibration batches,",
        f"activation observer: {observer or 'the preset default'}. `float compute` counts Conv/Gemm/MatMul",
        "(and Einsum) of the file that read anything other than DequantizeLinear on their first two inputs. LSB: max error of",
        "the file vs the torch quantized model on one sample, in output LSB, ORT read literally (optimizations",
        "off) / ORT default optimizations. Census: integer kernels in ORT's optimized graph; `float in ORT`:",
        "Conv/Gemm/MatMul (plain or fused) that ORT still runs in float. Time: quantize + export, seconds.",
        "",
        f"- CPU: {cpu} ({vnni}); Python {platform.python_version()}, torch {torch.__version__}, torchvision "
        f"{torchvision.__version__}, onnxruntime {ort.__version__}",
        f"- measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {len(full)} of {len(done)} exported "
        f"models fully INT8 in the file",
        "",
        "| model | params M | input | float compute / all | LSB literal / fused | "
        + " | ".join(CENSUS) + " | float in ORT | time s | ops without a rule (module: op) | status |",
        "|---|---|---|---|---|" + "---|" * len(CENSUS) + "---|---|---|---|",
    ]
    for r in rows:
        census = r.census or {}
        lines.append(
            f"| {r.model} | {r.params_m:.1f} | {r.size or '-'} | "
            f"{f'{r.n_float_compute} / {r.n_compute}' if r.n_compute else '-'} | "
            f"{_fmt(r.lsb_literal)} / {_fmt(r.lsb_fused)} | "
            + " | ".join(str(census.get(k, "-")) for k in CENSUS)
            + f" | {r.float_in_ort if r.census else '-'} | {r.seconds:.0f} | {r.no_rule or '-'} | {r.status} |")
    if not_run:
        lines += ["", f"Not run in this invocation ({len(not_run)}): " + ", ".join(not_run)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import torchvision

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="a subset of the zoo (default: all of it)")
    parser.add_argument("--observer", default=None, help="act_observer override, e.g. minmax (faster calibration)")
    parser.add_argument("--out", type=Path, default=ROOT / "ZOO.md")
    args = parser.parse_args(argv)
    zoo = torchvision.models.list_models(module=torchvision.models)
    chosen = args.models or zoo
    unknown = [m for m in chosen if m not in zoo]
    if unknown:
        parser.error(f"not in torchvision's classification zoo: {unknown}")
    rows: list[ZooRow] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(chosen):
            print(f"[{i + 1}/{len(chosen)}] {name}", flush=True)
            row = run_model(name, Path(tmp), args.observer)
            rows.append(row)
            print(f"    {row}", flush=True)
            args.out.write_text(render(rows, [m for m in zoo if m not in chosen], args.observer))
            (Path(tmp) / f"{name}.onnx").unlink(missing_ok=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
