"""ONNX Runtime CPU latency: FP32 vs each quantship preset vs ONNX Runtime's own quantize_static.

Every file of one (model, batch) case is timed in ONE process, interleaved round by round, after a
warm-up, so the ratios are measured side by side. It also reads what ONNX Runtime really runs
(its optimized graph) and counts the fused kernels. Results go to stdout and to BENCHMARKS.md.

The same files (one symbolic-batch file per preset, FP32 and ORT's) are timed at every batch size.

    python bench/latency.py [--models resnet18 mobilenet_v2] [--batches 1 8] [--runs 20]
    python bench/latency.py --smoke [--out FILE]   # every section once, tiny models (bench/_smoke.py)
    python bench/latency.py --encoder-thread-time  # the encoder's forms, 1 ORT thread, thread CPU time (printed)
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import sys
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
sys.path.insert(0, str(Path(__file__).resolve().parent))


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
    sqnr_db: float | None = None  # the encoder rows: output against the FP32 file's on the timing input


def _census(path: Path) -> dict:
    """Count the kernels ONNX Runtime's optimized graph uses for this file."""
    from quantship.inspect import ort_optimized_ops

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

    from quantship.export import CalibrationReader

    pre = out.with_suffix(".pre.onnx")
    quant_pre_process(str(fp32), str(pre))
    name = onnx.load(str(pre), load_external_data=False).graph.input[0].name
    quantize_static(str(pre), str(out), CalibrationReader(calib, name), quant_format=QuantFormat.QDQ,
                    **_ort_recipes()[recipe])
    return out


CALIB_BATCH = 8  # calibration batch; the files it gives serve every timed batch (tigris: batch 1 only)


def _files_for(model_name: str, workdir: Path, calib_batches: int, size: int = 224
               ) -> tuple[dict[str, Path], dict[str, object]]:
    """Every file of one model, written once: FP32 and ORT's files (any batch), quantship's presets."""
    import torchvision

    from quantship import PRESETS, Quantizer, export_onnx, export_qdq

    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(weights=None).eval()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(CALIB_BATCH, 3, size, size, generator=gen) for _ in range(calib_batches)]
    files: dict[str, Path] = {}
    files["FP32"] = export_onnx(model, calib[0], workdir / f"{model_name}_fp32.onnx", dynamic_batch=True)
    by_graph: dict[str, tuple[list[str], Path, object]] = {}  # identical graphs are timed once
    for p in PRESETS:
        qmodel = Quantizer.for_target(p.target).quantize(model, calib, max_calibration_samples=CALIB_BATCH * calib_batches)
        path = export_qdq(qmodel, calib[0], workdir / f"{model_name}_{p.target}.onnx", target=p.target)
        digest = hashlib.sha256(onnx.load(str(path)).graph.SerializeToString()).hexdigest()
        by_graph.setdefault(digest, ([], path, qmodel))[0].append(p.target)
    qmodels: dict[str, object] = {}
    for targets, path, qmodel in by_graph.values():
        name = "quantship " + " = ".join(targets)
        files[name], qmodels[name] = path, qmodel
    np_calib = [c.numpy() for c in calib]
    for recipe in _ort_recipes():
        files[f"ORT quantize_static {recipe}"] = _ort_quantize(
            files["FP32"], workdir / f"{model_name}_ort_{recipe.replace(' ', '_')}.onnx", np_calib, recipe)
    return files, qmodels


def _serves(path: Path, batch: int) -> bool:
    """Whether the file's input takes ``batch`` (a symbolic batch dimension takes any)."""
    dim = onnx.load(str(path), load_external_data=False).graph.input[0].type.tensor_type.shape.dim[0]
    return not dim.HasField("dim_value") or dim.dim_value == batch


def _parity(qmodel: object, path: Path, batch: int, size: int = 224) -> str:
    from quantship.inspect import compare_logits

    sample = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(2))
    literal = compare_logits(qmodel, path, sample).max_lsb
    fused = compare_logits(qmodel, path, sample, optimized=True).max_lsb
    return f"{literal:.0f} / {fused:.0f}"


def _time(files: dict[str, Path], batch: int, runs: int, warmup: int, size: int = 224,
          feed: np.ndarray | None = None) -> dict[str, list[float]]:
    x = np.random.default_rng(0).standard_normal((batch, 3, size, size)).astype(np.float32) if feed is None else feed
    from quantship.inspect import ort_session

    sessions = {name: ort_session(path, optimized=True) for name, path in files.items()}
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


