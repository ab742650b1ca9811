"""The progress display on a terminal: the steps the library marks (``quantship.progress``), shown while a
command runs, on stderr only."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from quantship.progress import END, START, listening

SLOW_STEP_S = 2.0  # a step that took longer leaves a line with its time on the terminal


class TerminalProgress:
    """Shows the steps the library marks (``quantship.progress``) on a terminal: a transient spinner
    naming the running step (with its count and seconds so far), and one line per step that took
    longer than ``SLOW_STEP_S`` when it ends. Writes to ``console`` only (stderr)."""

    def __init__(self, console):
        from rich.spinner import Spinner

        self.console = console
        self.running: list = []
        self.live = None
        self.spinner = Spinner("dots")

    def __call__(self, event: str, step) -> None:

        if event == START:
            self.running.append(step)
            if self.live is None:
                from rich.live import Live

                self.live = Live(self, console=self.console, transient=True, refresh_per_second=8)
                self.live.start(refresh=True)
        elif event == END:
            if step in self.running:
                self.running.remove(step)
            if step.seconds is not None and step.seconds > SLOW_STEP_S:
                self.console.print(self.done_line(step), highlight=False)
            if not self.running and self.live is not None:
                self.live.stop()
                self.live = None

    @staticmethod
    def done_line(step) -> str:
        return f"{step.label}: {'failed after' if step.failed else 'done in'} {step.seconds:.1f} s"

    def __rich__(self):
        if not self.running:
            return ""
        now = self.running[-1]
        count = f" {now.done}/{now.total}" if now.total else ""
        self.spinner.update(text=f"{' > '.join(s.label for s in self.running)}{count}  {now.elapsed:.0f} s")
        return self.spinner

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def terminal_progress(args: argparse.Namespace):
    """The progress display for one command: on when stderr is a terminal and neither --quiet nor
    --json was given; otherwise nothing is shown (a do-nothing context)."""
    import sys

    quiet = bool(getattr(args, "quiet", False)) or bool(getattr(args, "json", False))
    if quiet or not sys.stderr.isatty():
        return contextlib.nullcontext()
    return _showing(sys.stderr)


@contextlib.contextmanager
def _showing(stream) -> Iterator[TerminalProgress]:
    from rich.console import Console


    view = TerminalProgress(Console(file=stream, highlight=False))
    try:
        with listening(view):
            yield view
    finally:
        view.close()
