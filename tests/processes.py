"""Test-side helpers for child processes (the writers paused mid-commit by the lock tests)."""

from __future__ import annotations

import subprocess
import time


def wait_for(proc: subprocess.Popen, marker: str, timeout: float = 60) -> None:
    """Read ``proc``'s stderr until a line holds ``marker``; kill it and fail if it never comes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if marker in line:
            return
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"the process never reached {marker!r} (exit {proc.poll()})")
