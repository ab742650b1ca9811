"""``quantship quantize-onnx``: a float ONNX file to a QDQ INT8 file that passes a target's check.

quantship's own engine does the work (``quantship.quantize_onnx``): normalise (each pass proven in
ONNX Runtime), calibrate in ONNX Runtime with quantship's observers, place Q/DQ pairs where the
target's runtime runs integer kernels (or everywhere, for targets that need a fully integer graph),
then the post-conditions, the target's rules, both ONNX Runtime readings, the census of integer
kernels and the ``check --run`` verdict. ``--engine ort`` runs ONNX Runtime's ``quantize_static``
with the preset's settings instead, for comparison. Calibration: ``.npy`` (one input), ``.npz``
(one array per input, keyed by input name) of the dtype each input declares, or an image folder.
The file appears only when every check passes. ``--method int8_weight_only|int4_weight_only`` writes
weight-only MatMulNBits instead (``cli.quantize_onnx_weight_only``: no calibration).

``--eval LABELLED`` scores top-1 of the float file and of the written file in ONNX Runtime (default
optimizations, Wilson 95% intervals); with ``--max-drop POINTS`` the accuracy search
(``quantize_onnx.search``) gives the worst-SQNR nodes 16-bit activations (where the target runs
them) or keeps them in float, one at a time, until the drop fits,
and exits 1, writing nothing, when no step does.
"""

from __future__ import annotations

import argparse

from quantship import targets
from quantship.cli import (
    common,
    options,
    quantize_onnx_dynamic,
    quantize_onnx_ort,
    quantize_onnx_static,
    quantize_onnx_weight_only,
)
from quantship.cli import fidelity as fidelity_cli
from quantship.cli import speed as speed_cli
from quantship.cli.onnx_input import memory_size
from quantship.cli.usage import UsageError

