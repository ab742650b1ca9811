"""Entry point: parse the subcommand, import its module only when it runs.

Exit codes: 0 ok, 1 a check failed, 2 bad input or a refusal (one line on stderr, no traceback
unless ``--debug``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from quantship import __version__
from quantship.cli.paths import refuse_missing_inputs
from quantship.cli.progress_view import terminal_progress
from quantship.cli.usage import UsageError  # re-exported: raised by every subcommand
from quantship.errors import QuantshipError, cause, one_line
from quantship.interrupts import InterruptGuard
from quantship.noise import silence_library_noise

# subcommand -> (module under quantship.cli, one-line help). The one list of subcommands.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "quantize the built-in reference task end to end and print one table"),
    "quantize": ("quantize", "quantize a PyTorch model, export QDQ ONNX, check it against a target"),
    "quantize-onnx": ("quantize_onnx", "quantize a float ONNX file for a target (quantship's own ONNX quantizer)"),
    "inspect": ("inspect_cmd", "report what an ONNX file contains (format, memory, scales)"),
    "check": ("check", "check an ONNX file against a deployment target's rules"),
    "compare": ("compare", "float vs INT8 vs target execution, in output LSB"),
    "precision": ("precision_cmd", "print the support matrix and the deployment presets"),
    "export-onnx": ("export_onnx", "export a PyTorch model to a float ONNX file (the reference for compare)"),
    "sensitivity": ("sensitivity", "per-layer SQNR of a quantized model: table, PNG, HTML, and what to exclude"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (no usage block): ``quantship CMD: error: ...``, exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message.splitlines()[0] if message else 'bad arguments'}\n")


def build_parser() -> argparse.ArgumentParser:

    parser = _Parser(
        prog="quantship",
        description="PyTorch to deployable INT8 QDQ ONNX, with every claim checked on the file.",
    )
    parser.add_argument("--version", action="version", version=f"quantship {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            mod = importlib.import_module(f"quantship.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"quantship.cli.{module}":
                raise
            p.set_defaults(_missing=True)
            continue
        mod.add_arguments(p)
    return parser


def _describe(exc: BaseException) -> str:

    if isinstance(exc, (UsageError, QuantshipError)):
        return one_line(exc)
    if isinstance(exc, PermissionError):
        return f"permission denied: {exc.filename or one_line(exc)} (check the file's permissions)"
    if isinstance(exc, (ValueError, OSError)):
        return one_line(exc)
    if isinstance(exc, MemoryError):  # numpy's "Unable to allocate 8.00 PiB" is one
        return f"not enough memory: {one_line(exc)} (is a declared shape absurd?)"
    runtime = type(exc).__module__.split(".")[0]
    if runtime in ("onnxruntime", "openvino"):  # a runtime refusing to load or run a file: bad input
        name = "ONNX Runtime" if runtime == "onnxruntime" else "OpenVINO"
        return f"{name} cannot load or run the file: {cause(exc)}"
    return f"{cause(exc)} (unexpected; run with --debug for the traceback)"


def _quiet_broken_pipe() -> int:
    """stdout was closed by the reader (``quantship ... | head``): stop without a traceback."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (``argv=None``: the program's own command line)."""
    try:
        code = _run(argv)
    except KeyboardInterrupt:  # landed between the command's own handlers and here
        code = 130
    if argv is None:
        # the command is over and has reported: a Ctrl-C during interpreter teardown (which restores
        # the default SIGINT action) would otherwise kill the process silently with -2
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


def _run(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a one-line usage error (exit 2): a code, never a raise
        return exc.code if isinstance(exc.code, int) else 2
    except KeyboardInterrupt:  # Ctrl-C while the command line is still being read
        return 130
    if args.command is None:
        build_parser().print_help()
        return 0
    if getattr(args, "_missing", False):
        print(f"quantship {args.command}: not available in this build", file=sys.stderr)
        return 2

    try:
        refuse_missing_inputs(args)  # before the command imports torch, onnx or ONNX Runtime: answers at once
    except UsageError as exc:
        print(f"quantship {args.command}: error: {_describe(exc)}", file=sys.stderr)
        return 2
    silence_library_noise()  # stderr holds one line on an error, about the user's input

    interrupts = InterruptGuard()  # a Ctrl-C that a library swallowed (or wrapped) still ends the run: 130
    try:
        with interrupts, terminal_progress(args):  # the steps the library marks, on a terminal only
            mod = importlib.import_module(f"quantship.cli.{args._module}")
            code = int(mod.run(args) or 0)
            interrupts.check()
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        print(f"quantship {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except Exception as exc:  # the one place an error becomes an exit code; no traceback unless --debug
        if args.debug:
            raise
        if interrupts.count:
            print(f"quantship {args.command}: interrupted ({_describe(exc)})", file=sys.stderr)
            return 130
        print(f"quantship {args.command}: error: {_describe(exc)}", file=sys.stderr)
        return 2  # bad input, a refusal, or anything else: one line, never a traceback

if __name__ == "__main__":
    raise SystemExit(main())
