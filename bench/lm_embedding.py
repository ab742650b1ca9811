"""The token embedding in low bits: perplexity, file size and decode time of decoder files with the embedding table
quantized (``quantize_embedding=True``) or float.

Trained models: the reference byte-level Llama (``quantship.examples.lm``, its LM head untied) and the same
architecture trained with its head tied to the embedding (``llama_tied``). Each is written FP32, INT8 per channel,
INT4 in groups of 32 and of 128, the weight-only ones with the embedding float and quantized, as MatMulNBits
decoder files (the command line's form and accuracy levels: INT8 4, INT4 0) and in the standard DequantizeLinear
form (size only). Held-out perplexity through each MatMulNBits file (one prefill per 128-byte window, as
bench/lm_decode.py) and through the torch weight-only model; the embedding's cost is the paired ratio of the
quantized-embedding file to the float-embedding one (same windows, bootstrap over files).

A third model, random weights, a tied Llama config where the table dominates (vocabulary 32,000, hidden 512,
2 layers), gives the sizes and one decode step's time (batch 1 after a 128-token cache, 1 ONNX Runtime thread,
default session, thread CPU time, files interleaved, median) in both forms.

    python bench/lm_embedding.py [--per-file 2] [--out bench/lm_embedding_results.md]
    python bench/lm_embedding.py --smoke [--out FILE]   # tiny untrained models (bench/_smoke.py)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

# the table-dominated model (random weights): sizes and decode time only
WIDE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=512)
SMOKE_WIDE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128)
PRECISIONS = (("INT8", dict(method="int8_weight_only")), ("INT4 g32", dict(method="int4_weight_only", group_size=32)),
              ("INT4 g128", dict(method="int4_weight_only", group_size=128)))


def write(model, folder: Path, stem: str, **quantize) -> dict:
    """``{"MatMulNBits": path, "DequantizeLinear": path, "torch": quantized model}`` for ``model`` quantized with
    ``quantize`` (FP32 if empty: one file, no torch entry)."""
    from quantship import Quantizer, quant_spec, targets
    from quantship.export import export_decoder

    if not quantize:
        path = export_decoder(model, folder / f"{stem}.onnx")
        return {"MatMulNBits": path, "DequantizeLinear": path}
    q = Quantizer("torchao", **quantize).quantize(model, None)
    level = 4 if quantize["method"] == "int8_weight_only" else None  # the command line's default levels
    return {"MatMulNBits": export_decoder(q, folder / f"{stem}_nbits.onnx", spec=quant_spec(q),
                                         target=targets.get("onnxruntime-cpu"), accuracy_level=level),
            "DequantizeLinear": export_decoder(q, folder / f"{stem}_dq.onnx", spec=quant_spec(q)), "torch": q}


def file_rows(path: Path, windows):
    """Per-file (nll, count) through the decoder file: each window one prefill from an empty cache."""
    import numpy as np

    from quantship.examples import lm
    from quantship.export import onnx_session, read_layout

    layout = read_layout(path)
    session = onnx_session(path)
    empty = {f"past_key_values.{i}.{kv}": np.zeros((1, layout.kv_heads, 0, layout.head_dim), np.float32)
             for i in range(layout.layers) for kv in ("key", "value")}

    def logits(ids):
        return session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids), **empty})[0]
    return lm.file_nll(logits, windows)


def trained(name: str, smoke: bool, log):
    """The trained model ``name`` (``llama`` or ``llama_tied``); in a smoke run the same architecture, tiny and
    untrained."""
    from quantship.examples import lm

    if smoke:
        import torch

        torch.manual_seed(0)
        return lm.build_model(hidden=128, layers=1, heads=2, intermediate=256, tied=name == "llama_tied")
    return lm.trained_model(architecture=name, log=log)


def perplexity_table(args, log) -> list[str]:
    from quantship.examples import lm

    corpus = lm.load_corpus()
    windows = lm.eval_windows(corpus, per_file=args.per_file)[:args.files]
    lines = [f"Held-out: {len(windows)} files, {sum(len(w) for w in windows)} windows of {lm.SEQ_LEN} bytes. Perplexity "
             "per byte [bootstrap 95% interval over files]; changes are paired ratios [95% interval].", "",
             "| model | precision | embedding | MatMulNBits MB | DequantizeLinear MB | perplexity (MatMulNBits file) | "
             "vs FP32 | quantized vs float embedding | perplexity (torch) |", "|" + "---|" * 9]
    for name, label in (("llama", "byte Llama, head untied"), ("llama_tied", "byte Llama, head tied")):
        model = trained(name, args.smoke, log)
        with tempfile.TemporaryDirectory() as tmp:
            fp32 = write(model, Path(tmp), "fp32")
            base = file_rows(fp32["MatMulNBits"], windows)
            size = os.path.getsize(fp32["MatMulNBits"]) / 1e6
            lines.append(f"| {label} | FP32 | float | {size:.2f} | {size:.2f} | {lm.perplexity(base)} | - | - | "
                         f"{lm.perplexity(lm.file_nll(lm.torch_logits(model), windows)).value:.4f} |")
            for precision, kwargs in PRECISIONS:
                rows = {}
                for quantized in (False, True):
                    files = write(model, Path(tmp), f"{precision}_{quantized}".replace(" ", "_"),
                                  quantize_embedding=quantized, **kwargs)
                    rows[quantized] = file_rows(files["MatMulNBits"], windows)
                    p = lm.perplexity(rows[quantized], base)
                    change = "-" if not quantized else _change(lm.perplexity(rows[True], rows[False]))
                    torch_ppl = lm.perplexity(lm.file_nll(lm.torch_logits(files["torch"]), windows)).value
                    lines.append(f"| {label} | {precision} | {'quantized' if quantized else 'float'} | "
                                 f"{os.path.getsize(files['MatMulNBits']) / 1e6:.2f} | "
                                 f"{os.path.getsize(files['DequantizeLinear']) / 1e6:.2f} | {p.value:.4f} "
                                 f"[{p.low:.4f}, {p.high:.4f}] | {_change(p)} | {change} | {torch_ppl:.4f} |")
                    log(lines[-1])
    return lines + [""]


def _change(p) -> str:
    return f"{100 * (p.ratio - 1):+.2f}% [{100 * (p.ratio_low - 1):+.2f}, {100 * (p.ratio_high - 1):+.2f}]"


def decode_ms(paths: list[Path], rounds: int) -> list[float]:
    """Median thread-CPU ms of one decode step (batch 1, one new token after a 128-token cache) per file."""
    import numpy as np

    from quantship.export import onnx_session, read_layout

    layout = read_layout(paths[0])
    rng = np.random.default_rng(0)
    past = min(128, layout.context - 1)
    feed = {"input_ids": np.array([[7]], np.int64), "attention_mask": np.ones((1, past + 1), np.int64),
            **{f"past_key_values.{i}.{kv}": rng.standard_normal((1, layout.kv_heads, past, layout.head_dim))
               .astype(np.float32) for i in range(layout.layers) for kv in ("key", "value")}}
    sessions = [onnx_session(p) for p in paths]
    for s in sessions:
        s.run(None, feed)
    samples: list[list[float]] = [[] for _ in sessions]
    for _ in range(rounds):
        for i, s in enumerate(sessions):
            t = time.thread_time()
            s.run(None, feed)
            samples[i].append((time.thread_time() - t) * 1e3)
    return [statistics.median(x) for x in samples]


def wide_table(args, log) -> list[str]:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(SMOKE_WIDE if args.smoke else WIDE), tie_word_embeddings=True,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in model.parameters())  # the tied table counted once
    table = config.vocab_size * config.hidden_size
    lines = [f"Random weights, tied Llama config: vocabulary {config.vocab_size}, hidden {config.hidden_size}, "
             f"{config.num_hidden_layers} layers; {params / 1e6:.1f} M parameters, the table {100 * table / params:.0f}% "
             f"of them. Decode step: batch 1 after a {min(128, config.max_position_embeddings - 1)}-token cache, "
             f"median of {args.rounds} interleaved rounds.", "",
             "| precision | embedding | MatMulNBits MB | DequantizeLinear MB | decode ms, MatMulNBits | "
             "decode ms, DequantizeLinear (default session) |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [("FP32", "float", write(model, Path(tmp), "fp32"))]
        for precision, kwargs in PRECISIONS:
            for quantized in (False, True):
                rows.append((precision, "quantized" if quantized else "float",
                             write(model, Path(tmp), f"{precision}_{quantized}".replace(" ", "_"),
                                   quantize_embedding=quantized, **kwargs)))
                log(f"wide: {precision} embedding {rows[-1][1]} written")
        paths = [files[form] for _, _, files in rows for form in ("MatMulNBits", "DequantizeLinear")]
        times = decode_ms(paths, args.rounds)
        for i, (precision, embedding, files) in enumerate(rows):
            nbits, dq = files["MatMulNBits"], files["DequantizeLinear"]
            lines.append(f"| {precision} | {embedding} | {os.path.getsize(nbits) / 1e6:.2f} | "
                         f"{os.path.getsize(dq) / 1e6:.2f} | {times[2 * i]:.2f} | {times[2 * i + 1]:.2f} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    import _smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-file", type=int, default=2, help="128-byte windows per held-out file")
    parser.add_argument("--files", type=int, default=None, help="only the first N held-out files (default: all)")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved decode rounds (wide model)")
    parser.add_argument("--out", type=Path, default=None)
    args = _smoke.parse_args(parser, argv, per_file=1, files=4, rounds=1)
    args.out = _smoke.output(args, args.out, ROOT / "bench" / "lm_embedding_results.md")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    lines = _smoke.cpu_lines("The token embedding in low bits: decoder files, embedding quantized vs float") + \
        _smoke.banner(args) + [
        "Generated by `python bench/lm_embedding.py`. MatMulNBits files: the embedding as GatherBlockQuantized, "
        "INT8 at accuracy_level 4, INT4 at 0 (the command line's defaults); DequantizeLinear files: the standard "
        "form. A tied model's file stores its table once when the embedding is quantized (the head's MatMulNBits "
        "and the GatherBlockQuantized read one B), and a float table beside the quantized head otherwise.", "",
        "## Trained byte-level Llamas", ""]
    lines += perplexity_table(args, log)
    lines += ["## A table-dominated Llama (sizes and decode time)", ""] + wide_table(args, log)
    lines.append(f"Load average at the end: {os.getloadavg()[0]:.1f}.")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
