"""What the report-printing subcommands share: calibration options, quiet/JSON output, an accuracy with its interval."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from quantship import __version__, targets
from quantship.intervals import wilson_interval
from quantship.locks import destination_lock
from quantship.report_json import strict_json

if TYPE_CHECKING:
    from pathlib import Path


def add_target_argument(parser: argparse.ArgumentParser, *, default: str | None, help: str,
                        required: bool | None = None) -> None:
    """``--target``: every command accepts every name of the one target registry (and its aliases)."""

    required = default is None if required is None else required
    parser.add_argument("--target", default=default, required=required, choices=targets.names(),
                        metavar="TARGET", help=f"{help}; one of {', '.join(targets.names())}")


def positive_int(text: str) -> int:
    """argparse type: a declared size or count must be a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def add_writer_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the commands that write a file: what to do when another process is writing it."""
    parser.add_argument("--no-wait", action="store_true",
                        help="fail at once if another process is writing --out (default: wait for it)")


def output_path(out: str, inputs: tuple[str, ...] = ()):
    """The resolved ``--out`` path, refused before any work when writing it would destroy a user's file.

    ``artifact.refuse_unsafe_destination``: not ending in .onnx, a device, pipe or socket, or one of ``inputs``.
    """
    from quantship.export.artifact import refuse_unsafe_destination  # late: --help answers before it loads

    return refuse_unsafe_destination(out, inputs, flag="--out")


def input_files(args: argparse.Namespace) -> tuple[str, ...]:
    """Every path the command line names other than ``--out`` (``file.py:factory`` counts as ``file.py``)."""
    named = []
    for name, value in vars(args).items():
        if name == "out" or name.startswith("_"):
            continue
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and text:
                named.append(text)
                if ":" in text:
                    named.append(text.rsplit(":", 1)[0])
    return tuple(named)


@contextlib.contextmanager
def writing(args: argparse.Namespace) -> Iterator[Path]:
    """``--out`` resolved (``output_path``) and locked against other writers until the block ends.

    A command holds it to its end: its report reads the file this run wrote.
    """

    out = output_path(args.out, input_files(args))
    with destination_lock(out, wait=not args.no_wait):
        yield out


def add_model_arguments(parser: argparse.ArgumentParser, *, hf: bool = False, onnx: bool = False) -> None:
    """MODEL, --weights and --trust-pickle: how every command that builds a PyTorch model gets it
    (``onnx``: the command also takes a float .onnx file)."""
    sources = "torchvision:NAME, timm:NAME, path/to/file.py:factory (runs that file's Python code, with its folder on " \
              "the import path)" + (", or hf:reference|DIR|config.json (local files; token ids in, logits out)" if hf else "") \
              + (", or a float FILE.onnx (quantized by quantize-onnx's engine)" if onnx else "")
    parser.add_argument("model", metavar="MODEL", help=sources)
    parser.add_argument("--weights", help="a state_dict (.pt) to load into MODEL, or a torchvision weight set name "
                        "(IMAGENET1K_V1, DEFAULT) read from the local torch hub cache")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow --weights to be a whole pickled model (unpickling runs its code)")


def add_calibration_arguments(parser: argparse.ArgumentParser, *, required: bool = True, help: str | None = None) -> None:
    """``--calib`` and how it is read; ``required=False``: the command checks it itself (a mode that needs none)."""
    parser.add_argument("--calib", required=required, metavar="DATA",
                        help=help or ".npy/.npz array (N x C x H x W) or a folder of images; an ONNX model: .npy "
                                     "(one input), .npz keyed by the file's input names, or images")
    parser.add_argument("--key", help="array name inside a .npz file")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="calibration batch size: how the data is fed, not the batch the file serves")
    parser.add_argument("--max-samples", type=positive_int, default=100, help="calibration samples used at most")
    parser.add_argument("--resize", type=positive_int, default=256, help="image folders: shorter side resized to this")
    parser.add_argument("--crop", type=positive_int, default=224, help="image folders: centre crop size")
    parser.add_argument("--mean", type=float, nargs=3, default=None, help="image folders: normalisation mean")
    parser.add_argument("--std", type=float, nargs=3, default=None, help="image folders: normalisation std")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one machine-readable JSON report")
    parser.add_argument("--quiet", action="store_true", help="print only the final report")


def preprocessing(args: argparse.Namespace):
    """How image folders become model input (``--resize/--crop/--mean/--std``)."""
    # the loader imports numpy and onnx: loaded when data is read, so --help answers at once
    from quantship.inspect.read.feeds import IMAGENET_MEAN, IMAGENET_STD, Preprocessing

    return Preprocessing(resize=args.resize, crop=args.crop, mean=tuple(args.mean or IMAGENET_MEAN),
                         std=tuple(args.std or IMAGENET_STD))


def read_calibration(args: argparse.Namespace, *, keep_last: bool = False):
    """``--calib`` as N x C x H x W float32 batches, for the commands that take image models only."""
    # numpy and onnx load with the reader: when data is read, so --help answers at once
    from quantship.export.data import read_images

    return read_images(args.calib, key=args.key, prep=preprocessing(args), batch_size=args.batch_size,
                       max_samples=args.max_samples, keep_last=keep_last)


def verdict_line(report) -> str:
    """One line per verdict, the same words as ``quantship check`` (``CheckReport.summary``)."""
    return report.summary()


JSON_VERSION = 1  # the layout of every command's --json document (docs/json.md)


def json_document(command: str, data: dict[str, Any]) -> dict[str, Any]:
    """Every command's --json in one shape: ``version`` (the document layout) first, then the quantship
    release and the command, then the command's own keys (snake_case; counts named by what they count)."""

    rest = {k: v for k, v in data.items() if k not in ("version", "quantship", "command")}
    return {"version": JSON_VERSION, "quantship": __version__, "command": command, **rest}


def emit_json(command: str, data: dict[str, Any]) -> None:
    """Print ``json_document`` as strict JSON: a non-finite number becomes null and is listed in ``notes``."""

    print(strict_json(json.loads(json.dumps(json_document(command, data), default=str))))


class Output:
    """Progress lines unless --quiet/--json; the final report as a table or as JSON."""

    def __init__(self, args: argparse.Namespace):
        self.json = bool(getattr(args, "json", False))
        self.command = getattr(args, "command", None) or "quantship"
        self.quiet = bool(getattr(args, "quiet", False)) or self.json
        self.verbose = not self.quiet

    def say(self, message: str) -> None:
        if not self.quiet:
            print(message, flush=True)

    def report(self, data: dict[str, Any], rows: list[tuple[str, str]], title: str = "quantship") -> None:
        if self.json:
            emit_json(self.command, data)
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold", overflow="fold")
        table.add_column(overflow="fold")  # a long node name wraps; it is never cut
        for key, value in rows:
            table.add_row(key, value)
        Console().print(table)


def format_accuracy(k: int, n: int) -> str:
    """``'k/n = p  Wilson 95% [lo, hi]'``."""
    lo, hi = wilson_interval(k, n)
    return f"{k}/{n} = {k / n:.4f}  Wilson 95% [{lo:.4f}, {hi:.4f}]"
