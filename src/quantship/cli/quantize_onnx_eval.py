"""``quantship quantize-onnx --eval``: labelled data for the file's one input, top-1 of the float and the INT8
file in ONNX Runtime, and the accuracy search's rows (``--max-drop``)."""

from __future__ import annotations

import argparse

from quantship.cli import common


def labelled(args: argparse.Namespace, inputs):
    """``--eval``: labelled data for a file with one input: a .npz with ``x`` (of the input's dtype kind
    and rank) and ``y`` (class indices), or a folder of class folders for an N x C x H x W float input."""
    if not args.eval:
        return None
    from pathlib import Path

    import numpy as np

    # late: --help answers before numpy and Pillow load
    from quantship.cli.labelled import Labelled, read_labelled
    from quantship.cli.usage import UsageError

    if len(inputs) != 1:
        raise UsageError(f"--eval scores top-1 of a file with one input; this file has {[i.name for i in inputs]} "
                         "(use quantize_onnx.search.search_onnx(metric=...) in Python)")
    spec = inputs[0]
    images = len(spec.dims) == 4 and spec.dtype.kind == "f"
    if Path(args.eval).is_dir() or Path(args.eval).suffix != ".npz":
        if not images:
            raise UsageError(f"--eval {args.eval}: class folders feed an N x C x H x W float input; the file declares "
                             f"{spec.name}: {spec.describe()}; give a .npz with x and y")
        labelled = read_labelled(args.eval, common.preprocessing(args))
    else:
        labelled = read_labelled(args.eval, None, images=images)
    x = labelled.x
    kind_ok = x.dtype.kind == spec.dtype.kind or (spec.dtype.kind == "f" and x.dtype.kind in "fiu")
    wrong = [i for i, (d, s) in enumerate(zip(spec.dims, x.shape)) if i and d and d != s]
    if x.ndim != len(spec.dims) or wrong or not kind_ok:
        raise UsageError(f"--eval {args.eval}: x is {x.dtype} {list(x.shape)}, the file declares {spec.name}: "
                         f"{spec.describe()}")
    return Labelled(np.ascontiguousarray(x.astype(spec.dtype, copy=False)), labelled.y, labelled.classes)


def top1_of(args: argparse.Namespace, labelled, path) -> dict:
    """Top-1 of the float file and of the written file, both in ORT at default optimizations."""
    # late: --help answers before numpy, onnx and onnxruntime load
    from quantship.quantize_onnx.search import OnnxSearchStep, file_runner, top1

    out = {}
    for key, file in (("float", args.float_model), ("int8", path)):
        run, _, fixed = file_runner(file)
        correct, n = top1(run, labelled.x, labelled.y, args.batch_size, fixed)
        out[key] = OnnxSearchStep((), 100.0 * correct / n, correct, n)
    return out


def search_rows(search) -> list[tuple[str, str]]:
    # late: --help answers before numpy, onnx and onnxruntime load
    from quantship.quantize_onnx.search import steps_table

    return [("accuracy search", f"{len(search.steps)} quantization(s); {search.chosen.forms()}"),
            *steps_table(search)]


def budget_missed(args: argparse.Namespace, ui, missed) -> int:
    """No step met --max-drop: every step reported, nothing written, exit 1."""
    import sys

    # late: --help answers before numpy, onnx and onnxruntime load
    from quantship.quantize_onnx.search import steps_table

    search = missed.search
    ui.report({"version": 1, "input": args.float_model, "engine": "quantship", "path": None,
               "verdict": "budget_missed", "accuracy_search": search.as_dict()},
              [("file", "nothing written: no step met --max-drop"), *steps_table(search)])
    print(f"quantship quantize-onnx: {missed}", file=sys.stderr)
    return 1
