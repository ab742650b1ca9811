"""``--inputs DATA``: real inputs for a run (``check --run``, ``compare``), read like ``quantize --calib``.

A ``.npy``/``.npz`` array (N x C x H x W) or a folder of images with the same preprocessing options;
the readers are ``cli.sources``'s. Not a subcommand: ``main.SUBCOMMANDS`` does not list it.
"""

from __future__ import annotations

import argparse

from quantship.cli.usage import UsageError


def add_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--inputs", metavar="DATA", help=f".npy/.npz array (N x C x H x W) or a folder of images: "
                        f"real inputs {what}, cut at the file's batch size; default: seeded random inputs")
    parser.add_argument("--key", help="array name inside a .npz file")
    parser.add_argument("--resize", type=int, default=256, help="image folders: shorter side resized to this")
    parser.add_argument("--crop", type=int, default=224, help="image folders: centre crop size")
    parser.add_argument("--mean", type=float, nargs=3, default=None, help="image folders: normalisation mean")
    parser.add_argument("--std", type=float, nargs=3, default=None, help="image folders: normalisation std")


def read(args: argparse.Namespace, limit: int | None = None):
    """The ``--inputs`` array (None when not given); a folder yields at most ``limit`` images."""
    if not args.inputs:
        return None
    # cli.sources imports numpy: loaded when data is read, so --help answers at once
    from pathlib import Path

    from quantship.cli.sources import IMAGENET_MEAN, IMAGENET_STD, Preprocessing, load_array, load_images

    path = Path(args.inputs)
    if not path.exists():
        raise UsageError(f"--inputs {args.inputs} does not exist")
    if path.is_dir():
        prep = Preprocessing(resize=args.resize, crop=args.crop, mean=tuple(args.mean or IMAGENET_MEAN),
                             std=tuple(args.std or IMAGENET_STD))
        return load_images(args.inputs, prep, limit or 10**9)
    return load_array(args.inputs, args.key)
