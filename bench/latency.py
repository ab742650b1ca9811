"""ONNX Runtime CPU latency: FP32 vs each quantship preset vs ONNX Runtime's own quantize_static.

Every file of one (model, batch) case is timed in ONE process, interleaved round by round, after a
warm-up, so the ratios are measured side by side. It also reads what ONNX Runtime really runs
(its optimized graph) and counts the fused kernels. Results go to stdout and to BENCHMARKS.md.

    python bench/latency.py [--models resnet18 mobilenet_v2] [--batches 1 8] [--runs 20]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    model: str
    batch: int
    name: str
    median_ms: float
    min_ms: float
    max_ms: float
    speedup: float
    census: dict
    size_mb: float
    parity: str = ""


def _census(path: Path) -> dict:
    """Count the kernels ONNX Runtime's optimized graph uses for this file."""
    from quantship.inspect.consumers import ort_optimized_ops

    ops = ort_optimized_ops(path)
    convs = ops["QLinearConv"] + ops["Conv"] + ops["FusedConv"]
    return {
        "fused_conv": ops["QLinearConv"], "total_conv": convs, "QGemm": ops["QGemm"],
        "QLinearAdd": ops["QLinearAdd"], "float_Gemm": ops["Gemm"] + ops["FusedGemm"],
    }


def _ort_recipes() -> dict[str, dict]:
    """ONNX Runtime quantize_static settings compared against quantship's presets (all QDQ)."""
    from onnxruntime.quantization import QuantType

    return {
        "defaults": {},
        # ORT's own answer to u8s8 saturation on AVX2
        "u8 per-channel reduce_range": {"per_channel": True, "reduce_range": True},
        "s8": {"activation_type": QuantType.QInt8, "weight_type": QuantType.QInt8, "per_channel": True,
               "extra_options": {"ActivationSymmetric": True, "WeightSymmetric": True}},
    }


def _ort_quantize(fp32: Path, out: Path, calib: list[np.ndarray], recipe: str) -> Path:
    from onnxruntime.quantization import QuantFormat, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from quantship.export.onnx_float import CalibrationReader

    pre = out.with_suffix(".pre.onnx")
    quant_pre_process(str(fp32), str(pre))
    name = onnx.load(str(pre), load_external_data=False).graph.input[0].name
    quantize_static(str(pre), str(out), CalibrationReader(calib, name), quant_format=QuantFormat.QDQ,
                    **_ort_recipes()[recipe])
    return out


def _files_for(model_name: str, batch: int, workdir: Path, calib_batches: int) -> tuple[dict[str, Path], dict[str, str]]:
    import torchvision

    from quantship import Quantizer, export_onnx, export_qdq
    from quantship.inspect.verify import compare_logits
    from quantship.precision import PRESETS

    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(weights=None).eval()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(batch, 3, 224, 224, generator=gen) for _ in range(calib_batches)]
    sample = torch.randn(batch, 3, 224, 224, generator=gen)
    files: dict[str, Path] = {}
    files["FP32"] = export_onnx(model, sample, workdir / f"{model_name}_b{batch}_fp32.onnx", dynamic_batch=False)
    by_graph: dict[str, tuple[list[str], Path, str]] = {}  # identical graphs are timed once
    for p in PRESETS:
        qmodel = Quantizer.for_target(p.target).quantize(model, calib, max_calibration_samples=batch * calib_batches)
        path = export_qdq(qmodel, sample, workdir / f"{model_name}_b{batch}_{p.target}.onnx", target=p.target)
        digest = hashlib.sha256(onnx.load(str(path)).graph.SerializeToString()).hexdigest()
        if digest not in by_graph:
            literal = compare_logits(qmodel, path, sample).max_lsb
            fused = compare_logits(qmodel, path, sample, optimized=True).max_lsb
            by_graph[digest] = ([], path, f"{literal:.0f} / {fused:.0f}")
        by_graph[digest][0].append(p.target)
    parity: dict[str, str] = {}
    for targets, path, lsb in by_graph.values():
        name = "quantship " + " = ".join(targets)
        files[name], parity[name] = path, lsb
    np_calib = [c.numpy() for c in calib]
    for recipe in _ort_recipes():
        files[f"ORT quantize_static {recipe}"] = _ort_quantize(
            files["FP32"], workdir / f"{model_name}_b{batch}_ort_{recipe.replace(' ', '_')}.onnx", np_calib, recipe)
    return files, parity


def _time(files: dict[str, Path], batch: int, runs: int, warmup: int,
          feed: np.ndarray | None = None) -> dict[str, list[float]]:
    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32) if feed is None else feed
    sessions = {}
    for name, path in files.items():
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sessions[name] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feeds = {n: {s.get_inputs()[0].name: x} for n, s in sessions.items()}
    for _ in range(warmup):
        for n, s in sessions.items():
            s.run(None, feeds[n])
    times: dict[str, list[float]] = {n: [] for n in sessions}
    order = list(sessions)
    for r in range(runs):
        for n in order[r % len(order):] + order[:r % len(order)]:  # rotate who goes first
            t0 = time.perf_counter()
            sessions[n].run(None, feeds[n])
            times[n].append((time.perf_counter() - t0) * 1000)
    return times


