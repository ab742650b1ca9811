"""``quantship precision``: the support matrix and the deployment presets."""

from __future__ import annotations

import argparse

from quantship import targets
from quantship.cli import common
from quantship.precision import SUPPORT_MATRIX, precision_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict


    if args.json:
        common.emit_json("precision", {
            "matrix": [asdict(c) | {"label": c.label} for c in SUPPORT_MATRIX],
            "presets": [p.as_dict() | {"check_target": p.check_target, "same_graph_as": targets.same_file_as(p)}
                        for p in targets.ALL],
            "target_aliases": dict(targets.ALIASES),
        })
        return 0
    print(precision_table())
    print()
    print("| target preset | request | activations in file | checked against | writes the same graph as |")
    print("|---|---|---|---|---|")
    for p in targets.ALL:
        request = ", ".join(f"{k}={v!r}" for k, v in p.spec_kwargs.items())
        twins = ", ".join(f"`{t}`" for t in targets.same_file_as(p)) or "no other preset"
        print(f"| `{p.target}` | {request} | {p.activation_dtype} | {p.check_target} | {twins} |")
    aliases = ", ".join(f"`{a}` = `{t}`" for a, t in targets.ALIASES.items())
    print(f"\nEvery command's --target accepts every name above; aliases: {aliases}.")
    return 0
