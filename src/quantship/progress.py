"""Named steps of a long run, for whoever shows progress (the CLI, on a terminal).

Library code marks each step that may take seconds (capture, calibration, convert, export, each
check) with ``with step("export: ..."):``. Without a listener a step costs nothing and prints
nothing: the library never writes to a stream on its own. ``listening(callback)`` installs a
listener for the duration of a block; the callback is told when a step starts, advances (steps
with a ``total``) and ends. A leaf module: it imports nothing of quantship's, so ``quantize``,
``inspect`` and ``export`` can all mark steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

START, ADVANCE, END = "start", "advance", "end"

__all__ = ["ADVANCE", "END", "START", "Listener", "Step", "listening"]


@dataclass
class Step:
    """One step as a listener sees it: its label, when it started, and how far it is (``done``/``total``)."""

    label: str
    total: int | None = None
    done: int = 0
    started: float = field(default_factory=time.perf_counter)
    seconds: float | None = None  # set when the step ends
    failed: bool = False

    def advance(self, n: int = 1) -> None:
        self.done += n
        listener = _listener.get()
        if listener is not None:
            listener(ADVANCE, self)

    @property
    def elapsed(self) -> float:
        return self.seconds if self.seconds is not None else time.perf_counter() - self.started


Listener = Callable[[str, Step], None]
_listener: ContextVar[Listener | None] = ContextVar("quantship_progress_listener", default=None)


def active() -> bool:
    """Is anyone listening (the CLI showing progress)?"""
    return _listener.get() is not None


@contextmanager
def step(label: str, total: int | None = None) -> Iterator[Step]:
    """Mark a step; the listener, if any, hears its start and its end (with the seconds it took)."""
    current = Step(label, total)
    listener = _listener.get()
    if listener is None:
        yield current
        return
    listener(START, current)
    try:
        yield current
    except BaseException:
        current.failed = True
        raise
    finally:
        current.seconds = time.perf_counter() - current.started
        listener(END, current)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Send every step marked inside this block to ``listener``."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)
