"""Reports as strict JSON: a number JSON cannot hold (NaN, +-Infinity) is written as ``null`` with a note.

A name a corrupt file stores as non-UTF-8 bytes is written with its bad bytes escaped. A leaf (it imports
nothing of quantship's): the inspect and check reports and the CLI's ``--json`` output all write through it.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _text(value: Any) -> Any:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


def _finite(value: Any, where: str, notes: list[str]) -> Any:
    if isinstance(value, bytes):
        return _text(value)
    if isinstance(value, float) and not math.isfinite(value):
        notes.append(f"{where} is {value}, not a JSON number: written as null")
        return None
    if isinstance(value, dict):
        return {_text(key): _finite(item, f"{where}.{_text(key)}" if where else str(_text(key)), notes)
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item, f"{where}[{index}]", notes) for index, item in enumerate(value)]
    return value


def strict_json(report: dict[str, Any], indent: int | None = 2) -> str:
    """``report`` as JSON any parser reads; non-finite numbers become null, listed under ``"notes"``."""
    notes: list[str] = []
    clean = _finite(report, "", notes)
    if notes:
        clean["notes"] = [*clean.get("notes", []), *notes]
    return json.dumps(clean, indent=indent, allow_nan=False)