def _size_mb(path: Path) -> float:
    total = path.stat().st_size
    data = path.with_name(path.name + ".data")
    if data.exists():
        total += data.stat().st_size
    return total / 1e6


def run_case(model_name: str, batch: int, runs: int, warmup: int, workdir: Path, calib_batches: int) -> list[Row]:
    files, parity = _files_for(model_name, batch, workdir, calib_batches)
    times = _time(files, batch, runs, warmup)
    fp32 = float(np.median(times["FP32"]))
    rows = []
    for name, path in files.items():
        t = times[name]
        rows.append(Row(model_name, batch, name, float(np.median(t)), float(np.min(t)), float(np.max(t)),
                        fp32 / float(np.median(t)), _census(path), _size_mb(path), parity.get(name, "")))
    return rows


# -- BERT-style encoder rows ----------------------------------------------------------------------
# A Hugging Face BertModel built from a config (random weights, no download): ENCODER layers, hidden
# size, heads and intermediate size, sequences of ENCODER_SEQ token ids. FP32, the onnxruntime-cpu
# preset, ORT quantize_dynamic (ORT's usual path for transformers) and ORT quantize_static side by side.
ENCODER = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024}
ENCODER_SEQ = 128
ENCODER_VOCAB = 30522


@dataclass
class EncoderRow:
    batch: int
    name: str
    median_ms: float
    min_ms: float
    max_ms: float
    speedup: float
    census: dict
    size_mb: float
    parity: str = ""


def _encoder_model() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=ENCODER_VOCAB, max_position_embeddings=512, **ENCODER)

    class Encoder(torch.nn.Module):
        """input_ids -> last hidden state (one tensor in, one out: what export and timing feed)."""

        def __init__(self):
            super().__init__()
            self.bert = BertModel(config, add_pooling_layer=False)

        def forward(self, input_ids):
            return self.bert(input_ids=input_ids).last_hidden_state

    torch.manual_seed(0)
    return Encoder().eval()


class _IdsReader:
    """ORT calibration reader over int64 token-id batches (the shared CalibrationReader casts to float32)."""

    def __init__(self, batches: list[np.ndarray], name: str):
        self._it, self._name = iter(batches), name

    def get_next(self):
        batch = next(self._it, None)
        return None if batch is None else {self._name: batch}


def _encoder_files(batch: int, workdir: Path, calib_batches: int) -> tuple[dict[str, Path], dict[str, str]]:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from quantship import Quantizer, export_onnx, export_qdq
    from quantship.inspect.verify import compare_logits

    model = _encoder_model()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, ENCODER_VOCAB, (batch, ENCODER_SEQ), generator=gen) for _ in range(calib_batches)]
    sample = torch.randint(0, ENCODER_VOCAB, (batch, ENCODER_SEQ), generator=gen)
    stem = workdir / f"encoder_b{batch}"
    files = {"FP32": export_onnx(model, sample, f"{stem}_fp32.onnx", dynamic_batch=False)}
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, calib, max_calibration_samples=batch * calib_batches)
    files["quantship onnxruntime-cpu"] = export_qdq(qmodel, sample, f"{stem}_qs.onnx", target="onnxruntime-cpu")
    parity = {"quantship onnxruntime-cpu": "{:.0f} / {:.0f}".format(
        compare_logits(qmodel, files["quantship onnxruntime-cpu"], sample).max_lsb,
        compare_logits(qmodel, files["quantship onnxruntime-cpu"], sample, optimized=True).max_lsb)}
    dynamic = Path(f"{stem}_ort_dynamic.onnx")
    quantize_dynamic(str(files["FP32"]), str(dynamic), weight_type=QuantType.QInt8)
    files["ORT quantize_dynamic"] = dynamic
    pre, static = Path(f"{stem}_pre.onnx"), Path(f"{stem}_ort_static.onnx")
    quant_pre_process(str(files["FP32"]), str(pre))
    name = onnx.load(str(pre), load_external_data=False).graph.input[0].name
    quantize_static(str(pre), str(static), _IdsReader([c.numpy() for c in calib], name),
                    quant_format=QuantFormat.QDQ, per_channel=True)
    files["ORT quantize_static"] = static
    return files, parity


def _encoder_census(path: Path) -> dict:
    from quantship.inspect.consumers import ort_optimized_ops

    ops = ort_optimized_ops(path)
    return {k: ops[k] for k in ("QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "MatMulInteger", "QAttention",
                                "DynamicQuantizeMatMul", "MatMul", "FusedMatMul", "Gemm")}


def run_encoder_case(batch: int, runs: int, warmup: int, workdir: Path, calib_batches: int) -> list[EncoderRow]:
    files, parity = _encoder_files(batch, workdir, calib_batches)
    ids = np.random.default_rng(0).integers(0, ENCODER_VOCAB, (batch, ENCODER_SEQ)).astype(np.int64)
    times = _time(files, batch, runs, warmup, feed=ids)
    fp32 = float(np.median(times["FP32"]))
    return [EncoderRow(batch, n, float(np.median(t)), float(np.min(t)), float(np.max(t)), fp32 / float(np.median(t)),
                       _encoder_census(files[n]), _size_mb(files[n]), parity.get(n, "")) for n, t in times.items()]


