"""The deployment targets: one module per runtime, one registry, one look-up (``get``).

Each module holds everything quantship knows about its runtime in one ``Target`` (``target.py``): the
preset, the file rules, the placement rules and rewrites it needs, its runner, what it can run.
Functions that take ``target=`` call ``get`` once at their entry and pass the object on; no module
outside this package compares a target's name (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields

from quantship.errors import TargetRefused
from quantship.precision import Preset, resolve_spec
from quantship.targets import onnxruntime_cpu, openvino, tensorrt, tigris
from quantship.targets.target import FileRules, FloatRule, Target

__all__ = ["ALIASES", "ALL", "TARGET_KEY", "FileRules", "FloatRule", "Target", "get", "names", "same_file_as"]

TARGET_KEY = "quantship.target"  # the metadata key under which a written file names the target it was made for

ALL: tuple[Target, ...] = (onnxruntime_cpu.TARGET, tensorrt.TARGET, openvino.TARGET, tigris.TARGET)

# Other spellings of a target, accepted by every command and public function that takes one, and
# resolved by ``get``; nothing inside quantship compares against an alias.
ALIASES: Mapping[str, str] = {"onnxruntime": onnxruntime_cpu.TARGET.name}

_BY_NAME: Mapping[str, Target] = {t.name: t for t in ALL} | {a: onnxruntime_cpu.TARGET for a in ALIASES}


def names() -> tuple[str, ...]:
    """Every accepted target name: the targets, then their aliases (the one list the CLI offers)."""
    return (*(t.name for t in ALL), *ALIASES)


def get(target: str | Target) -> Target:
    """The edge's one look-up: a target name or alias becomes its ``Target``; a ``Target`` passes as is."""
    if isinstance(target, Target):
        return target
    if isinstance(target, Preset):
        raise TypeError(f"target={target!r}: a bare Preset carries no runtime; give a target name or "
                        "quantship.targets.get(name)")
    if isinstance(target, str) and target in _BY_NAME:
        return _BY_NAME[target]
    raise TargetRefused(f"target={target!r} is unknown; valid targets: {list(names())}")


def file_settings(p: Preset) -> tuple:
    """What decides the file a preset writes: the resolved spec and every export option."""
    options = tuple(sorted((f.name, getattr(p, f.name)) for f in fields(Preset)
                           if f.name not in ("target", "spec_kwargs", "why")))
    return (resolve_spec(**p.spec_kwargs), options)


def same_file_as(target: str | Target) -> list[str]:
    """The other targets that write exactly the same file as ``target`` (same spec, same options)."""
    mine = get(target)
    settings = file_settings(mine)
    return [other.name for other in ALL if other is not mine and file_settings(other) == settings]


# the names of earlier releases (``quantship.precision`` serves them too)
PRESETS = ALL
TARGET_ALIASES = ALIASES
target_names = names
preset = resolve_target = get
