"""An advisory write lock (``flock``) per destination path: two writers to one path take turns.

The lock is a hidden sibling file (``.quantship-NAME.lock``); the second writer waits, or is refused
at once with ``wait=False``. The kernel drops a lock when its process dies (even on ``kill -9``), so a
lock file whose lock can be taken has no owner (``remove_free_lock``). A leaf: it imports only
``quantship.errors``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

from quantship.errors import ExportRefused

HIDDEN_PREFIX = ".quantship-"  # every file and directory quantship leaves beside a destination starts so
LOCKFILE = re.compile(r"^\.quantship-.+\.lock$")

_held: dict[tuple[Path, int], list] = {}  # (destination, thread) -> [fd, depth]: re-entrant in one thread
_held_guard = threading.Lock()


def lock_path(final: Path) -> Path:
    return final.parent / f"{HIDDEN_PREFIX}{final.name}.lock"


@contextlib.contextmanager
def destination_lock(path: str | Path, *, wait: bool = True) -> Iterator[Path]:
    """Hold the advisory write lock of ``path`` (re-entrant in one thread); yields the resolved path.

    ``wait=False`` refuses at once when another process holds it. The lock file is removed on
    release; a waiter that wakes on a removed lock file takes the new one instead.
    """
    final = Path(path).expanduser().resolve()
    key = (final, threading.get_ident())  # another thread takes its own flock, and so waits like a process
    with _held_guard:
        entry = _held.get(key)
        if entry is not None:
            entry[1] += 1
    if entry is not None:
        try:
            yield final
        finally:
            with _held_guard:
                entry[1] -= 1
        return
    if not final.parent.is_dir():
        raise ExportRefused(f"{final.parent} does not exist: create the directory first")
    lock = lock_path(final)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                raise ExportRefused(
                    f"another process is writing {final} (lock {lock.name}); wait for it to finish, or "
                    "run again without --no-wait to wait for it") from None
            try:
                same = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)  # the holder removed that lock file as it released it: take the current one
    with _held_guard:
        _held[key] = entry = [fd, 1]
    try:
        yield final
    finally:
        with _held_guard:
            entry[1] -= 1
            last = entry[1] == 0
            if last:
                del _held[key]
        if last:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
            os.close(fd)


def remove_free_lock(lock: Path) -> None:
    """A lock file left by a killed writer: removed while we hold it (a waiter on it retries the new one)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(lock).st_ino == os.fstat(fd).st_ino:
            os.unlink(lock)
    except OSError:  # held by a live writer, or already gone
        pass
    finally:
        os.close(fd)
