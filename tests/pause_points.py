"""Stop a writer at a named stage of ``export.artifact``'s commit, from the test side only.

The library carries no test hook: a test process patches it here (``install``), and a child process
gets the same through ``tests/pause_hook/sitecustomize.py`` when ``PAUSE_ENV`` names a stage
(``child_env``). Stages: ``staged`` (the file is written, the commit not begun), ``data-moved``
(the external data is in place, the graph not yet), ``graph-replaced`` (the graph is in place, the
old data not yet removed).
"""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

PAUSE_ENV = "QUANTSHIP_TEST_PAUSE_AT"
HOOK_DIR = str(Path(__file__).resolve().parent / "pause_hook")
STAGES = ("staged", "data-moved", "graph-replaced")


def pause(stage: str) -> None:
    """Say so on stderr and wait to be killed."""
    print(f"quantship-paused:{stage}", file=sys.stderr, flush=True)
    time.sleep(120)


def install(at_stage: Callable[[str], None]) -> Callable[[], None]:
    """Call ``at_stage(stage)`` at each stage of every commit; returns the function that undoes it."""
    import quantship.export.artifact as artifact
    from quantship.interrupts import InterruptGuard

    real_os, real_defer = artifact.os, InterruptGuard.defer

    def replace(src, dst, *args, **kwargs):
        graph = not str(src).endswith(".data")  # the data files move first, the graph last
        if graph:
            at_stage("data-moved")
        real_os.replace(src, dst, *args, **kwargs)
        if graph:
            at_stage("graph-replaced")

    def defer(self):  # the commit runs inside guard.defer(): the file is staged when it is entered
        at_stage("staged")
        return real_defer(self)

    patched = {k: getattr(real_os, k) for k in dir(real_os) if not k.startswith("__")}
    artifact.os = types.SimpleNamespace(**{**patched, "replace": replace})
    InterruptGuard.defer = defer

    def undo() -> None:
        artifact.os = real_os
        InterruptGuard.defer = real_defer

    return undo


def child_env(env: dict[str, str], stage: str | None) -> dict[str, str]:
    """``env`` for a child process that pauses at ``stage`` (none: the hook is off)."""
    env = {k: v for k, v in env.items() if k != PAUSE_ENV}
    if stage:
        env[PAUSE_ENV] = stage
        env["PYTHONPATH"] = HOOK_DIR + os.pathsep + env.get("PYTHONPATH", "")
    return env
