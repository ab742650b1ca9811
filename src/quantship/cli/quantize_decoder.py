"""``quantship quantize hf:... --method int8_weight_only|int4_weight_only --decoder``: a decoder file for generation.

The file takes ``input_ids``, ``attention_mask`` and ``past_key_values.N.key/value`` and returns ``logits`` and
``present.N.key/value`` (any batch, any length up to ``--context``); ``genai_config.json`` is written beside it,
so the folder is what onnxruntime-genai loads. The run then greedy-decodes ``--check-tokens`` tokens for two
prompts of different lengths in ONNX Runtime and with the torch weight-only model, and reports the match.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from quantship.cli import common
from quantship.cli.usage import UsageError

_PROMPTS = (b"def main(argv):\n    ", b"import os\nimport sys\n\n\nclass Reader:\n    def ")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decoder", action="store_true",
                        help="hf: models: a decoder file for generation (mask, past/present key-values, any batch and "
                             "length; weight-only, or static W8A8) and genai_config.json beside it")
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="--decoder: the longest total sequence the file is declared for (default: the model's "
                             "max_position_embeddings; more is refused)")
    parser.add_argument("--accuracy-level", type=int, choices=[0, 1, 2, 3, 4], default=None,
                        help="weight-only MatMulNBits form: the nodes' accuracy_level (0 float activations, the INT4 "
                             "default; 4 int8 activations, the INT8 default and every --decoder file's: far faster, "
                             "see docs/weight-only.md and docs/decoder.md)")
    parser.add_argument("--check-tokens", type=int, default=16, metavar="N",
                        help="--decoder: greedy-decode N tokens in ONNX Runtime and torch and compare (0: skip)")


# the static file's PyTorch-path options: the --decoder static file is the ONNX engine's, which takes none of them
STATIC_OPTIONS_NOT_TAKEN = ("--exclude", "--placement", "--observer", "--max-drop", "--smooth-quant", "--equalize",
                            "--bias-correction", "--seq-mse", "--adaround", "--static-batch", "--eval", "--config",
                            "--qscheme")


def embedding_request(args: argparse.Namespace) -> dict:
    """The Quantizer keyword --embedding asks for (none: the backend's rule by bits)."""
    choice = getattr(args, "embedding", None)
    return {} if choice is None else {"quantize_embedding": choice == "quantized"}


def embedding_row(spec, nbits_form: bool) -> tuple[str, str]:
    """The report's line on the token embedding table: how the file stores it."""
    if spec.quantize_embedding:
        how = "GatherBlockQuantized" if nbits_form else "int + DequantizeLinear of the gathered rows"
        return "embedding", f"quantized as the weights ({how})"
    return "embedding", ("float" + ("" if spec.quantize_embedding is None else
                                    " (--embedding quantized stores it in the weights' bits)"))


def check_request(args: argparse.Namespace) -> None:
    """Refuse --decoder where it does not apply, before any model work."""
    if args.accuracy_level is not None and (args.method == "static" or args.weight_format != "matmulnbits"):
        raise UsageError("--accuracy-level is a MatMulNBits attribute: give --method int8_weight_only or "
                         "int4_weight_only with --weight-format matmulnbits, or drop it")
    if not getattr(args, "decoder", False):
        if args.context is not None:
            raise UsageError("--context applies to --decoder files; add --decoder or drop it")
        return
    if args.method == "static":
        given = [flag for flag in STATIC_OPTIONS_NOT_TAKEN
                 if getattr(args, flag[2:].replace("-", "_"), None) not in (None, False, [])]
        if given:
            raise UsageError(f"--decoder --method static quantizes the float decoder file with quantship's ONNX "
                             f"engine and its defaults; {', '.join(given)} belong(s) to the PyTorch path: drop it")
    if not args.model.startswith("hf:"):
        raise UsageError(f"--decoder needs a Hugging Face causal LM (hf:reference, hf:DIR or hf:config.json), "
                         f"not {args.model}")
    if args.check_tokens < 0:
        raise UsageError(f"--check-tokens {args.check_tokens}: give 0 (skip) or a positive number of tokens")


def run(args: argparse.Namespace, choose_group_size: Callable, gptq_batches: Callable) -> int:
    """``choose_group_size``, ``gptq_batches``: the weight-only command's own choice of group size and reading of
    ``--calib`` for GPTQ (one rule for both files)."""
    # imported when the command runs (torch, onnx behind these), so --help answers at once
    import warnings

    from quantship import Quantizer, quant_spec, targets
    from quantship.export.decoder import export_decoder, layout_of, probe_cache, write_genai_config
    from quantship.export.decoder_check import check_greedy
    from quantship.inspect.read.loading import file_size
    from quantship.sources import load_model

    ui = common.Output(args)
    target = targets.get("onnxruntime-cpu") if args.weight_format == "matmulnbits" else None
    if args.target and targets.get(args.target).weight_only_form is None:
        raise UsageError(f"--target {args.target}: a decoder file is written for onnxruntime-cpu")
    model = load_model(args.model, args.weights)
    layout = layout_of(model, args.context)  # refuses a model without a causal-LM head, or a context it cannot take
    probe_cache(model, layout)  # a model whose attention takes no cache (an encoder's) is refused here
    if args.check_tokens and max(map(len, _PROMPTS)) + args.check_tokens > layout.context:
        raise UsageError(f"--check-tokens {args.check_tokens}: the check's prompts plus the new tokens exceed the "
                         f"context of {layout.context}; give fewer tokens or 0")
    level = args.accuracy_level
    if level is None and target is not None:
        # decoding is what the file is for: level 4 (int8 activations per block) is ONNX Runtime's fast kernel.
        # Its 8-bit kernel with float activations (level 0) decodes far slower than FP32, its 4-bit one 1.5-3x
        # slower than at level 4, with the same perplexity and greedy tokens (docs/decoder.md, "Speed")
        level = 4
    group = choose_group_size(model, args.method, args.group_size, ui)
    kwargs = {"group_size": group, **embedding_request(args)}
    if args.method == "int8_weight_only" and group is not None:
        kwargs["qscheme"] = "per_group"
    calibration = None
    if args.gptq:  # the weights rounded against --calib's Hessians; the greedy check's torch model is that model
        kwargs["weight_algorithm"] = "gptq"
        calibration = gptq_batches(model, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = Quantizer("torchao", method=args.method, verbose=ui.verbose, **kwargs).quantize(
            model, calibration, max_calibration_samples=args.max_samples)
        spec = quant_spec(qmodel)
        path = export_decoder(qmodel, args.out, spec=spec, target=target, context=args.context,
                              accuracy_level=level)
    config = write_genai_config(path)
    check = None
    if args.check_tokens:
        prompts = [[b % layout.vocab for b in p] for p in _PROMPTS]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check = check_greedy(path, qmodel, prompts, args.check_tokens)
    size = file_size(path)
    form = "int + DequantizeLinear (opset 21)" if target is None else "MatMulNBits" + (
        "" if level is None else f", accuracy_level {level}" + (
            " (the decoder's default: int8 activations, ONNX Runtime's fast decode kernel; docs/decoder.md)"
            if args.accuracy_level is None else ""))
    result = {"version": 1, "model": args.model, "path": args.out, "genai_config": str(config),
              "spec": spec.as_dict(), "label": spec.label, "size_bytes": size, "form": form,
              "layout": layout.as_dict(), "greedy_check": None if check is None else check.as_dict()}
    rows = [
        ("file", f"{args.out} ({size / 1e6:.2f} MB), {config.name} beside it"),
        ("precision", f"{spec.label} {spec.method}, " + (f"groups of {spec.group_size}" if spec.qscheme == "per_group"
                                                         else "per output channel")
         + (f", rounded by GPTQ on {sum(len(b) for b in calibration)} calibration samples" if calibration else "")),
        ("form", form),
        embedding_row(spec, target is not None),
        ("layout", f"{layout.layers} layers, {layout.kv_heads} key/value heads x {layout.head_dim}, vocabulary "
                   f"{layout.vocab}, context {layout.context}; any batch and length"),
    ]
    if check is not None:
        rows.append(_greedy_row(check, args.check_tokens, "the torch model's"))
    ui.report(result, rows)
    return 0


def run_static(args: argparse.Namespace, out, target) -> int:
    """``--decoder --method static``: the float decoder file quantized W8A8 by quantship's ONNX engine (all that
    ``quantize-onnx`` judges, repairs and times), calibrated on prefills of the --calib windows; the greedy
    check against the float model."""
    # imported when the command runs (torch, onnx behind these), so --help answers at once
    import tempfile
    import warnings
    from pathlib import Path

    from quantship.cli import fidelity as fidelity_cli
    from quantship.cli import speed as speed_cli
    from quantship.errors import FidelityMissed, SpeedMissed
    from quantship.export.decoder import export_decoder, layout_of, prefill_feed, probe_cache, write_genai_config
    from quantship.export.decoder_check import check_greedy
    from quantship.export.torch_file import read_calibration
    from quantship.inspect.read.loading import file_size
    from quantship.quantize_onnx.repair import quantize_onnx
    from quantship.sources import load_model

    ui = common.Output(args)
    if not target.runtime_is_onnxruntime:  # onnxruntime-genai runs the folder in ONNX Runtime
        raise UsageError(f"--target {args.target}: a decoder file is written for ONNX Runtime (onnxruntime-cpu)")
    budget = fidelity_cli.budget(args)
    model = load_model(args.model, args.weights)
    layout = layout_of(model, args.context)
    probe_cache(model, layout)
    if args.seq_len > layout.context:
        raise UsageError(f"--seq-len {args.seq_len}: the calibration windows exceed the context of {layout.context}")
    if args.check_tokens and max(map(len, _PROMPTS)) + args.check_tokens > layout.context:
        raise UsageError(f"--check-tokens {args.check_tokens}: the check's prompts plus the new tokens exceed the "
                         f"context of {layout.context}; give fewer tokens or 0")
    data = read_calibration(model, args.calib, batch_size=args.batch_size, max_samples=args.max_samples, key=args.key,
                            preprocessing=common.preprocessing(args), fidelity_data=args.fidelity_data,
                            judged=not args.no_fidelity, seq_len=args.seq_len)
    def prefill(batch) -> dict:  # a batch of token ids as the decoder file's feed, from an empty cache
        return prefill_feed((batch[0] if isinstance(batch, (tuple, list)) else batch).numpy(), layout)

    batches = [prefill(b) for b in data.batches]
    held = [prefill(b) for b in data.held] if data.held else None
    ui.say(f"the float decoder file quantized W8A8 by quantship's ONNX engine, calibrated on prefills of "
           f"{sum(len(b['input_ids']) for b in batches)} windows from {data.source}"
           + (f"; fidelity to FP32 judged on {data.held_label}" if held else ""))
    with tempfile.TemporaryDirectory(prefix="quantship-decoder-", dir=Path(out).parent) as scratch:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            float_file = export_decoder(model, Path(scratch) / "fp32_decoder.onnx", context=args.context)
        try:
            result, repair = quantize_onnx(float_file, out, batches, target=target, budget=budget, fidelity_data=held,
                                           repair=not args.no_repair, max_steps=args.max_steps, wait=not args.no_wait,
                                           log=ui.say, speed=not args.no_speed, require_faster=args.require_faster,
                                           profile_placement=not args.plain_placement)
        except SpeedMissed as slower:
            return speed_cli.missed("quantize", ui, slower, {"version": 1, "model": args.model, "target": target.target})
        except FidelityMissed as missed:
            return fidelity_cli.missed("quantize", ui, missed, {"version": 1, "model": args.model, "target": target.target})
    config = write_genai_config(out)
    check = None
    if args.check_tokens:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check = check_greedy(out, model, [[b % layout.vocab for b in p] for p in _PROMPTS], args.check_tokens)
    stats = result.qdq_stats
    report = {"version": 1, "model": args.model, "path": str(out), "genai_config": str(config), "label": "W8A8",
              "method": "static", "size_bytes": file_size(out), "layout": layout.as_dict(),
              **{k: v for k, v in result.as_dict().items() if k in ("fidelity_fp32", "speed", "plan", "qdq_stats")},
              "repair": None if repair is None else repair.as_dict(),
              "greedy_check": None if check is None else check.as_dict(), "greedy_reference": "the float model"}
    speed_cli.warn("quantize", result.speed, args.quiet)
    ui.report(report, [
        *fidelity_cli.rows(result.fp32, repair),
        *speed_cli.rows(result.speed),
        *([("timed on", f"prefills of {args.seq_len} tokens (an empty cache); decode: bench/lm_decode.py")]
          if result.speed is not None else []),
        ("file", f"{out} ({report['size_bytes'] / 1e6:.2f} MB), {config.name} beside it"),
        ("precision", f"W8A8 static: int8 weights per channel, activations calibrated ({stats.n_quantize} Q / "
                      f"{stats.n_dequantize} DQ); the key/value cache stays float"),
        ("layout", f"{layout.layers} layers, {layout.kv_heads} key/value heads x {layout.head_dim}, vocabulary "
                   f"{layout.vocab}, context {layout.context}; any batch and length"),
        *([] if check is None else [_greedy_row(check, args.check_tokens, "the float model's")]),
    ])
    return 0


def _greedy_row(check, tokens: int, reference: str) -> tuple[str, str]:
    d = check.divergence
    return ("greedy decode vs torch", f"{tokens} tokens x {len(check.onnx_tokens)} prompts equal to {reference}"
            if d is None else f"diverges at token {d.step} of prompt {d.row} (ONNX {d.onnx_token}, torch "
                              f"{d.torch_token}; torch margin {d.torch_margin:.3g})")
