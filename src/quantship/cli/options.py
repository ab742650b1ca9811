"""Quantizer options from the command line and from a ``--config quant.toml`` file.

The file holds any ``Quantizer`` option (a ``[quantizer]`` table, or the keys at top level) and
optionally ``target``. Unknown keys are refused by name; a flag given on the command line wins over
the file. Nothing here imports torch, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from quantship.cli.usage import UsageError

# every Quantizer keyword a config file may set (the signature of quantship.Quantizer)
QUANTIZER_KEYS = ("backend", "method", "weight_bits", "act_bits", "qscheme", "symmetric", "group_size",
                  "qdq_placement", "skip_activations", "act_observer", "reduce_range", "max_accuracy_drop",
                  "smooth_quant", "equalize", "bias_correction", "seq_mse", "adaround", "int16")
CONFIG_KEYS = (*QUANTIZER_KEYS, "target")


def add_quantizer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="quant.toml",
                        help=f"a TOML file with Quantizer options ({', '.join(CONFIG_KEYS)}); flags win over it")
    parser.add_argument("--exclude", nargs="+", metavar="MODULE", default=None,
                        help="module or op names whose activations stay float (skip_activations), e.g. layer4 fc, "
                             "or glob patterns ('layer4.*')")
    parser.add_argument("--int16", nargs="+", metavar="MODULE", default=None,
                        help="module names whose activations (read and written) are stored in 16 bits, weights int8 "
                             "(targets that run 16-bit activations: onnxruntime-cpu)")
    parser.add_argument("--placement", choices=("per_op", "skip_conv_add"), default=None,
                        help="where Q/DQ pairs go (qdq_placement)")
    parser.add_argument("--observer", choices=("histogram", "minmax", "percentile", "mse"), default=None,
                        help="activation observer used during calibration")
    parser.add_argument("--max-drop", type=float, default=None, metavar="POINTS",
                        help="accuracy-aware: keep the most sensitive layers in float until the top-1 drop on "
                             "--eval data is at most POINTS percentage points")
    parser.add_argument("--smooth-quant", type=float, nargs="?", const=0.5, default=None, metavar="ALPHA",
                        help="SmoothQuant before capture: LayerNorm/Linear -> Linear activation outliers moved into "
                             "the weights, migration strength ALPHA in [0, 1] (0.5 when given alone)")
    parser.add_argument("--equalize", action="store_const", const=True, default=None,
                        help="cross-layer equalization before capture: Conv -> [BatchNorm] -> ReLU/PReLU/pooling -> "
                             "Conv channel ranges balanced, the float function kept")
    parser.add_argument("--bias-correction", action="store_const", const=True, default=None,
                        help="after conversion, each quantized conv/linear bias moved so its per-channel output "
                             "mean on the calibration data matches the float model's")
    parser.add_argument("--seq-mse", action="store_const", const=True, default=None,
                        help="after conversion, each conv/linear weight's scale per output channel searched for the "
                             "least layer output error (on the calibration data)")
    parser.add_argument("--adaround", nargs="?", const="default", default=None, metavar="STEPS",
                        help="after conversion, each conv/linear weight's rounding up or down learned (AdaRound, on "
                             "the calibration data); STEPS per layer (default 300)")


def adaround_steps(value: str | None) -> bool | int | None:
    """``--adaround [STEPS]`` as ``Quantizer(adaround=...)`` / ``quantize_onnx_file(adaround=...)`` take it
    (None: the flag was not given)."""
    if value is None:
        return None
    if value == "default":
        return True
    try:
        steps = int(value)
    except ValueError:
        steps = -1
    if steps < 1:
        raise UsageError(f"--adaround {value}: give a number of steps per layer, >= 1 (or no value: the default)")
    return steps


def read_config(path: str | None) -> dict[str, Any]:
    """The options of a ``quant.toml`` file (``[quantizer]`` table or top-level keys), validated."""
    if not path:
        return {}
    import tomllib

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"config file {path} is not valid TOML: {exc}") from None
    if "quantizer" in data:
        extra = sorted(set(data) - {"quantizer"})
        if extra:
            raise UsageError(f"config file {path}: unknown top-level key(s) {extra}; put options under [quantizer]")
        data = data["quantizer"]
        if not isinstance(data, dict):
            raise UsageError(f"config file {path}: [quantizer] must be a table")
    unknown = sorted(set(data) - set(CONFIG_KEYS))
    if unknown:
        raise UsageError(f"config file {path}: unknown key(s) {unknown}; valid keys: {list(CONFIG_KEYS)}")
    return dict(data)


def quantizer_options(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """Quantizer keywords: the config file's, then the command line's flags on top."""
    options = {k: v for k, v in config.items() if k in QUANTIZER_KEYS}
    flags = {"skip_activations": args.exclude, "int16": getattr(args, "int16", None), "qdq_placement": args.placement, "act_observer": args.observer,
             "max_accuracy_drop": args.max_drop, "qscheme": getattr(args, "qscheme", None),
             "smooth_quant": getattr(args, "smooth_quant", None), "equalize": getattr(args, "equalize", None),
             "bias_correction": getattr(args, "bias_correction", None), "seq_mse": getattr(args, "seq_mse", None),
             "adaround": adaround_steps(getattr(args, "adaround", None))}
    options.update({k: v for k, v in flags.items() if v is not None})
    alpha = options.get("smooth_quant")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1):
        raise UsageError(f"--smooth-quant {alpha}: give the migration strength ALPHA in [0, 1] (0.5 when given alone)")
    for key in ("equalize", "bias_correction", "seq_mse"):
        if key in options and not isinstance(options[key], bool):
            raise UsageError(f"{key} = {options[key]!r} in the config file: give true or false")
    steps = options.get("adaround")
    if steps is not None and not isinstance(steps, bool) and (not isinstance(steps, int) or steps < 1):
        raise UsageError(f"adaround = {steps!r} in the config file: give true, false or a number of steps >= 1")
    if options.get("max_accuracy_drop") is not None and not getattr(args, "eval", None):
        raise UsageError("--max-drop (max_accuracy_drop) needs --eval labelled data to measure top-1 on")
    return options