def run_case(model_name: str, batches: list[int], runs: int, warmup: int, workdir: Path,
             calib_batches: int, size: int = 224) -> list[Row]:
    """The same files timed at every batch size (a static file only at its own batch)."""
    files, qmodels = _files_for(model_name, workdir, calib_batches, size)
    rows = []
    for batch in batches:
        usable = {name: path for name, path in files.items() if _serves(path, batch)}
        times = _time(usable, batch, runs, warmup, size)
        fp32 = float(np.median(times["FP32"]))
        for name, path in usable.items():
            t = times[name]
            parity = _parity(qmodels[name], path, batch, size) if name in qmodels else ""
            rows.append(Row(model_name, batch, name, float(np.median(t)), float(np.min(t)), float(np.max(t)),
                            fp32 / float(np.median(t)), _census(path), _size_mb(path), parity))
        print(_table([r for r in rows if r.batch == batch]), flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# Language-model rows (weight-only): the reference byte-level Llama of quantship.examples.lm.


@dataclass
class LMRow:
    name: str
    median_ms: float
    min_ms: float
    max_ms: float
    speedup: float
    size_mb: float
    error: float  # max |ORT - torch reference| / max |torch reference|, ORT defaults
    error_float_acts: float  # the same with session.qdq_matmulnbits_accuracy_level=0
    reference: str


def _lm_files(workdir: Path, ids: torch.Tensor, model: torch.nn.Module | None = None
              ) -> tuple[dict[str, Path], dict[str, tuple[float, str]]]:
    """FP32, quantship's W8A16 / W4A16 files in both forms, ORT's MatMulNBitsQuantizer on the same FP32 file."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from quantship import Quantizer, export_onnx, export_qdq
    from quantship.examples import lm
    from quantship.inspect import ort_session, relative_error, run_session

    if model is None:
        model = lm.trained_model(log=lambda m: print(f"  training the reference LM: {m}", flush=True))
    with torch.no_grad():
        reference = {"FP32": model(ids).numpy()}
    files: dict[str, Path] = {"FP32": export_onnx(model, ids, workdir / "lm_fp32.onnx", dynamic_batch=False)}
    refs = {"FP32": "FP32"}
    for label, kwargs in [("W8A16", dict(method="int8_weight_only")),
                          ("W4A16 g32", dict(method="int4_weight_only", group_size=32)),
                          ("W4A16 g128", dict(method="int4_weight_only", group_size=128))]:
        qmodel = Quantizer("torchao", **kwargs).quantize(model)
        with torch.no_grad():
            reference[label] = qmodel(ids).numpy()
        tag = label.replace(" ", "_")
        files[f"quantship {label} DequantizeLinear"] = export_qdq(qmodel, ids, workdir / f"lm_{tag}.onnx")
        files[f"quantship {label} MatMulNBits"] = export_qdq(qmodel, ids, workdir / f"lm_{tag}_nbits.onnx",
                                                            target="onnxruntime-cpu")
        refs[f"quantship {label} DequantizeLinear"] = refs[f"quantship {label} MatMulNBits"] = label
    for bits, block in [(8, 128), (4, 32), (4, 128)]:
        name = f"ORT MatMulNBitsQuantizer {bits}-bit block {block} symmetric"
        quantizer = MatMulNBitsQuantizer(onnx.load(str(files["FP32"])), bits=bits, block_size=block, is_symmetric=True)
        quantizer.process()
        out = workdir / f"lm_ort_{bits}_{block}.onnx"
        quantizer.model.save_model_to_file(str(out), False)
        files[name], refs[name] = out, "FP32"
    feed = [ids.numpy()]
    checks = {}
    for name, path in files.items():
        got = run_session(ort_session(path, optimized=True), feed)[0]
        so = ort.SessionOptions()  # float activations where ORT would fuse DequantizeLinear + MatMul itself
        so.log_severity_level = 3
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        float_acts = session.run(None, {session.get_inputs()[0].name: feed[0]})[0]
        checks[name] = (relative_error(got, reference[refs[name]]), relative_error(float_acts, reference[refs[name]]),
                        refs[name])
    return files, checks


def lm_rows(runs: int, warmup: int, workdir: Path, seq_len: int = 128,
            model: torch.nn.Module | None = None) -> list[LMRow]:
    """Latency of one forward over ``seq_len`` tokens at batch 1, file size, and error vs the torch model."""
    from quantship.examples import lm

    corpus = lm.load_corpus()
    ids = torch.from_numpy(corpus.held_out[0][:seq_len].astype(np.int64))[None]
    files, checks = _lm_files(workdir, ids, model)
    times = _time(files, 1, runs, warmup, feed=ids.numpy())
    fp32 = float(np.median(times["FP32"]))
    return [LMRow(n, float(np.median(t)), float(np.min(t)), float(np.max(t)), fp32 / float(np.median(t)),
                  _size_mb(files[n]), *checks[n]) for n, t in times.items()]


def _lm_table(rows: list[LMRow]) -> str:
    fp32 = next(r.size_mb for r in rows if r.name == "FP32")
    lines = ["| file | median ms | min-max ms | speedup vs FP32 | size MB | smaller than FP32 | error vs torch "
             "(reference) | same, float activations |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.median_ms:.2f} | {r.min_ms:.2f}-{r.max_ms:.2f} | {r.speedup:.2f}x | "
                     f"{r.size_mb:.2f} | {fp32 / r.size_mb:.2f}x | {r.error:.1e} ({r.reference}) | "
                     f"{r.error_float_acts:.1e} |")
    return "\n".join(lines)


def _header() -> str:
    import torchao

    import quantship
    from quantship.inspect import cpu_info

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


# ---------------------------------------------------------------------------------------------
# U8U8: 8-bit weights stored as uint8 with zero-point 128, which ONNX Runtime runs with u8 x u8
# kernels (no int16 pair saturation), against the 7-bit onnxruntime-cpu preset. Same activations
# (uint8 affine) in every file; the rewrite of the weights is exact (checked: identical literal run).


def u8u8_weights(src: Path, dst: Path) -> int:
    """Copy ``src`` to ``dst`` with every symmetric int8 weight of a DequantizeLinear stored as
    uint8 = w + 128 with zero-point 128 (the same real values); returns how many were rewritten."""
    from onnx import numpy_helper

    model = onnx.load(str(src))
    inits = {t.name: t for t in model.graph.initializer}
    n = 0
    for node in model.graph.node:
        weight = inits.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if weight is None or weight.data_type != onnx.TensorProto.INT8:
            continue
        w = numpy_helper.to_array(weight).astype(np.int16)
        scale = numpy_helper.to_array(inits[node.input[1]])
        zp = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 and node.input[2] else np.zeros(1)
        if np.any(zp != 0):
            continue  # only symmetric weights have an exact uint8 twin at zero-point 128
        weight.CopyFrom(numpy_helper.from_array((w + 128).astype(np.uint8), weight.name))
        zp_name = f"{weight.name}__zp_u8"
        model.graph.initializer.append(numpy_helper.from_array(np.full(scale.shape, 128, np.uint8), zp_name))
        if len(node.input) > 2:
            node.input[2] = zp_name
        else:
            node.input.append(zp_name)
        n += 1
    onnx.save(model, str(dst))
    return n


@dataclass
class U8U8Row:
    model: str
    name: str
    median_ms: float
    speed_vs_7bit: float
    census: dict
    literal_lsb: float  # vs the torch model the file was made from
    fused_lsb: float
    fp32_lsb: float  # fused run vs the float torch model: what the weight precision costs


def u8u8_case(model_name: str, batch: int, runs: int, warmup: int, workdir: Path, size: int = 224) -> list[U8U8Row]:
    """The 7-bit preset, 8-bit int8 weights, and their U8U8 twin: speed (interleaved) and error."""
    import torchvision

    from quantship import Quantizer, export_onnx, export_qdq
    from quantship.inspect import compare_logits, lsb_error, ort_session, output_scales, run_session

    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(weights=None).eval()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(batch, 3, size, size, generator=gen) for _ in range(4)]
    sample = torch.randn(batch, 3, size, size, generator=gen)
    stem = f"{model_name}_b{batch}_{size}"
    files = {"FP32": export_onnx(model, sample, workdir / f"{stem}_fp32.onnx", dynamic_batch=False)}
    seven = Quantizer.for_target("onnxruntime-cpu").quantize(model, calib, max_calibration_samples=4 * batch)
    eight = Quantizer(backend="pt2e", symmetric=False, reduce_range=False).quantize(
        model, calib, max_calibration_samples=4 * batch)
    files["7-bit s8 weights (onnxruntime-cpu preset)"] = export_qdq(
        seven, sample, workdir / f"{stem}_7bit.onnx", target="onnxruntime-cpu")
    files["8-bit s8 weights"] = export_qdq(eight, sample, workdir / f"{stem}_8bit.onnx", activation_dtype="uint8")
    u8 = workdir / f"{stem}_u8u8.onnx"
    n = u8u8_weights(files["8-bit s8 weights"], u8)
    x = [sample.numpy()]
    same = [a.tobytes() == b.tobytes() for a, b in zip(run_session(ort_session(files["8-bit s8 weights"]), x),
                                                       run_session(ort_session(u8), x))]
    if not all(same) or n == 0:
        raise RuntimeError(f"the U8U8 rewrite is not exact ({n} weights rewritten)")
    files[f"8-bit u8 weights, zero-point 128 (U8U8, {n} weights)"] = u8
    times = _time(files, batch, runs, warmup, size)
    with torch.no_grad():
        fp32_out = model(sample).numpy()
    seven_ms = float(np.median(times["7-bit s8 weights (onnxruntime-cpu preset)"]))
    rows = []
    for name, path in files.items():
        if name == "FP32":
            continue
        qmodel = seven if name.startswith("7-bit") else eight
        scale = next(iter(output_scales(path).values()))
        fused = run_session(ort_session(path, optimized=True), x)[0]
        ms = float(np.median(times[name]))
        rows.append(U8U8Row(model_name, name, ms, seven_ms / ms, _census(path),
                            compare_logits(qmodel, path, sample).max_lsb,
                            compare_logits(qmodel, path, sample, optimized=True).max_lsb,
                            lsb_error(fp32_out, fused, scale).max_lsb))
    fp32_ms = float(np.median(times["FP32"]))
    rows.insert(0, U8U8Row(model_name, "FP32", fp32_ms, seven_ms / fp32_ms, _census(files["FP32"]), 0, 0, 0))
    return rows


def u8u8_table(rows: list[U8U8Row]) -> str:
    lines = ["| model | file | median ms | speed vs 7-bit preset | fused Conv | QGemm | LSB vs torch INT8 (literal / "
             "fused) | LSB vs torch FP32 (fused) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.census
        lines.append(f"| {r.model} | {r.name} | {r.median_ms:.1f} | {r.speed_vs_7bit:.2f}x | "
                     f"{c['fused_conv']}/{c['total_conv']} | {c['QGemm']} | "
                     f"{'-' if r.name == 'FP32' else f'{r.literal_lsb:.1f} / {r.fused_lsb:.1f}'} | "
                     f"{'-' if r.name == 'FP32' else f'{r.fp32_lsb:.1f}'} |")
    return "\n".join(lines)


# -- BERT-style encoder rows ----------------------------------------------------------------------
# A Hugging Face BertModel built from a config (random weights, no download): ENCODER's layers, hidden
# size, heads and intermediate size, sequences of ENCODER.seq token ids. FP32, the onnxruntime-cpu
# preset, ORT quantize_dynamic (ORT's usual path for transformers) and ORT quantize_static side by side.


@dataclass(frozen=True)
class EncoderShape:
    config: dict  # BertConfig's layers, hidden size, heads, intermediate size
    seq: int
    vocab: int


ENCODER = EncoderShape({"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
                        "intermediate_size": 1024}, seq=128, vocab=30522)
# two layers: export_onnx's file of a one-layer BertModel is refused by ONNX Runtime at its default
# optimizations ("Attempt to replace the existing tensor"); two layers and more load
SMOKE_ENCODER = EncoderShape({"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                              "intermediate_size": 64}, seq=16, vocab=128)


def _encoder_model(shape: EncoderShape = ENCODER) -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=shape.vocab, max_position_embeddings=512, **shape.config)

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


def _encoder_files(batch: int, workdir: Path, calib_batches: int, shape: EncoderShape = ENCODER
                   ) -> tuple[dict[str, Path], dict[str, str]]:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from quantship import Quantizer, export_onnx, export_qdq
    from quantship.inspect import compare_logits

    model = _encoder_model(shape)
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, shape.vocab, (batch, shape.seq), generator=gen) for _ in range(calib_batches)]
    sample = torch.randint(0, shape.vocab, (batch, shape.seq), generator=gen)
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
    # quantship's own dynamic-activation form of the same FP32 file, data-free (`--activations dynamic`)
    from quantship.quantize_onnx import quantize_dynamic_file

    files["quantship quantize-onnx --activations dynamic"] = quantize_dynamic_file(
        files["FP32"], f"{stem}_qs_onnx_dynamic.onnx", run_check=False).path
    pre, static = Path(f"{stem}_pre.onnx"), Path(f"{stem}_ort_static.onnx")
    quant_pre_process(str(files["FP32"]), str(pre))
    name = onnx.load(str(pre), load_external_data=False).graph.input[0].name
    quantize_static(str(pre), str(static), _IdsReader([c.numpy() for c in calib], name),
                    quant_format=QuantFormat.QDQ, per_channel=True)
    files["ORT quantize_static"] = static
    # quantship's ONNX quantizer on the same FP32 file, as `quantize-onnx` runs it; then the same with the
    # attention's two activation x activation MatMuls per layer kept float (--exclude), the faster form at batch 1
    from quantship.quantize_onnx import quantize_onnx_file

    ids = [c.numpy() for c in calib]
    files["quantship quantize-onnx"] = quantize_onnx_file(files["FP32"], f"{stem}_qs_onnx.onnx", ids,
                                                          target="onnxruntime-cpu", run_check=False).path
    fp32 = onnx.load(str(files["FP32"]))
    stored = {t.name for t in fp32.graph.initializer}
    attention = [n.name for n in fp32.graph.node if n.op_type == "MatMul" and not stored.intersection(n.input)]
    files["quantship quantize-onnx, attention float"] = quantize_onnx_file(
        files["FP32"], f"{stem}_qs_onnx_attention_float.onnx", ids, target="onnxruntime-cpu", exclude=attention,
        run_check=False).path
    return files, parity


def _encoder_census(path: Path) -> dict:
    from quantship.inspect import ort_optimized_ops

    ops = ort_optimized_ops(path)
    return {k: ops[k] for k in ("QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "MatMulInteger", "QAttention",
                                "DynamicQuantizeMatMul", "MatMul", "FusedMatMul", "Gemm")}


def run_encoder_case(batch: int, runs: int, warmup: int, workdir: Path, calib_batches: int,
                     shape: EncoderShape = ENCODER) -> list[Row]:
    files, parity = _encoder_files(batch, workdir, calib_batches, shape)
    ids = np.random.default_rng(0).integers(0, shape.vocab, (batch, shape.seq)).astype(np.int64)
    times = _time(files, batch, runs, warmup, feed=ids)
    fp32 = float(np.median(times["FP32"]))
    from quantship import output_sqnr_db as sqnr_db
    from quantship.inspect import ort_session

    sessions = {n: ort_session(p, optimized=True) for n, p in files.items()}
    outputs = {n: s.run(None, {s.get_inputs()[0].name: ids})[0] for n, s in sessions.items()}
    return [Row("encoder", batch, n, float(np.median(t)), float(np.min(t)), float(np.max(t)), fp32 / float(np.median(t)),
                _encoder_census(files[n]), _size_mb(files[n]), parity.get(n, ""),
                None if n == "FP32" else sqnr_db(outputs["FP32"], outputs[n])) for n, t in times.items()]


def _encoder_table(rows: list[Row]) -> str:
    keys = ["QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "MatMulInteger", "QAttention", "DynamicQuantizeMatMul"]
    lines = ["| batch | file | median ms | min-max ms | speedup vs FP32 | " + " | ".join(keys)
             + " | float MatMul/Gemm | size MB | LSB vs torch (literal / fused) | SQNR vs FP32 (dB) |",
             "|---|---|---|---|---|" + "---|" * len(keys) + "---|---|---|---|"]
    for r in rows:
        c = r.census
        floats = c["MatMul"] + c["FusedMatMul"] + c["Gemm"]
        lines.append(f"| {r.batch} | {r.name} | {r.median_ms:.1f} | {r.min_ms:.1f}-{r.max_ms:.1f} | {r.speedup:.2f}x | "
                     + " | ".join(str(c[k]) for k in keys) + f" | {floats} | {r.size_mb:.1f} | {r.parity or '-'} | "
                     + ("-" if r.sqnr_db is None else f"{r.sqnr_db:.1f}") + " |")
    return "\n".join(lines)


def _encoder_section(rows: list[Row], runs: int, warmup: int, shape: EncoderShape = ENCODER) -> list[str]:
    if not rows:
        return []
    config = ", ".join(f"{k}={v}" for k, v in shape.config.items())
    return ["## BERT-style encoder", "",
            f"`transformers.BertModel` from a config ({config}), random weights, sequence length {shape.seq},",
            f"random token ids; output: the last hidden state. {warmup} warm-up runs, {runs} interleaved rounds per",
            "batch. Census: the integer kernels in ONNX Runtime's optimized graph. `quantship onnxruntime-cpu`: the",
            "PyTorch path (`Quantizer.for_target` + `export_qdq`); `quantship quantize-onnx`: quantship's ONNX",
            "quantizer on the FP32 file; `attention float`: the same with the attention's activation x activation",
            "MatMuls (two per layer) excluded, every projection still an integer kernel; `--activations dynamic`:",
            "quantship's ONNX quantizer writing int8 per-column weights and run-time activation quantization",
            "(DynamicQuantizeLinear -> MatMulInteger, the word table int8; data-free), as ORT `quantize_dynamic`",
            "does. SQNR: each file's output against the FP32 file's on the timing input (ORT default optimizations).",
            "",
            _encoder_table(rows), ""]


THREAD_TIME_FILES = ("FP32", "quantship onnxruntime-cpu", "quantship quantize-onnx", "ORT quantize_dynamic",
                     "quantship quantize-onnx --activations dynamic")


def encoder_thread_time(batches: list[int], workdir: Path, calib_batches: int, shape: EncoderShape = ENCODER,
                        rounds: int | None = None) -> str:
    """The encoder's files with one ORT thread, each run timed by the thread's CPU time (steady on a shared
    machine), interleaved; median per file, and the per-round ratio of ORT quantize_dynamic's time to
    quantship's dynamic form's. ``rounds``: per batch (default 150 at batch 1, 30 above)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    lines = ["| batch | rounds | " + " | ".join(THREAD_TIME_FILES) + " | quantize_dynamic / dynamic form, per round |",
             "|---" * (len(THREAD_TIME_FILES) + 3) + "|"]
    for batch in batches:
        files, _ = _encoder_files(batch, workdir, calib_batches, shape)
        sessions = {k: ort.InferenceSession(str(files[k]), options, providers=["CPUExecutionProvider"])
                    for k in THREAD_TIME_FILES}
        feed = {sessions["FP32"].get_inputs()[0].name:
                np.random.default_rng(0).integers(0, shape.vocab, (batch, shape.seq)).astype(np.int64)}
        seconds = {k: [] for k in sessions}
        n = rounds or (150 if batch == 1 else 30)
        for _ in range(n + 1):  # the first round warms up and is dropped
            for k, session in sessions.items():
                start = time.thread_time()
                session.run(None, feed)
                seconds[k].append(time.thread_time() - start)
        seconds = {k: np.array(v[1:]) for k, v in seconds.items()}
        fp32 = float(np.median(seconds["FP32"]))
        cells = [f"{fp32 * 1e3:.2f} ms"] + [f"{fp32 / float(np.median(seconds[k])):.2f}x" for k in THREAD_TIME_FILES[1:]]
        ratio = np.median(seconds["ORT quantize_dynamic"] / seconds["quantship quantize-onnx --activations dynamic"])
        lines.append(f"| {batch} | {n} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import _smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--encoder-batches", nargs="*", type=int, default=[1, 8],
                        help="batches of the BERT-style encoder rows (none: skip them)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--calib-batches", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="default: BENCHMARKS.md")
    parser.add_argument("--u8u8", action="store_true", help="only the U8U8 vs 7-bit comparison (printed)")
    parser.add_argument("--size", type=int, default=224, help="input size (torchvision models, and --u8u8)")
    parser.add_argument("--lm", action="store_true", help="add the language-model (weight-only) rows")
    parser.add_argument("--lm-only", action="store_true", help="only the language-model rows")
    parser.add_argument("--encoder-thread-time", action="store_true",
                        help="only the encoder's files, one ORT thread, thread CPU time (printed): 150 rounds at "
                             "batch 1, 30 above")
    # smoke: one model at 32x32, a tiny encoder and a tiny untrained LM, one round each, all sections written
    args = _smoke.parse_args(parser, argv, models=["resnet18"], size=32, batches=[1, 2], encoder_batches=[1],
                             runs=1, warmup=0, calib_batches=1, lm=True)
    args.out = _smoke.output(args, args.out, ROOT / "BENCHMARKS.md")
    encoder = SMOKE_ENCODER if args.smoke else ENCODER
    lm_model, lm_tokens = (_smoke.tiny_lm(), _smoke.LM_TOKENS) if args.smoke else (None, 128)
    if args.u8u8:
        with tempfile.TemporaryDirectory() as tmp:
            for model_name in args.models:
                for batch in args.batches:
                    rows = u8u8_case(model_name, batch, args.runs, args.warmup, Path(tmp), args.size)
                    print(u8u8_table(rows), flush=True)
        return 0
    if args.encoder_thread_time:
        with tempfile.TemporaryDirectory() as tmp:
            print(encoder_thread_time(args.encoder_batches, Path(tmp), args.calib_batches, encoder,
                                      rounds=1 if args.smoke else None), flush=True)
        return 0
    if args.lm_only:
        args.models, args.lm = [], True
    if args.runs < 20:
        print(f"note: --runs {args.runs} is below the 20 interleaved runs the benchmark promises")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models:
            print(f"[{model_name}] quantizing and exporting once, timing each file at batch "
                  f"{', '.join(map(str, args.batches))} ({args.runs} rounds)...", flush=True)
            rows += run_case(model_name, args.batches, args.runs, args.warmup, Path(tmp), args.calib_batches,
                             args.size)
        encoder_rows: list[Row] = []
        for batch in ([] if args.lm_only else args.encoder_batches):
            print(f"[BERT-style encoder batch {batch}] quantizing, exporting, timing {args.runs} rounds...", flush=True)
            encoder_rows += run_encoder_case(batch, args.runs, args.warmup, Path(tmp), args.calib_batches, encoder)
            print(_encoder_table([r for r in encoder_rows if r.batch == batch]), flush=True)
    text = "\n".join([
        "# Benchmarks", "", *_smoke.banner(args),
        "Generated by `python bench/latency.py`; do not edit by hand. ONNX Runtime CPU execution provider,",
        f"default session options; untrained torchvision models (`weights=None`, seed 0) at {args.size}x{args.size},",
        f"random calibration ({args.calib_batches} batches of {CALIB_BATCH}). Each model's files are written once",
        "with a symbolic batch (FP32, ORT's, the quantship presets; tigris is a static batch-1 file) and the",
        f"same files are timed at every batch size. Each (model, batch) case: {args.warmup} warm-up",
        f"runs, then {args.runs} interleaved rounds in one process; median and min-max per file. `fused Conv`",
        "counts QLinearConv over all convolutions in ONNX Runtime's optimized graph. `LSB vs torch`: max error",
        "of the file against the torch quantized model on the sample batch, in output LSB, with ORT's",
        "optimizations off (the file read literally) and on (the fused integer kernels).", "",
        _header(), "", _table(rows), "",
        *_encoder_section(encoder_rows, args.runs, args.warmup, encoder),
    ])
    if args.lm_only:
        text = "\n".join(["# Benchmarks", "", *_smoke.banner(args),
                          "Generated by `python bench/latency.py --lm-only`; do not edit by hand.", "", ""])
    if args.lm:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"[reference LM, {lm_tokens} tokens, batch 1] quantizing, exporting, timing {args.runs} rounds...",
                  flush=True)
            lm_table = _lm_table(lm_rows(args.runs, args.warmup, Path(tmp), lm_tokens, lm_model))
        print(lm_table, flush=True)
        text += "\n".join([
            "## Language model, weight-only", "",
            "The reference byte-level Llama (`quantship.examples.lm`: 4 layers, hidden 256, trained on the",
            f"standard library's sources), one forward pass over {lm_tokens} held-out tokens at batch 1, ORT default",
            "optimizations. Error: max |ORT - torch| / max |torch| on that input, against the torch model the",
            "file comes from (the torch weight-only model for quantship's files, FP32 for ORT's quantizer).", "",
            _header(), "", lm_table, "",
        ])
    args.out.write_text(text)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
