"""``InterruptGuard``: a Ctrl-C (SIGINT) is recorded while a guard is active, so one swallowed or
wrapped by a library still ends the run.

A leaf (it imports nothing of quantship's): the CLI holds one around every command, and
``export.artifact`` one around every write, checked before the rename into place.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class InterruptGuard:
    """Records every SIGINT while active, so a KeyboardInterrupt swallowed by a library is not lost.

    The signal still raises ``KeyboardInterrupt`` as usual; ``check()`` raises it again if one was
    recorded, which callers do before any irreversible step (the rename into place).
    """

    def __init__(self) -> None:
        self.count = 0
        self.deferred = False
        self._previous = None
        self._installed = False

    def _handle(self, signum, frame) -> None:
        self.count += 1
        previous = self._previous
        if isinstance(getattr(previous, "__self__", None), InterruptGuard):
            previous.__self__.count += 1  # an outer guard (the CLI's) records it too
        if not self.deferred:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def defer(self) -> Iterator[None]:
        """Record SIGINT without raising inside the block (a commit is never cut in half); raise after it."""
        self.deferred = True
        try:
            yield
        finally:
            self.deferred = False
        self.check()

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            outer = getattr(self._previous, "__self__", None)
            if isinstance(outer, InterruptGuard):
                self.count = outer.count  # a Ctrl-C before this write began still stops it
            if self._previous is not signal.SIG_IGN:
                signal.signal(signal.SIGINT, self._handle)
                self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def check(self) -> None:
        if self.count:
            raise KeyboardInterrupt("interrupted (Ctrl-C) while writing")
