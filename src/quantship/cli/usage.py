"""``UsageError``: bad input from the command line, reported in one line with exit code 2.

A leaf of ``quantship.cli`` (it imports nothing): every subcommand module raises
it, and ``cli.main`` turns it into the exit code.
"""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the command line: reported in one line, exit code 2."""
