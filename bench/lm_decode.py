"""Decode speed of decoder files (export/decoder.py): prefill and per-token latency, tokens per second.

For each model, decoder files (KV cache, any batch and length) are written FP32, INT8 (per output channel),
INT4 in groups of 32 and 128 (quantship: torchao weights as com.microsoft MatMulNBits), and ONNX Runtime's own
``MatMulNBitsQuantizer`` INT4 file made from the FP32 decoder file (symmetric, the same blocks). Each
MatMulNBits file runs at ``accuracy_level`` 0 (float activations, the attribute's default) and 4 (int8
activations), written on its nodes. Timed: a prefill of ``--prompt`` tokens, and one decode step (one new token
per row) after a cache of ``--contexts`` tokens, at batch 1 and 4. ONNX Runtime, 1 intra-op and 1 inter-op
thread, each run timed by the calling thread's CPU time, the files interleaved round after round, median.

Models: the trained byte-level Llama (``quantship.examples.lm``; its held-out perplexity is measured through the
file too) and a Llama built from a config with random weights, large enough that decoding one token reads
hundreds of MB of float weights (memory-bound).

    python bench/lm_decode.py [--models byte,big] [--out bench/lm_decode_results.md]
    python bench/lm_decode.py --smoke [--out FILE]   # a tiny untrained Llama, one round (bench/_smoke.py)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

# the memory-bound model: a Llama with grouped-query attention, 123.7 M parameters (495 MB float32)
BIG = dict(vocab_size=16384, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
           num_key_value_heads=4, max_position_embeddings=2048)
SMOKE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=128)
BATCHES = (1, 4)


def build(name: str):
    """(torch model, description) for ``byte``, ``big`` or ``smoke``."""
    import torch
    import transformers

    from quantship.examples import lm

    if name == "byte":
        return lm.trained_model(), "trained byte-level Llama (quantship.examples.lm), 4 layers, hidden 256"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(BIG if name == "big" else SMOKE), tie_word_embeddings=False,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in model.parameters())
    return model, (f"Llama from a config, random weights: {config.num_hidden_layers} layers, hidden "
                   f"{config.hidden_size}, vocabulary {config.vocab_size}, {params / 1e6:.1f} M parameters "
                   f"({4 * params / 1e6:.0f} MB float32)")


def _with_accuracy_level(path: Path, level: int) -> Path:
    import onnx_ir as ir

    from quantship.export import set_accuracy_level

    model = ir.load(str(path))
    set_accuracy_level(model, level)
    out = path.with_name(f"{path.stem}_acc{level}.onnx")
    ir.save(model, str(out))
    return out


def prefills(layout, ids) -> list[dict]:
    """Token windows [N, T] as the decoder file's calibration feeds: prefills from an empty cache, batches of 8."""
    from quantship.export import prefill_feed

    return [prefill_feed(ids[i:i + 8], layout) for i in range(0, len(ids), 8)]


def calibration_windows(name: str, vocab: int, n: int = 32, length: int = 64):
    """The W8A8 file's calibration: windows of the training files for the trained byte model, random ids else."""
    import numpy as np

    rng = np.random.default_rng(1)
    if name != "byte":
        return rng.integers(0, vocab, (n, length)).astype(np.int64)
    from quantship.examples import lm

    stream = np.concatenate(lm.load_corpus().train)
    return np.stack([stream[s:s + length] for s in rng.integers(0, len(stream) - length, n)]).astype(np.int64)


