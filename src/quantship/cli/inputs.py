"""``--inputs DATA``: real inputs for a run (``check --run``, ``compare``), read by the one loader.

``quantship.inspect.read.feeds`` reads them against the file's declared inputs, as ``quantize-onnx
--calib`` does: a ``.npy`` (single-input files), a ``.npz`` keyed by input name, or a folder of images,
each input cast to its declared dtype when the cast is exact. Without ``--inputs`` the run is fed data
generated for each input's dtype and range. Not a subcommand: ``main.SUBCOMMANDS`` does not list it.
"""

from __future__ import annotations

import argparse

from quantship.cli import common


def add_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--inputs", metavar="DATA",
                        help=f"real inputs {what}: .npy (one input), .npz keyed by the file's input names (e.g. "
                             "input_ids, attention_mask), or a folder of images; each input in its declared dtype, "
                             "cut at the file's batch size; default: seeded data generated per input (floats "
                             "standard normal, token ids within the embedding's rows, masks of ones)")
    parser.add_argument("--key", help="array name inside a .npz file (a single-input file)")
    parser.add_argument("--resize", type=int, default=256, help="image folders: shorter side resized to this")
    parser.add_argument("--crop", type=int, default=224, help="image folders: centre crop size")
    parser.add_argument("--mean", type=float, nargs=3, default=None, help="image folders: normalisation mean")
    parser.add_argument("--std", type=float, nargs=3, default=None, help="image folders: normalisation std")


def read(args: argparse.Namespace, file: str, limit: int | None = None):
    """The ``--inputs`` data checked against ``file``'s declared inputs, as batches (None when not given);
    a folder yields at most ``limit`` images. Refusals name the data file."""
    if not args.inputs:
        return None
    # late: onnx and numpy load when data is read, so --help answers at once
    from quantship.inspect.read.feeds import cut, model_inputs, read_data
    from quantship.inspect.read.loading import load_onnx

    declared = model_inputs(load_onnx(file), file)
    arrays = read_data(args.inputs, declared, key=args.key, preprocessing=common.preprocessing(args),
                       limit=limit or 1 << 62, what="--inputs")
    return cut(declared, arrays, batch_size=1 << 62, max_samples=1 << 62, source=args.inputs)
