"""``quantship check FILE --target X [--run [--inputs DATA]] [--json]``: will the target accept the file?

The verdict: ``accepted``; ``not run`` (the rules accept the file, but the consumer asked for with
``--run`` cannot run here: the run line says why); ``refused`` (the target's rules refuse the file; the findings say why
and how to fix it); ``failed`` (the consumer ran the file beyond its tolerance, or could not
load/compile/run it); ``inconclusive`` (the run cannot tell, e.g. the reference output is the
same for every input: pass real inputs). Exit code 0: accepted or not run; 1: refused, failed or
inconclusive; 2: the file cannot be read or the arguments are wrong (one line on stderr).
"""

from __future__ import annotations

import argparse

from quantship.cli import common, inputs
from quantship.cli.usage import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="an ONNX file")
    common.add_target_argument(parser, default=None, help="the runtime that will consume it")
    parser.add_argument("--run", action="store_true", help="also run the consumer if it can run here")
    parser.add_argument("--n", type=common.positive_int, default=20, help="input batches for --run (default 20)")
    inputs.add_arguments(parser, "for --run")
    parser.add_argument("--json", action="store_true", help="print the versioned JSON report")


def exit_code(report) -> int:
    """0 when nothing speaks against the file (accepted, or not run: the verdict says which), 1 for refused,
    failed or inconclusive."""
    return 0 if report.ok else 1


def run(args: argparse.Namespace) -> int:
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    from rich.console import Console

    from quantship import targets
    from quantship.inspect.judge.check import check_file

    if args.n < 1:
        raise UsageError(f"--n {args.n}: a run needs at least one input batch")
    if args.inputs and not args.run:
        raise UsageError("--inputs feeds the consumer's run: add --run")
    real = inputs.read(args, args.file, limit=args.n * 64)
    target = targets.get(args.target)  # the one look-up: an alias resolves here
    report = check_file(args.file, target, run=args.run, n_inputs=args.n, inputs=real)
    if args.json:
        common.emit_json(args.command, report.as_dict())
        return exit_code(report)
    console = Console(highlight=False, soft_wrap=True)  # one line per finding: greppable
    colour = {"accepted": "green", "inconclusive": "yellow", "not run": "yellow"}.get(report.verdict, "red")
    console.print(f"{report.path}: {report.format} file, {target.consumer}: "
                  f"[{colour}]{report.summary()}[/]")
    for finding in report.findings:
        colour = "red" if finding.severity == "error" else "yellow"
        console.print(f"  [{colour}]{finding.severity}[/] {finding.rule}: {finding.message}")
        console.print(f"      fix: {finding.fix}")
    for result in report.runs:
        console.print(f"  run {result}")
    return exit_code(report)
