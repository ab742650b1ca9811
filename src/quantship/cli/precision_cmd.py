"""``quantship precision``: the support matrix and the deployment presets."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from quantship.precision import PRESETS, SUPPORT_MATRIX, precision_table

    if args.json:
        print(json.dumps({
            "version": 1,
            "matrix": [asdict(c) | {"label": c.label} for c in SUPPORT_MATRIX],
            "presets": [asdict(p) for p in PRESETS],
        }, indent=2))
        return 0
    print(precision_table())
    print()
    print("| target preset | request | activations in file | checked against |")
    print("|---|---|---|---|")
    for p in PRESETS:
        request = ", ".join(f"{k}={v!r}" for k, v in p.spec_kwargs.items())
        print(f"| `{p.target}` | {request} | {p.activation_dtype} | {p.check_target} |")
    return 0
