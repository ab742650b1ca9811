"""torchvision segmentation through the onnxruntime-cpu preset: every output of the dict exported and read.

For ``lraspp_mobilenet_v3_large`` (one output, ``out``), ``deeplabv3_mobilenet_v3_large`` and
``fcn_resnet50`` (``aux_loss=True``: ``out`` and ``aux``), ``weights=None``, seed 0, a small square
input (SIZE): the model is prepared as bench/zoo.py prepares an untrained model (``prepare_untrained``,
its rule read on every output), quantized with ``Quantizer.for_target('onnxruntime-cpu')``,
exported with ``target='onnxruntime-cpu'``; then read off the file: Conv/Gemm/MatMul that read a
float input, Q/DQ counts (``qdq_stats``), each output's error vs the torch quantized model in its own
output LSB (the export's readings: ORT literal and ORT default optimizations) and its span in LSB,
ORT's integer-kernel census. Records go to bench/segmentation_results.json (one per model, merged
across runs), the table to ZOO-segmentation.md.

    python bench/segmentation.py                                  # the three models
    python bench/segmentation.py --models lraspp_mobilenet_v3_large
    python bench/segmentation.py --render                         # the table from the records only
    python bench/segmentation.py --smoke [--out FILE]             # lraspp at 32 px into a scratch table
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
RESULTS = ROOT / "bench" / "segmentation_results.json"
TABLE = ROOT / "ZOO-segmentation.md"
MODELS = ("lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large", "fcn_resnet50")
SIZE = 64
CENSUS = ("QLinearConv", "QGemm", "QLinearMatMul")
FLOAT_IN_ORT = ("Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul")


class AllOutputs(torch.nn.Module):
    """Every output of a segmentation model flattened into one tensor, for bench/zoo.py's preparation
    (which reads one output tensor); shares the model's modules, so its BatchNorms are the model's."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return torch.cat([t.flatten() for t in self.model(x).values()])


