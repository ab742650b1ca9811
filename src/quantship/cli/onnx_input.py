"""A float ONNX file and its calibration data, read for ``quantize-onnx`` and ``sensitivity``: the memory it
needs checked first, then the file (refused when already quantized), then the data by the one loader."""

from __future__ import annotations

import argparse
from pathlib import Path

from quantship.cli import common


def check_memory(path: str, feeds=()) -> None:
    """Refuse a file (and data) whose quantization needs more memory than is available (``memory``)."""
    # late: `quantize-onnx --help` answers before numpy loads
    from quantship.quantize_onnx.memory import refuse_if_too_large

    if Path(path).is_file():
        refuse_if_too_large(path, feeds)


def read_float_file(path: str):
    """The float file (memory checked first, refused when quantized or unusable) and its declared inputs."""
    # late: `quantize-onnx --help` answers before onnx loads
    from quantship.inspect.read.feeds import model_inputs
    from quantship.inspect.read.loading import load_onnx
    from quantship.quantize_onnx.quantizer import refuse_unusable

    check_memory(path)  # before reading it: a file that cannot fit is refused with the figure
    model = load_onnx(path)  # validates: exists, is ONNX, has a graph (one-line errors)
    refuse_unusable(model, path)  # already quantized, external data: refused before any work
    return model, model_inputs(model, path)


def read_feeds(args: argparse.Namespace, inputs):
    """Checked calibration batches for the file's inputs (``export.data.read_held_out``: the one loader)."""
    # late: `quantize-onnx --help` answers before onnx and numpy load
    from quantship.export.data import read_held_out

    return read_held_out(args.calib, inputs, batch_size=args.batch_size, max_samples=args.max_samples, key=args.key,
                         preprocessing=common.preprocessing(args), judged=False)[0]
