"""``quantship check FILE --target X [--run [--inputs DATA]] [--json]``: will the target accept the file?

The verdict: ``accepted``; ``not run`` (the rules accept the file, but the consumer asked for with
``--run`` cannot run here: the run line says why); ``refused`` (the target's rules refuse the file; the findings say why
and how to fix it); ``failed`` (the consumer ran the file beyond its tolerance, or could not
load/compile/run it); ``inconclusive`` (the run cannot tell, e.g. the reference output is the
same for every input: pass real inputs). With ``--run`` (or ``--reference``) the file is also held to
the float file it came from (``--reference``, or the one its metadata names beside it): each output's
SQNR and agreement against the budget, on the run's inputs; without a reference the report says fidelity
was not judged. Exit code 0: accepted or not run, and fidelity kept (or not judged); 1: refused, failed,
inconclusive, or fidelity to the reference lost; 2: the file cannot be read or the arguments are wrong
(one line on stderr).
"""

from __future__ import annotations

import argparse

from quantship.cli import common, inputs
from quantship.cli import fidelity as fidelity_cli
from quantship.cli.usage import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="an ONNX file")
    common.add_target_argument(parser, default=None, help="the runtime that will consume it")
    parser.add_argument("--run", action="store_true", help="also run the consumer if it can run here")
    parser.add_argument("--n", type=common.positive_int, default=20, help="input batches for --run (default 20)")
    inputs.add_arguments(parser, "for --run")
    fidelity_cli.add_reference_arguments(parser)
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
    fidelity_cli.budget(args)  # a bound out of range: one line, exit 2, before any run
    report = check_file(args.file, target, run=args.run, n_inputs=args.n, inputs=real)
    judged, said = (fidelity_cli.judge_reference(args, args.file, target, real, args.n)
                    if args.run or args.reference else (None, "not judged (no --run)"))
    code = fidelity_cli.reference_exit(judged, exit_code(report))
    if args.json:
        common.emit_json(args.command, {**report.as_dict(), "fidelity_fp32": judged.as_dict() if judged else None,
                                        "reference": said})
        return code
    console = Console(highlight=False, soft_wrap=True)  # one line per finding: greppable
    colour = {"accepted": "green", "inconclusive": "yellow", "not run": "yellow"}.get(report.verdict, "red")
    console.print(f"{report.path}: {report.describe_format()} file, {target.consumer}: "
                  f"[{colour}]{report.summary()}[/]")
    for finding in report.findings:
        colour = "red" if finding.severity == "error" else "yellow"
        console.print(f"  [{colour}]{finding.severity}[/] {finding.rule}: {finding.message}")
        console.print(f"      fix: {finding.fix}")
    for result in report.runs:
        console.print(f"  run {result}")
    console.print(f"  fidelity vs FP32 ({said}): {judged.describe()}" if judged else f"  fidelity vs FP32: {said}")
    return code