def run_model(name: str, workdir: Path, size: int) -> dict:
    import torchvision
    from zoo import float_compute_ops, prepare_untrained

    from quantship import Quantizer, export_qdq
    from quantship.inspect.read.stats import qdq_stats
    from quantship.inspect.run.consumers import ort_optimized_ops
    from quantship.inspect.run.outputs import flatten_outputs

    torch.manual_seed(0)
    extra = {} if name.startswith("lraspp") else {"aux_loss": True}
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None, **extra).eval()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(1, 3, size, size, generator=gen) for _ in range(2)]
    bn, reinit = prepare_untrained(AllOutputs(model), size, calib)
    sample = torch.randn(1, 3, size, size, generator=gen)
    row: dict = {"model": name, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                 "size": size, "prep": f"BN {bn} re-estimated" if bn else "as initialised", "zero_reinit": reinit}
    start = time.perf_counter()
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, calib)
    row["quantize_s"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    path = export_qdq(qmodel, sample, workdir / f"{name}.onnx", target="onnxruntime-cpu")
    row["export_s"] = round(time.perf_counter() - start, 1)
    row["n_compute"], row["n_float_compute"] = float_compute_ops(path)
    stats = qdq_stats(path)
    row["n_quantize"], row["n_dequantize"], row["n_per_channel"] = stats.n_quantize, stats.n_dequantize, stats.n_per_channel
    readings = path.readings
    with torch.no_grad():
        leaves = dict(flatten_outputs(qmodel(sample)))
    per_output = readings.per_output or {next(iter(leaves)): readings}  # one output: the top-level reading
    row["outputs"] = [
        {"name": out, "shape": list(leaves[out].shape), "scale": r.scale, "literal_lsb": r.literal_lsb,
         "fused_lsb": r.fused_lsb, "span_lsb": round(float(leaves[out].max() - leaves[out].min()) / r.scale, 1)
         if r.scale else None}
        for out, r in per_output.items()]
    ops = ort_optimized_ops(path)
    row["census"] = {k: ops[k] for k in CENSUS}
    row["float_in_ort"] = sum(ops[k] for k in FLOAT_IN_ORT)
    row["load_1min"] = round(os.getloadavg()[0], 1)
    row["measured_utc"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return row


def render(records: dict[str, dict], banner: list[str] | None = None) -> str:
    sizes = sorted({r["size"] for r in records.values()}) or [SIZE]
    lines = [
        *(banner or []),
        "# torchvision segmentation through the onnxruntime-cpu preset",
        "",
        "Generated by `python bench/segmentation.py` from `bench/segmentation_results.json`; do not edit by hand. "
        "(A file of its own: ZOO.md is rendered whole by bench/zoo.py.)",
        "",
        f"Untrained models (`weights=None`, seed 0; `aux_loss=True` for DeepLabV3 and FCN, whose forward then "
        f"returns `out` and `aux`), batch 1, {' / '.join(f'{n} x {n}' for n in sizes)} input, 2 random calibration images, one random "
        "sample; prepared as ZOO.md says (`prep`), its rule read on every output. Each output of the dict is a "
        "graph output named after its key; LSB: max error of that output vs the torch quantized model on the "
        "sample, in that output's own step, as `export_qdq` reads it (ORT literal, optimizations off / ORT "
        "default optimizations); `span`: max - min of the output, in its LSB. `float compute`: Conv/Gemm/MatMul "
        "of the file reading anything other than DequantizeLinear on their first two inputs. Census: integer "
        "kernels in ORT's optimized graph; `float in ORT`: Conv/Gemm/MatMul (plain or fused) ORT still runs in "
        "float. Times in seconds, measured under the load given (1-min load average at the end of the model): "
        "no speed figure.",
        "",
        "| model | params M | prep | float compute / all | Q / DQ (per-channel) | output | shape | LSB literal / "
        "fused | span LSB | QLinearConv | QGemm | float in ORT | quantize s | export s | load | commit, UTC |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def lsb(x):
        return "n/a" if x is None else f"{x:.0f}"

    for name in MODELS:
        r = records.get(name)
        if r is None:
            lines.append(f"| {name} | not run yet |" + " |" * 14)
            continue
        for i, out in enumerate(r["outputs"]):
            head = (f"| {name} | {r['params_m']} | {r['prep']} | {r['n_float_compute']} / {r['n_compute']} | "
                    f"{r['n_quantize']} / {r['n_dequantize']} ({r['n_per_channel']}) |") if i == 0 else "| | | | | |"
            tail = (f" {r['census']['QLinearConv']} | {r['census']['QGemm']} | {r['float_in_ort']} | "
                    f"{r['quantize_s']} | {r['export_s']} | {r['load_1min']} | {r['commit']}, "
                    f"{r['measured_utc']} |") if i == 0 else " | | | | | | |"
            lines.append(f"{head} {out['name']} | {'x'.join(map(str, out['shape']))} | "
                         f"{lsb(out['literal_lsb'])} / {lsb(out['fused_lsb'])} | {out['span_lsb']} |{tail}")
    cpus = sorted({r.get("cpu", "?") for r in records.values()})
    lines += ["", f"CPU: {'; '.join(cpus) or '?'}; 2 cores shared with other developers' runs (hence the load "
              f"column). Python {platform.python_version()}, torch {torch.__version__}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import _smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--size", type=int, default=SIZE, help=f"square input side (default {SIZE})")
    parser.add_argument("--out", type=Path, default=None, help=f"default: {TABLE.name}")
    parser.add_argument("--results", type=Path, default=None, help=f"the records (default: bench/{RESULTS.name})")
    parser.add_argument("--render", action="store_true", help="only render the table from the records")
    args = _smoke.parse_args(parser, argv, models=["lraspp_mobilenet_v3_large"], size=32)
    _smoke.record_models(args, "bench/segmentation.py", TABLE, RESULTS, lambda model, tmp: run_model(model, tmp, args.size), render)


if __name__ == "__main__":
    main()