def _encoder_table(rows: list[EncoderRow]) -> str:
    keys = ["QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "MatMulInteger", "QAttention", "DynamicQuantizeMatMul"]
    lines = ["| batch | file | median ms | min-max ms | speedup vs FP32 | " + " | ".join(keys)
             + " | float MatMul/Gemm | size MB | LSB vs torch (literal / fused) |",
             "|---|---|---|---|---|" + "---|" * len(keys) + "---|---|---|"]
    for r in rows:
        c = r.census
        floats = c["MatMul"] + c["FusedMatMul"] + c["Gemm"]
        lines.append(f"| {r.batch} | {r.name} | {r.median_ms:.1f} | {r.min_ms:.1f}-{r.max_ms:.1f} | {r.speedup:.2f}x | "
                     + " | ".join(str(c[k]) for k in keys) + f" | {floats} | {r.size_mb:.1f} | {r.parity or '-'} |")
    return "\n".join(lines)


def _encoder_section(rows: list[EncoderRow], runs: int, warmup: int) -> list[str]:
    if not rows:
        return []
    shape = ", ".join(f"{k}={v}" for k, v in ENCODER.items())
    return ["## BERT-style encoder", "",
            f"`transformers.BertModel` from a config ({shape}), random weights, sequence length {ENCODER_SEQ},",
            f"random token ids; output: the last hidden state. {warmup} warm-up runs, {runs} interleaved rounds per",
            "batch. Census: the integer kernels in ONNX Runtime's optimized graph.", "",
            _encoder_table(rows), ""]


def _header() -> str:
    import torchao

    import quantship
    from quantship.inspect.consumers import cpu_info

    cpu, flags = cpu_info()

    wanted = ["avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_tile"]
    return "\n".join([
        f"- CPU: {cpu}; {len(__import__('os').sched_getaffinity(0))} cores available",
        f"- CPU flags: {', '.join(f for f in wanted if f in flags) or 'none of ' + ', '.join(wanted)}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, torchao {torchao.__version__}, "
        f"onnx {onnx.__version__}, onnxruntime {ort.__version__}, quantship {quantship.__version__}",
        f"- measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    ])


def _table(rows: list[Row]) -> str:
    lines = ["| model | batch | file | median ms | min-max ms | speedup vs FP32 | fused Conv | QGemm | QLinearAdd "
             "| size MB | LSB vs torch (literal / fused) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.census
        lines.append(
            f"| {r.model} | {r.batch} | {r.name} | {r.median_ms:.1f} | {r.min_ms:.1f}-{r.max_ms:.1f} | "
            f"{r.speedup:.2f}x | {c['fused_conv']}/{c['total_conv']} | {c['QGemm']} | {c['QLinearAdd']} | "
            f"{r.size_mb:.1f} | {r.parity or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--calib-batches", type=int, default=4)
    parser.add_argument("--encoder-batches", nargs="*", type=int, default=[1, 8],
                        help="batches of the BERT-style encoder rows (none: skip them)")
    parser.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args(argv)
    if args.runs < 20:
        print(f"note: --runs {args.runs} is below the 20 interleaved runs the benchmark promises")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models:
            for batch in args.batches:
                print(f"[{model_name} batch {batch}] quantizing, exporting, timing {args.runs} rounds...", flush=True)
                rows += run_case(model_name, batch, args.runs, args.warmup, Path(tmp), args.calib_batches)
                print(_table([r for r in rows if r.model == model_name and r.batch == batch]), flush=True)
        encoder_rows: list[EncoderRow] = []
        for batch in args.encoder_batches:
            print(f"[BERT-style encoder batch {batch}] quantizing, exporting, timing {args.runs} rounds...", flush=True)
            encoder_rows += run_encoder_case(batch, args.runs, args.warmup, Path(tmp), args.calib_batches)
            print(_encoder_table([r for r in encoder_rows if r.batch == batch]), flush=True)
    text = "\n".join([
        "# Benchmarks", "",
        "Generated by `python bench/latency.py`; do not edit by hand. ONNX Runtime CPU execution provider,",
        "default session options; untrained torchvision models (`weights=None`, seed 0) at 224x224,",
        f"random calibration ({args.calib_batches} batches). Each (model, batch) case: {args.warmup} warm-up",
        f"runs, then {args.runs} interleaved rounds in one process; median and min-max per file. `fused Conv`",
        "counts QLinearConv over all convolutions in ONNX Runtime's optimized graph. `LSB vs torch`: max error",
        "of the file against the torch quantized model on the sample batch, in output LSB, with ORT's",
        "optimizations off (the file read literally) and on (the fused integer kernels).", "",
        _header(), "", _table(rows), "",
        *_encoder_section(encoder_rows, args.runs, args.warmup),
    ])
    args.out.write_text(text)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
