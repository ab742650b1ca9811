"""A float ONNX file and its calibration data, read for ``quantize-onnx`` and ``sensitivity``: the memory it
needs checked first, then the file (refused when already quantized), then the data by the one loader."""

from __future__ import annotations

import argparse
from pathlib import Path

from quantship.cli import common

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def memory_size(text: str) -> int:
    """``--max-memory``'s value in bytes: a number of bytes, or with K, M, G or T (binary: 8G is 8 GiB)."""
    number = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = number[-1:] if number[-1:] in UNITS and number[-1:] else ""
    try:
        value = float(number[:len(number) - len(unit)]) * UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes or a number with K, M, G or T "
                                         "(e.g. 6G)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size above 0")
    return int(value)


def check_memory(path: str, feeds=(), max_memory: int | None = None) -> None:
    """Refuse a file (and data) whose quantization needs more memory than ``max_memory`` bytes or, without it,
    than is available (``memory``)."""
    # late: `quantize-onnx --help` answers before numpy loads
    from quantship.quantize_onnx.memory import refuse_if_too_large

    if Path(path).is_file():
        refuse_if_too_large(path, feeds, max_memory=max_memory)


def read_float_file(path: str, max_memory: int | None = None):
    """The float file's graph (memory checked first, refused when quantized or unusable; its external data
    checked, not read) and its declared inputs."""
    # late: `quantize-onnx --help` answers before onnx loads
    from quantship.inspect.read.feeds import model_inputs
    from quantship.inspect.read.loading import load_onnx
    from quantship.quantize_onnx.quantizer import refuse_unusable

    check_memory(path, max_memory=max_memory)  # before reading it: a file that cannot fit is refused with the figure
    model = load_onnx(path, external_data=False)  # validates: exists, is ONNX, has a graph (one-line errors)
    refuse_unusable(model, path)  # already quantized, external data: refused before any work
    return model, model_inputs(model, path)


def read_feeds(args: argparse.Namespace, inputs):
    """Checked calibration batches for the file's inputs (``export.data.read_held_out``: the one loader)."""
    # late: `quantize-onnx --help` answers before onnx and numpy load
    from quantship.export.data import read_held_out

    return read_held_out(args.calib, inputs, batch_size=args.batch_size, max_samples=args.max_samples, key=args.key,
                         preprocessing=common.preprocessing(args), judged=False)[0]
