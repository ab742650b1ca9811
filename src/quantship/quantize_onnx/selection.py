"""Nodes named on the command line: ``--exclude`` / ``--int16`` patterns (a node name, a glob over names, or
an op type) and ``--shared-scale`` Concats, resolved to node indices; a pattern that matches nothing is refused."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import onnx_ir as ir

from quantship.errors import SpecRefused
from quantship.export.roles import CONCAT_OPS


def resolve_shared_scale(nodes: list[ir.Node], patterns: Iterable[str]) -> set[int]:
    """The Concat nodes ``patterns`` name (``resolve_excludes``' grammar), for one forced scale each;
    a pattern that names no Concat is refused."""
    chosen: set[int] = set()
    for pattern in patterns:
        hits = resolve_excludes(nodes, [pattern], flag="--shared-scale")
        concats = {i for i in hits if nodes[i].op_type in CONCAT_OPS}
        if not concats:
            names = ", ".join(sorted(f"{node_label(nodes[i], i)} ({nodes[i].op_type})" for i in hits)[:4])
            raise SpecRefused(f"--shared-scale {pattern!r} names no Concat ({names}); name a Concat node")
        chosen |= concats
    return chosen


def resolve_excludes(nodes: list[ir.Node], patterns: Iterable[str], flag: str = "--exclude") -> set[int]:
    """Indices of the nodes ``patterns`` name: a node name, a glob over names, or an op type.
    A pattern that matches nothing is refused (a typo would otherwise quantize what it meant to keep)."""
    chosen: set[int] = set()
    for pattern in patterns:
        hits = {i for i, n in enumerate(nodes)
                if n.op_type == pattern or (n.name and (n.name == pattern or fnmatch.fnmatchcase(n.name, pattern)))
                or node_label(n, i) == pattern}
        if not hits:
            ops = sorted({n.op_type for n in nodes})
            raise SpecRefused(f"{flag} {pattern!r} matches no node name, name pattern or op type of the file "
                              f"(its op types: {', '.join(ops[:12])}{', ...' if len(ops) > 12 else ''})")
        chosen |= hits
    return chosen


def node_label(node: ir.Node, index: int) -> str:
    return node.name or f"{node.op_type}#{index}"
