"""The compute operators a file leaves in float, by the module that produced them, and why.

torch's dynamo exporter records on every node the module scopes it was traced under
(``pkg.torch.onnx.name_scopes``, e.g. ``['', 'block1', 'block1.conv1', 'conv2d_1']``: the
modules from the root down, then the node's own name). ``FileFacts`` reads that once per float
compute node; this module groups them by module and gives the reason. ``quantship inspect``
builds the list from the file alone; ``quantship quantize`` builds the same list from the file it
wrote and adds what only the quantizer knows (the ops its annotator has no INT8 rule for). A file
from another tool carries no scopes: its ops are then named by node, and the report says so.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx

from quantship.precision import under_modules

if TYPE_CHECKING:
    from quantship.inspect.read.facts import FileFacts

NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
TOP_LEVEL = "<top level>"  # ops of the model's own forward (the annotator's word for it too)
_MAX_SCOPES_CHARS = 8192  # no module path is this long; longer text is not read

WHY_REQUESTED = "kept float on request"
WHY_SPEED = "kept float for speed (placement by profile)"
# the file's record of a placement for speed (written by ``export.profile_place`` and the speed search): on
# the PyTorch path it names the modules kept float (``kept_float_modules``)
SPEED_RECORD_KEY = "quantship.speed_search"
WHY_REPAIR = "kept float by the fidelity repair"
# the file's record of the fidelity repair (``quantship.repair_loop``): its steps, each with the nodes or modules
# it kept float (``excluded``), and the index of the one written (``chosen``)
REPAIR_RECORD_KEY = "quantship.repair"
WHY_NO_RULE = "no INT8 rule in the annotator"
# neither requested nor a missing rule in its own module: what the file shows
WHY_INPUT = "its input is not quantized"
WHY_WEIGHT = "its weight is not quantized"
WHY_OUTPUT = "nothing requantizes its result"
WHY_RULE = "the target's float rule"  # followed by the rule's own reason"
UNRECORDED = "; the file does not record why"  # inspect: the file alone cannot say more
NAMED_BY_MODULE = "module"
NAMED_BY_NODE = "node"  # the file has no module metadata (another tool wrote it)
NAMED_BY_MIXED = "module, else node"  # some nodes carry no scopes: those are named by node


# what shows a compute op is float (``counts.float_compute_nodes``) -> the words for it, in the order a group of
# several ops names the first it has
_SEEN = {"input": WHY_INPUT, "weight": WHY_WEIGHT, "output": WHY_OUTPUT}


@dataclass(frozen=True)
class FloatCompute:
    """One compute op that runs in float: its node, op type, module path (None: not recorded), what shows it is
    float (``counts.FLOAT_INPUT``, ``FLOAT_WEIGHT``, ``FLOAT_OUTPUT``), for a float weight the reason of the
    file's target's float rule that keeps such an op float ("" when none does), and the torch op it was exported
    from (``torch_op``; None: not recorded)."""

    node: str
    op_type: str
    module: str | None
    seen: str = "input"
    rule: str = ""
    op: str | None = None


def _scopes(node: onnx.NodeProto) -> list[str] | None:
    """``node``'s ``pkg.torch.onnx.name_scopes`` (the modules from the root down, then the torch op's own name);
    None when it carries no readable scopes."""
    text = next((p.value for p in node.metadata_props if p.key == NAME_SCOPES_KEY), None)
    if not isinstance(text, str) or len(text) > _MAX_SCOPES_CHARS:
        return None
    try:
        scopes = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) for s in scopes):
        return None
    return scopes


def module_path(node: onnx.NodeProto) -> str | None:
    """The dotted path of the innermost module ``node`` was exported from ('' = the model's own forward),
    read from its ``pkg.torch.onnx.name_scopes``; None when the node carries no readable scopes."""
    scopes = _scopes(node)
    if scopes is None:
        return None
    return scopes[-2] if len(scopes) >= 2 else ""


def torch_op(node: onnx.NodeProto) -> str | None:
    """The name of the torch op ``node`` was exported from (``conv2d_3``, ``matmul_1``: the names ``skip_activations``
    and ``int16`` take for one op), the last of its name scopes; None when it carries none."""
    scopes = _scopes(node)
    return scopes[-1] if scopes and len(scopes) >= 2 else None


def _record(model: onnx.ModelProto, key: str) -> dict:
    text = next((p.value for p in model.metadata_props if p.key == key), None)
    try:
        record = json.loads(text) if isinstance(text, str) and len(text) <= _MAX_SCOPES_CHARS * 64 else None
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _names(value: Any) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


def kept_for_speed(model: onnx.ModelProto) -> tuple[str, ...]:
    """The modules (PyTorch path, ``kept_float_modules``) or nodes (ONNX path, ``kept_float``) the file's own
    record says were kept float for speed (empty: none, or no such record)."""
    record = _record(model, SPEED_RECORD_KEY)
    return _names(record.get("kept_float_modules")) + _names(record.get("kept_float"))


def kept_by_repair(model: onnx.ModelProto) -> tuple[str, ...]:
    """The modules or nodes the file's repair record says its chosen step kept float beyond what was asked
    (the first step's own exclusions); empty without such a record."""
    record = _record(model, REPAIR_RECORD_KEY)
    steps, chosen = record.get("steps"), record.get("chosen")
    if not isinstance(steps, list) or not isinstance(chosen, int) or not 0 <= chosen < len(steps):
        return ()
    if not all(isinstance(step, dict) for step in (steps[0], steps[chosen])):
        return ()
    asked = set(_names(steps[0].get("excluded")))
    return tuple(n for n in _names(steps[chosen].get("excluded")) if n not in asked)


def _requested(spec: Any) -> tuple[str, ...]:
    """The modules the file's quantship spec says were kept float on request (``skip_activations``)."""
    skip = spec.get("skip_activations") if isinstance(spec, dict) else None
    return tuple(s for s in skip if isinstance(s, str)) if isinstance(skip, list) else ()


def _named(names: tuple[str, ...], modules: set[str], nodes: list[str], ops: list[str | None]) -> bool:
    """True when ``names`` covers a group: each of its modules (under one of them), each of its nodes by name
    (the ONNX path's records name nodes, whatever scopes the file carries), or each of its nodes by the name of
    the torch op it was exported from (the PyTorch path's records name an op where its module holds others)."""
    if not names:
        return False
    return ((bool(modules) and all(under_modules(m, names) for m in modules)) or all(n in names for n in nodes)
            or all(o in names for o in ops))


def float_ops(facts: FileFacts, *, no_rule_modules: Iterable[str] | None = None,
              for_speed: Iterable[str] = ()) -> dict[str, Any]:
    """The float compute ops of a file, grouped by module path (by node name when the file records no
    modules), each group with its ONNX op types, nodes, and why it is float.

    Why: the module was kept float for speed (``for_speed``, else the file's own record of its placement by
    profile, ``kept_for_speed``: the PyTorch path writes it in ``skip_activations`` too); the file's record of
    the fidelity repair names it (``kept_by_repair``); the file's spec lists it in ``skip_activations`` (kept
    float on request). A group also matches a list by its nodes' names (the ONNX path's records name nodes).
    Else, when
    the caller knows which modules its annotator had no INT8 rule for (``no_rule_modules``, with
    ``TOP_LEVEL`` for the model's own forward), that; else what the file shows (its input is not
    quantized, or nothing requantizes its result), and, without the caller's knowledge (``inspect``),
    that the file does not record why.
    """
    speed = tuple(for_speed) or kept_for_speed(facts.model)
    repaired = tuple(m for m in kept_by_repair(facts.model) if m not in speed)
    requested = tuple(m for m in _requested(facts.spec) if m not in speed and m not in repaired)
    no_rule = None if no_rule_modules is None else tuple(no_rule_modules)
    recorded = [f.module is not None for f in facts.float_compute]
    groups: dict[str, dict[str, Any]] = {}
    modules: dict[str, set[str]] = {}
    seen: dict[str, str] = {}
    rules: dict[str, set[str]] = {}
    torch_ops: dict[str, list[str | None]] = {}
    for f in facts.float_compute:  # a node without scopes is named by itself (a file from another tool)
        key = f.node if f.module is None else (f.module or TOP_LEVEL)
        group = groups.setdefault(key, {"module": key, "ops": [], "nodes": [], "why": ""})
        if f.op_type not in group["ops"]:
            group["ops"].append(f.op_type)
        group["nodes"].append(f.node)
        torch_ops.setdefault(key, []).append(f.op)
        if f.module is not None:
            modules.setdefault(key, set()).add(f.module)
        if key not in seen or list(_SEEN).index(f.seen) < list(_SEEN).index(seen[key]):
            seen[key] = f.seen
        rules.setdefault(key, set()).add(f.rule)
    for key, group in groups.items():
        found = modules.get(key, set())
        shown = _SEEN[seen[key]]
        if _named(speed, found, group["nodes"], torch_ops[key]):
            group["why"] = WHY_SPEED
        elif _named(repaired, found, group["nodes"], torch_ops[key]):
            group["why"] = WHY_REPAIR
        elif _named(requested, found, group["nodes"], torch_ops[key]):
            group["why"] = WHY_REQUESTED
        elif len(rules[key]) == 1 and "" not in rules[key]:  # every op of the group kept float by one rule
            group["why"] = f"{WHY_RULE}: {next(iter(rules[key]))}"
        elif no_rule is None:
            group["why"] = shown + UNRECORDED
        elif found and all((m or TOP_LEVEL) in no_rule for m in found):
            group["why"] = WHY_NO_RULE
        else:
            group["why"] = shown
    named_by = NAMED_BY_NODE if recorded and not any(recorded) else NAMED_BY_MODULE
    if any(recorded) and not all(recorded):
        named_by = NAMED_BY_MIXED
    return {"n_float_compute_in_file": len(facts.float_compute), "named_by": named_by,
            "by_module": list(groups.values())}


def describe_float_ops(report: dict[str, Any]) -> str:
    """One line for a table: each module (or node) with its ops and why, or that nothing is float."""
    if not report["by_module"]:
        return "nothing (every compute op reads and writes INT8)"
    line = "; ".join(f"{g['module']}: {', '.join(g['ops'])} ({g['why']})" for g in report["by_module"])
    if report["named_by"] == NAMED_BY_NODE:
        line = f"by node name (the file records no module names): {line}"
    elif report["named_by"] == NAMED_BY_MIXED:
        line = f"by module, by node name where the file records none: {line}"
    return f"{report['n_float_compute_in_file']} compute op(s): {line}"
