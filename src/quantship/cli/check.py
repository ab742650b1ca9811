"""``quantship check FILE --target X [--run] [--json]``: will the target accept the file?

Exit code 0: accepted; 1: refused (findings say why and how to fix); 2: the file cannot be read.
"""

from __future__ import annotations

import argparse

from quantship.cli import common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="an ONNX file")
    common.add_target_argument(parser, default=None, help="the runtime that will consume it")
    parser.add_argument("--run", action="store_true", help="also run the consumer if it can run here")
    parser.add_argument("--n", type=common.positive_int, default=20, help="inputs for --run (default 20)")
    parser.add_argument("--json", action="store_true", help="print the versioned JSON report")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from quantship.inspect.check import check_file
    from quantship.inspect.rules import target as rule_target
    report = check_file(args.file, args.target, run=args.run, n_inputs=args.n)
    if args.json:
        print(report.to_json())
        return 0 if report.ok else 1
    console = Console(highlight=False)
    verdict = "[green]accepted[/]" if report.ok else "[red]refused[/]"
    console.print(f"{report.path}: {report.format} file, {rule_target(args.target).consumer}: {verdict}")
    for finding in report.findings:
        colour = "red" if finding.severity == "error" else "yellow"
        console.print(f"  [{colour}]{finding.severity}[/] {finding.rule}: {finding.message}")
        console.print(f"      fix: {finding.fix}")
    for result in report.runs:
        console.print(f"  run {result}")
    return 0 if report.ok else 1