ENGINES = ("quantship", "ort")
ACTIVATIONS = ("static", "dynamic")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from quantship.precision import ACT_OBSERVERS  # late: every subcommand's parser is built for --help

    parser.add_argument("float_model", metavar="FLOAT.onnx", help="the float ONNX model to quantize")
    parser.add_argument("--out", required=True, help="the QDQ ONNX file to write")
    common.add_target_argument(parser, default="onnxruntime-cpu", help="deployment preset (default onnxruntime-cpu)")
    parser.add_argument("--engine", choices=ENGINES, default="quantship",
                        help="quantship's own quantizer (default), or ONNX Runtime's quantize_static for comparison")
    parser.add_argument("--exclude", nargs="+", action="extend", default=[], metavar="NODE",
                        help="keep these nodes float: node names, name patterns (glob) or op types")
    parser.add_argument("--int16", type=_names, action="extend", default=[], metavar="NAME[,NAME]",
                        help="16-bit activations (weights int8) for these nodes: names, name patterns (glob) or op "
                             "types, as --exclude; for targets that run them (onnxruntime-cpu)")
    parser.add_argument("--shared-scale", type=_names, action="extend", default=[], metavar="CONCAT[,CONCAT]",
                        help="one scale for these Concat nodes' inputs and output whatever their ranges (names or "
                             "globs, as --exclude; by default inputs whose ranges differ > 8x keep their own)")
    parser.add_argument("--observer", choices=ACT_OBSERVERS, default=None,
                        help="activation range rule (default: the preset's, histogram)")
    parser.add_argument("--per-tensor", action="store_true", help="per-tensor weights (default per channel)")
    parser.add_argument("--equalize", action="store_true",
                        help="cross-layer equalization of Conv -> ReLU -> Conv pairs before calibration (data-free)")
    parser.add_argument("--bias-correction", action="store_true",
                        help="correct each quantized layer's bias for the shift of its output mean (on the calibration data)")
    parser.add_argument("--smooth-quant", type=float, nargs="?", const=0.5, default=None, metavar="ALPHA",
                        help="SmoothQuant: move activation outliers into MatMul/Gemm/1x1 Conv weights before "
                             "calibration, migration strength ALPHA in [0, 1] (0.5 when given alone; put it after "
                             "FLOAT.onnx or give ALPHA)")
    parser.add_argument("--seq-mse", action="store_true",
                        help="search each weight's scale per output channel for the least layer output error "
                             "(on the calibration data)")
    parser.add_argument("--adaround", nargs="?", const="default", default=None, metavar="STEPS",
                        help="learn each weight's rounding up or down (AdaRound, on the calibration data); STEPS "
                             "per layer (default 300)")
    parser.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                        help="memory the run may use, e.g. 6G (default: what the kernel says is available): "
                             "calibration is sliced to stay under it; below what the weights and one layer need, "
                             "refused before anything is written")
    parser.add_argument("--keep-refused", action="store_true",
                        help="--engine ort: keep the file even when the target's check refuses it")
    parser.add_argument("--eval", metavar="LABELLED",
                        help="labelled data (.npz with x and y, or a folder of class folders): top-1 of the float "
                             "file and of the INT8 file in ONNX Runtime, with Wilson 95%% intervals")
    parser.add_argument("--max-drop", type=float, default=None, metavar="POINTS",
                        help="accuracy search: give the worst-SQNR nodes 16-bit activations (where the target runs "
                             "them) or keep them in float until the top-1 drop on --eval "
                             "is at most POINTS percentage points (exit 1, nothing written, if no step fits)")
    parser.add_argument("--speed-search", action="store_true",
                        help="onnxruntime-cpu: time the file in ONNX Runtime on this CPU (1 thread, batch 1 and 8) "
                             "and keep float the Convs/MatMuls whose integer form made it slower (stem and small "
                             "layers); the file records what was kept and the measured speed-ups")
    parser.add_argument("--max-steps", type=int, default=None, metavar="N",
                        help="--max-drop: at most N nodes kept in float by the search; --speed-search: at most N "
                             "files timed after the first; otherwise at most N fidelity repair steps (default: "
                             "every candidate)")
    parser.add_argument("--activations", choices=ACTIVATIONS, default="static",
                        help="static (default): calibrated Q/DQ pairs; dynamic: int8 per-column weights and each "
                             "MatMul/Gemm's activation quantized at run time (the batch-1 transformer form; Convs "
                             "stay float; data-free: --calib optional, the file is then read on seeded inputs)")
    common.add_calibration_arguments(parser, required=False,
                                     help=".npy (one input), .npz keyed by the file's input names, or a folder of "
                                          "images; each input in its declared dtype (required unless --activations "
                                          "dynamic)")
    quantize_onnx_weight_only.add_arguments(parser)  # --method int8_weight_only|int4_weight_only
    fidelity_cli.add_arguments(parser)
    speed_cli.add_arguments(parser)
    common.add_writer_arguments(parser)
    common.add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    quantize_onnx_weight_only.refuse_combinations(args)
    if args.method != "static":  # weight-only MatMulNBits: no calibration, its own writer
        with common.writing(args) as out:
            return quantize_onnx_weight_only.run(args, out)
    speed_cli.refuse(args, targets.get(args.target), not_timed="--engine ort" if args.engine == "ort" else
                     "--activations dynamic" if args.activations == "dynamic" else None)
    if args.max_memory is not None and (args.engine == "ort" or args.activations == "dynamic" or args.speed_search
                                        or args.max_drop is not None):
        raise UsageError("--max-memory bounds quantship's engine with static activations in one quantization: drop "
                         "--engine ort, --activations dynamic, --speed-search or --max-drop")
    if args.activations == "dynamic":
        quantize_onnx_dynamic.refuse_combinations(args)
        with common.writing(args) as out:
            return quantize_onnx_dynamic.run(args, out)
    if not args.calib:
        raise UsageError("--calib DATA is required: static activations are calibrated on it (--activations dynamic "
                         "needs none)")
    args.budget = fidelity_cli.budget(args)  # a bound out of range: one line, exit 2, before any work
    if args.fidelity_data and args.no_fidelity:
        raise UsageError("--fidelity-data is the data fidelity is judged on: drop it or --no-fidelity")
    if args.max_drop is not None and not args.eval:
        raise UsageError("--max-drop needs --eval labelled data to measure top-1 on")
    if args.max_drop is not None and args.max_drop < 0:
        raise UsageError(f"--max-drop {args.max_drop:g}: give a budget in percentage points, >= 0")
    if args.speed_search and args.max_drop is not None:
        raise UsageError("--speed-search and --max-drop are two searches: run one (keep what the speed search kept "
                         "float with --exclude in an accuracy search)")
    if args.speed_search and (args.engine == "ort" or not _runs_on_ort_cpu(args.target)):
        raise UsageError(f"--speed-search times the file in ONNX Runtime on this CPU: it serves --target "
                         f"onnxruntime-cpu with quantship's engine, not --target {args.target}"
                         f"{' --engine ort' if args.engine == 'ort' else ''}")
    if args.max_steps is not None and args.max_steps < 0:
        raise UsageError("--max-steps N bounds a search or the fidelity repair: give N >= 0")
    if args.engine == "ort" and args.eval:
        raise UsageError("--eval and --max-drop run with quantship's engine, not --engine ort")
    args.adaround = _adaround_steps(args.adaround)
    if args.smooth_quant is not None and not 0.0 <= args.smooth_quant <= 1.0:
        raise UsageError(f"--smooth-quant {args.smooth_quant:g}: give the migration strength ALPHA in [0, 1] "
                         "(0.5 when given without a value)")
    smoothing = args.smooth_quant is not None
    if args.engine == "ort" and (args.equalize or args.bias_correction or smoothing or args.seq_mse or args.adaround
                                 or args.int16):
        flags = [f for f, on in (("--equalize", args.equalize), ("--bias-correction", args.bias_correction),
                                 ("--smooth-quant", smoothing), ("--seq-mse", args.seq_mse),
                                 ("--adaround", args.adaround), ("--int16", args.int16)) if on]
        raise UsageError(f"{' and '.join(flags)} run in quantship's engine only: drop --engine ort")
    if args.shared_scale and (args.engine == "ort" or args.max_drop is not None):
        raise UsageError("--shared-scale runs in quantship's engine without --max-drop: drop --engine ort / --max-drop")
    with common.writing(args) as out:
        if args.engine == "ort":
            return quantize_onnx_ort.run(args, out)
        return quantize_onnx_static.run(args, out)


def _runs_on_ort_cpu(target: str) -> bool:
    return targets.get(target).runtime_is_onnxruntime


def _adaround_steps(value: str | None) -> bool | int:
    """``--adaround [STEPS]`` as ``quantize_onnx_file(adaround=...)`` takes it (False: not given)."""
    steps = options.adaround_steps(value)
    return False if steps is None else steps


def _names(text: str) -> list[str]:
    """``--int16 a,b``: comma-separated names (the flag may also be repeated)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no node: give NAME[,NAME]")
    return names
