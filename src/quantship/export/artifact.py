"""Atomic artifacts: a file appears at its path only when every check passed, or nothing appears.

Everything is written in one private temporary directory beside the destination, then moved into
place: external data first under a name no other export uses, the graph last, so the graph at the
path always points at its own weights. A refusal, an exception or Ctrl-C removes the directory;
a file already at the destination is left untouched. A run killed with ``kill -9`` leaves its
directory behind; the next run in that directory recognises it (its owner no longer holds the
directory's lock) and removes it.

Two writers to one path take turns: an advisory lock (``flock``) on a hidden sibling lock file.
The second waits, or is refused at once with ``wait=False``; it never replaces a file silently
while the first is still writing and checking it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from quantship.errors import ExportRefused

if TYPE_CHECKING:
    import onnx

# protobuf cannot serialise 2 GiB; larger models keep their tensors in one external-data file
EXTERNAL_DATA_THRESHOLD = 1_500_000_000

WORKDIR_PREFIX = ".quantship-"  # .quantship-<name>-<pid>-<token>.tmp, beside the destination
_WORKDIR = re.compile(r"^\.quantship-(?P<name>.+)-(?P<pid>\d+)-[0-9a-f]{8}\.(?P<state>tmp|new)$")
_LOCKFILE = re.compile(r"^\.quantship-.+\.lock$")
_STALE_AFTER_S = 60.0  # a .new directory (created, not yet locked and renamed) is kept this long
PAUSE_ENV = "QUANTSHIP_PAUSE_AT"  # test hook: stop at a named stage so a test can kill the process there


def external_data_name(path: Path) -> str:
    """A data-file name no other export of ``path`` has used: ``NAME.<token>.data``."""
    return f"{path.name}.{secrets.token_hex(4)}.data"


def _own_data(path: Path) -> re.Pattern:
    return re.compile(rf"^{re.escape(path.name)}(\.[0-9a-f]{{8}})?\.data$")


def save_model(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Write ``model`` to ``path`` (external data beside it when large); returns every file written."""
    import onnx

    if model.ByteSize() > EXTERNAL_DATA_THRESHOLD:
        data = external_data_name(path)
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data, size_threshold=1024)
        return [path, path.parent / data]
    onnx.save_model(model, str(path))
    return [path]


def external_locations(path: Path) -> set[str]:
    """The external-data files the graph at ``path`` refers to (empty when it has none or is unreadable)."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # a graph we cannot read refers to nothing we may keep or delete
        return set()
    found = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            found.update(e.value for e in tensor.external_data if e.key == "location")
    return found


def _pause(stage: str) -> None:
    """Test hook: with ``QUANTSHIP_PAUSE_AT=stage``, say so on stderr and wait to be killed."""
    if os.environ.get(PAUSE_ENV) == stage:
        print(f"quantship-paused:{stage}", file=sys.stderr, flush=True)
        time.sleep(120)


# --- interruption -----------------------------------------------------------------------------

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


# --- the destination lock ---------------------------------------------------------------------

_held: dict[tuple[Path, int], list] = {}  # (destination, thread) -> [fd, depth]: re-entrant in one thread
_held_guard = threading.Lock()


def lock_path(final: Path) -> Path:
    return final.parent / f"{WORKDIR_PREFIX}{final.name}.lock"


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


# --- leftovers of killed runs -----------------------------------------------------------------

def _remove_free_lock(lock: Path) -> None:
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


def remove_stale_workdirs(directory: Path) -> list[Path]:
    """Remove the temporary directories of killed runs in ``directory``; returns what was removed.

    A run locks its directory before giving it its ``.tmp`` name and holds the lock while it lives
    (the kernel drops it when the process dies, even on kill -9), so a ``.tmp`` directory whose lock
    can be taken has no owner. A ``.new`` one (killed between mkdir and rename) goes after a minute.
    """
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if _LOCKFILE.match(entry.name) and entry.is_file() and not entry.is_symlink():
            _remove_free_lock(entry)
            continue
        match = _WORKDIR.match(entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive and working
            if match["state"] == "new" and time.time() - entry.stat().st_mtime < _STALE_AFTER_S:
                continue  # a live run may be between its mkdir and its lock
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            os.close(fd)
    return removed


def _remove_orphan_data(final: Path) -> None:
    """Data files of ``final``'s exports that its current graph does not refer to (a killed commit)."""
    keep = external_locations(final) if final.is_file() else set()
    pattern = _own_data(final)
    for entry in final.parent.iterdir():
        if pattern.match(entry.name) and entry.name not in keep and entry.is_file():
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()


