"""Public names of a package loaded on first use, from a table of name -> defining module.

A leaf module (it imports nothing of quantship's), so ``quantship``, ``quantship.inspect`` and
``quantship.export`` all read their tables through it and stay cheap to import.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def load_public(package: str, table: Mapping[str, str], name: str) -> Any:
    """``name`` from the module ``table`` gives for it: the body of a package's ``__getattr__``."""
    module = table.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