def write_files(model, folder: Path, groups: tuple[int, ...], log, calibration) -> list[tuple[str, str, Path]]:
    """(label, accuracy level, path) of every file timed: FP32, quantship INT8/INT4 and W8A8, ORT's INT4."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from quantship import Quantizer, quant_spec, targets
    from quantship.export import export_decoder, read_layout
    from quantship.quantize_onnx import quantize_onnx_file

    nbits = targets.get("onnxruntime-cpu")
    fp32 = export_decoder(model, folder / "fp32.onnx")
    files = [("FP32", "-", fp32)]
    log("FP32 decoder written")
    for method, group in [("int8_weight_only", None)] + [("int4_weight_only", g) for g in groups]:
        kwargs = {} if group is None else {"group_size": group}
        q = Quantizer("torchao", method=method, **kwargs).quantize(_copy(model), None)
        label = "quantship INT8 per channel" if group is None else f"quantship INT4 g{group}"
        path = export_decoder(q, folder / f"{method}_{group}.onnx", spec=quant_spec(q), target=nbits)
        del q
        gc.collect()
        files += [(label, "0", path), (label, "4", _with_accuracy_level(path, 4))]
        log(f"{label} written")
    path = folder / "w8a8.onnx"  # W8A8 static: the FP32 decoder file through the ONNX engine, as --decoder writes it
    quantize_onnx_file(fp32, path, calibration=prefills(read_layout(fp32), calibration), target="onnxruntime-cpu")
    files.append(("quantship W8A8 static", "-", path))
    log("W8A8 static written")
    for group in groups:
        quantizer = MatMulNBitsQuantizer(onnx.load(str(fp32)), bits=4, block_size=group, is_symmetric=True)
        quantizer.process()
        path = folder / f"ort_int4_{group}.onnx"
        quantizer.model.save_model_to_file(str(path), use_external_data_format=False)
        del quantizer
        gc.collect()
        files += [(f"ORT MatMulNBitsQuantizer INT4 g{group}", "0", path), (f"ORT MatMulNBitsQuantizer INT4 g{group}",
                                                                           "4", _with_accuracy_level(path, 4))]
        log(f"ORT INT4 g{group} written")
    return files


def _copy(model):
    import copy

    return copy.deepcopy(model)


def feed(layout, batch: int, past: int, new: int, seed: int = 0) -> dict:
    import numpy as np

    from quantship.export import ATTENTION_MASK, INPUT_IDS, PAST_KEY, PAST_VALUE

    rng = np.random.default_rng(seed)
    out = {INPUT_IDS: rng.integers(0, layout.vocab, (batch, new)).astype(np.int64),
           ATTENTION_MASK: np.ones((batch, past + new), np.int64)}
    for i in range(layout.layers):
        for name in (PAST_KEY, PAST_VALUE):
            out[name % i] = rng.standard_normal((batch, layout.kv_heads, past, layout.head_dim)).astype(np.float32)
    return out


def interleaved_ms(sessions: list, inputs: dict, rounds: int, budget_s: float) -> list[float]:
    """Median thread-CPU ms of each session on ``inputs``, the sessions run in turn, round after round."""
    for s in sessions:
        s.run(None, inputs)  # warm-up
    samples: list[list[float]] = [[] for _ in sessions]
    start = time.perf_counter()
    for r in range(rounds):
        for i, s in enumerate(sessions):
            t = time.thread_time()
            s.run(None, inputs)
            samples[i].append((time.thread_time() - t) * 1e3)
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    return [statistics.median(x) for x in samples]


def perplexity_of(path: Path, windows) -> float:
    """Held-out perplexity through the file: each window one prefill from an empty cache."""
    from quantship.examples import lm
    from quantship.export import onnx_session, prefill_feed, read_layout

    layout = read_layout(path)
    session = onnx_session(path)

    def logits(ids):
        return session.run(None, prefill_feed(ids, layout))[0]
    return lm.perplexity(lm.file_nll(logits, windows)).value


def measure(name: str, args, log) -> list[str]:
    import os

    from quantship.export import onnx_session, read_layout

    model, description = build(name)
    lines = [f"## {name}: {description}", ""]
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(model, Path(tmp), args.groups, log,
                            calibration_windows(name, int(model.config.vocab_size) if hasattr(model, "config") else 256))
        del model
        gc.collect()
        layout = read_layout(files[0][2])
        sessions = [onnx_session(p) for _, _, p in files]
        cells: dict[str, list[float]] = {}
        for batch in BATCHES:
            key = f"prefill {args.prompt}, b{batch}"
            cells[key] = interleaved_ms(sessions, feed(layout, batch, 0, args.prompt), args.rounds, args.budget)
            log(f"{key}: {[round(x, 1) for x in cells[key]]}")
            for context in args.contexts:
                key = f"decode @{context}, b{batch}"
                cells[key] = interleaved_ms(sessions, feed(layout, batch, context, 1), args.rounds, args.budget)
                log(f"{key}: {[round(x, 2) for x in cells[key]]}")
        order_lines = order_check(files, layout, args, log) if args.order_check else []
        ppl = None
        if name == "byte":
            from quantship.examples import lm

            windows = lm.eval_windows(lm.load_corpus(), per_file=1)
            ppl = [perplexity_of(p, windows) for _, _, p in files]
        sizes = [os.path.getsize(p) / 1e6 for _, _, p in files]
        del sessions
    keys = list(cells)
    head = ["file", "accuracy_level", "MB"] + [f"{k} ms" for k in keys] + \
           [f"tokens/s b{b} @{c} (x FP32)" for b in BATCHES for c in args.contexts] + (["perplexity"] if ppl else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, (label, level, _) in enumerate(files):
        row = [label, level, f"{sizes[i]:.1f}"] + [f"{cells[k][i]:.2f}" for k in keys]
        for b in BATCHES:
            for c in args.contexts:
                step = cells[f"decode @{c}, b{b}"]
                row.append(f"{1e3 * b / step[i]:.1f} ({step[0] / step[i]:.2f}x)")
        if ppl:
            row.append(f"{ppl[i]:.4f}")
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""] + order_lines


ORDERS = (("quantship", "ORT", "quantship'", "ORT'"), ("ORT", "quantship", "ORT'", "quantship'"))


def order_check(files, layout, args, log) -> list[str]:
    """quantship's and ORT's INT4 files at level 4, each in two sessions (the second marked '), timed interleaved in
    both orders: how far one file's two sessions differ beside how far the two files do."""
    from quantship.export import onnx_session

    lines = []
    for group in args.groups:
        pick = {label.split(" INT4")[0].split(" ")[0]: p for label, level, p in files if level == "4" and f"INT4 g{group}" in label}
        paths = {"quantship": pick["quantship"], "ORT": pick["ORT"]}
        lines += [f"### Order check, INT4 g{group}, accuracy_level 4, decode @{args.contexts[0]}", "",
                  "Each file in two sessions (the second marked '), the four timed interleaved in the order shown "
                  f"(up to {args.rounds} rounds or {args.budget:.0f} s), then the other order.", "",
                  "| batch | order | ms each (same order) | quantship / ORT, first sessions | same file, ' / first (max) |",
                  "|---|---|---|---|---|"]
        for batch in BATCHES:
            inputs = feed(layout, batch, args.contexts[0], 1)
            for order in ORDERS:
                sessions = [onnx_session(paths[k.rstrip("'")]) for k in order]
                ms = dict(zip(order, interleaved_ms(sessions, inputs, args.rounds, args.budget)))
                del sessions
                gc.collect()
                spread = max(ms[f"{k}'"] / ms[k] for k in paths)
                lines.append(f"| {batch} | {' , '.join(order)} | {', '.join(f'{ms[k]:.3f}' for k in order)} | "
                             f"{ms['quantship'] / ms['ORT']:.3f} | {spread:.3f} |")
                log(lines[-1])
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    import _smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="byte,big", help="comma-separated: byte, big")
    parser.add_argument("--groups", default="32,128", help="INT4 group sizes")
    parser.add_argument("--prompt", type=int, default=128, help="prefill length")
    parser.add_argument("--contexts", default="128,1024", help="cache lengths before the timed decode step")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds at most per cell")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of timing at most per cell")
    parser.add_argument("--order-check", action="store_true",
                        help="also time quantship's and ORT's INT4 level-4 files in two sessions each, in both orders")
    parser.add_argument("--out", type=Path, default=None)
    args = _smoke.parse_args(parser, argv, models="smoke", groups="32", prompt=16, contexts="16,64", rounds=1, budget=1.0)
    args.out = _smoke.output(args, args.out, ROOT / "bench" / "lm_decode_results.md")
    args.groups = tuple(int(g) for g in args.groups.split(","))
    args.contexts = tuple(int(c) for c in args.contexts.split(","))

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    lines = _smoke.cpu_lines("Decode speed of decoder files (KV cache), FP32 vs weight-only INT8 / INT4") + \
        _smoke.banner(args) + [
        "ONNX Runtime CPU, 1 intra-op and 1 inter-op thread, default graph optimizations; each run timed by the "
        "calling thread's CPU time, all files interleaved round after round, median "
        f"(up to {args.rounds} rounds or {args.budget:.0f} s per cell). Prefill: {args.prompt} tokens per row from "
        "an empty cache. Decode: one new token per row after a cache of the given length (@N). tokens/s = batch / "
        "decode step time. accuracy_level: MatMulNBits' attribute (0: float activations; 4: activations "
        "quantized to int8 per block). ORT MatMulNBitsQuantizer: onnxruntime.quantization's own INT4 file, "
        "made from the FP32 decoder file, symmetric, same block size. Random weights measure speed only.", ""]
    for name in args.models.split(","):
        lines += measure(name, args, log)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