@contextlib.contextmanager
def workdir_beside(final: Path) -> Iterator[Path]:
    """One private temporary directory beside ``final``, locked while alive, removed in ``finally``."""
    remove_stale_workdirs(final.parent)
    while True:
        stem = f"{WORKDIR_PREFIX}{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        pending = final.parent / f"{stem}.new"
        try:
            os.mkdir(pending, 0o700)
            break
        except FileExistsError:
            continue
    fd = os.open(pending, os.O_RDONLY | os.O_DIRECTORY)
    named = final.parent / f"{stem}.tmp"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked before it has the name cleaners look for
        os.rename(pending, named)
        yield named
    finally:
        shutil.rmtree(named, ignore_errors=True)
        shutil.rmtree(pending, ignore_errors=True)  # only there if the rename failed
        os.close(fd)


@contextlib.contextmanager
def scratch_in(directory: Path) -> Iterator[None]:
    """Run third-party code that writes temporaries to the CWD or to ``tempfile``'s default in ``directory``.

    Changes the process's working directory and ``tempfile.tempdir`` for the duration (restored after).
    """
    cwd, tmp = os.getcwd(), tempfile.tempdir
    os.chdir(directory)
    tempfile.tempdir = str(directory)
    try:
        yield
    finally:
        os.chdir(cwd)
        tempfile.tempdir = tmp


def _commit(staged: Path, final: Path, guard: InterruptGuard) -> None:
    """Move the staged graph (and its data files) to ``final``: data under fresh names, graph last."""
    guard.check()
    old_data = external_locations(final) if final.is_file() else set()
    new_data = external_locations(staged)
    for name in sorted(new_data):
        if not (staged.parent / name).is_file():
            raise ExportRefused(f"the exporter wrote no {name}, which the graph refers to")
        if (final.parent / name).exists():
            raise ExportRefused(f"{final.parent / name} already exists; refusing to overwrite weights in use")
    moved = []
    try:
        for name in sorted(new_data):
            os.replace(staged.parent / name, final.parent / name)
            moved.append(final.parent / name)
        _pause("data-moved")
        os.replace(staged, final)
    except BaseException:
        for p in moved:
            with contextlib.suppress(OSError):
                p.unlink()
        raise
    _pause("graph-replaced")
    for name in old_data - new_data:
        if _own_data(final).match(name) or name == final.name + ".data":
            with contextlib.suppress(FileNotFoundError):
                (final.parent / name).unlink()


@contextlib.contextmanager
def atomic_destination(path: str | Path, *, wait: bool = True) -> Iterator[Path]:
    """Yield a temporary path for the artifact; on clean exit move it (and its data files) to ``path``.

    The body may write other scratch files beside the yielded path: they are removed with the
    temporary directory. Only the graph and the external-data files it refers to are moved.
    """
    final = Path(path).expanduser().resolve()
    if final.is_dir():
        raise ExportRefused(f"{final} is a directory: give the path of the .onnx file to write")
    if not final.parent.is_dir():
        raise ExportRefused(f"{final.parent} does not exist: create the directory first")
    with InterruptGuard() as guard, destination_lock(final, wait=wait), workdir_beside(final) as workdir:
        _remove_orphan_data(final)
        staged = workdir / final.name
        yield staged
        if not staged.is_file():
            raise ExportRefused(f"the exporter wrote nothing at {staged}")
        _pause("staged")
        with guard.defer():
            _commit(staged, final, guard)
