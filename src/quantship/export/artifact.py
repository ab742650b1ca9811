"""Atomic artifacts: a file appears at its path only when every check passed, or nothing appears.

Everything is written in one private temporary directory beside the destination, then moved into
place: external data first under a name no other export uses, the graph last, so the graph at the
path always points at its own weights. A refusal, an exception or Ctrl-C removes the directory;
a file already at the destination is left untouched. A run killed with ``kill -9`` leaves its
directory behind; the next run in that directory recognises it (its owner no longer holds the
directory's lock) and removes it.

Two writers to one path take turns (``quantship.locks``: an advisory lock on a hidden sibling
file); the second never replaces a file silently while the first is still writing and checking it.
A Ctrl-C is held off during the commit and honoured after it (``quantship.interrupts``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from quantship.errors import ExportRefused
from quantship.inspect.read import external
from quantship.interrupts import InterruptGuard
from quantship.locks import HIDDEN_PREFIX, LOCKFILE, destination_lock, remove_free_lock

if TYPE_CHECKING:
    import onnx

# protobuf cannot serialise 2 GiB; larger models keep their tensors in one external-data file (tests lower it)
EXTERNAL_DATA_THRESHOLD = external.SINGLE_FILE_MAX_BYTES
EXTERNAL_TENSOR_MIN_BYTES = external.EXTERNAL_TENSOR_MIN_BYTES

WORKDIR_PREFIX = HIDDEN_PREFIX  # .quantship-<name>-<pid>-<token>.tmp, beside the destination
_WORKDIR = re.compile(r"^\.quantship-(?P<name>.+)-(?P<pid>\d+)-[0-9a-f]{8}\.(?P<state>tmp|new)$")
_STALE_AFTER_S = 60.0  # a .new directory (created, not yet locked and renamed) is kept this long


ONNX_SUFFIX = ".onnx"


def _same_file(a: Path, b: Path) -> bool:
    """True when ``a`` and ``b`` are one file on disk (one path, a symlink or a hard link of the other)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def refuse_unsafe_destination(path: str | Path, inputs: Iterable[str | Path] = (), *, flag: str = "the path") -> Path:
    """``path`` resolved, refused (``ExportRefused``) where writing it would destroy a file the user has.

    Refused: a name that does not end in ``.onnx`` (a slip of ``--out`` onto the calibration data or the
    model's source would replace it), an existing path that is not a regular file (a device, a pipe, a
    socket, a directory), and any of ``inputs`` (the same file, through a symlink or a hard link too).
    Called before any work, and again by ``atomic_destination`` just before a file is written.
    """
    given = str(path)
    final = Path(path).expanduser().resolve()
    if final.is_dir():
        raise ExportRefused(f"{flag} {given} is a directory: give the path of the .onnx file to write")
    if os.path.lexists(final):
        mode = os.stat(final).st_mode if final.exists() else 0
        if not stat.S_ISREG(mode):
            kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                    else "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "a broken symbolic link" if not final.exists() else "not a regular file")
            raise ExportRefused(f"{flag} {given} is {kind}: quantship replaces only regular files; give the path "
                                f"of a new .onnx file")
    if Path(given).suffix.lower() != ONNX_SUFFIX or final.suffix.lower() != ONNX_SUFFIX:
        raise ExportRefused(f"{flag} {given} does not end in {ONNX_SUFFIX}: quantship writes ONNX files only under an "
                            f"{ONNX_SUFFIX} name, so that no data file or source file is replaced; give a path "
                            f"ending in {ONNX_SUFFIX}")
    if os.path.lexists(final):
        for source in inputs:
            if _same_file(final, Path(source).expanduser()):
                raise ExportRefused(f"{flag} {given} is the input {source}: writing it would replace the file being "
                                    f"read; give another path")
    if not final.parent.is_dir():
        raise ExportRefused(f"{flag} {given}: the directory {final.parent} does not exist; create it first")
    return final


def external_data_name(path: Path) -> str:
    """A data-file name no other export of ``path`` has used: ``NAME.<token>.data``."""
    return f"{path.name}.{secrets.token_hex(4)}.data"


def move_with_data(current: Path, staged: Path) -> None:
    """The graph at ``current`` moved to ``staged`` with the external-data files it refers to, each renamed for
    ``staged`` (``external_data_name``) into ``staged``'s folder and the graph pointed at the new names (its
    tensors are not read); a single-file graph is just moved. A file made in one scratch folder and committed
    from another (``atomic_destination``) keeps its weights so."""
    import onnx

    locations = external_locations(current)
    if not locations:
        os.replace(current, staged)
        return
    graph = onnx.load(str(current), load_external_data=False)
    for old in sorted(locations):
        new = external_data_name(staged)
        external.relocate(graph, old, new)
        os.replace(current.parent / old, staged.parent / new)
    staged.write_bytes(graph.SerializeToString())
    current.unlink()


def _own_data(path: Path) -> re.Pattern:
    return re.compile(rf"^{re.escape(path.name)}(\.[0-9a-f]{{8}})?\.data$")


def save_model(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Write ``model`` to ``path``: one file when it fits ``EXTERNAL_DATA_THRESHOLD``, else its large tensors
    in one data file beside it (relative location ``external_data_name``); returns every file written.
    ``model`` is left as it was."""
    if external.fits_one_file(model, EXTERNAL_DATA_THRESHOLD):
        external.save_one_file(model, path)
        return [path]
    data = external_data_name(path)
    if external.save_with_external_data(model, path, data, EXTERNAL_TENSOR_MIN_BYTES):
        return [path, path.parent / data]
    return [path]


def external_locations(path: Path) -> set[str]:
    """The external-data files the graph at ``path`` refers to (empty when it has none or is unreadable)."""
    try:  # read without the weights: a single-file model's are inside it (1 GB of a 4 GB float model's INT8 file)
        return external.locations(external.graph_without_weights(path))
    except Exception:  # a graph we cannot read refers to nothing we may keep or delete
        return set()


def _inputs_and_their_data(inputs: Iterable[str | Path]) -> list[Path]:
    """The input files and the external-data files the ONNX ones among them refer to: never deleted here."""
    found = []
    for source in inputs:
        source = Path(source).expanduser()
        found.append(source)
        if source.suffix.lower() == ONNX_SUFFIX and source.is_file():
            found.extend(source.parent / name for name in external_locations(source) if not external.escapes(name))
    return found


def _is_protected(path: Path, protected: Iterable[Path]) -> bool:
    return any(_same_file(path, p) for p in protected)


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
        if LOCKFILE.match(entry.name) and entry.is_file() and not entry.is_symlink():
            remove_free_lock(entry)
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


def _remove_orphan_data(final: Path, protected: Iterable[Path]) -> None:
    """Data files of ``final``'s exports that its current graph does not refer to (a killed commit); never one
    of ``protected`` (the inputs and their data)."""
    keep = external_locations(final) if final.is_file() else set()
    pattern = _own_data(final)
    for entry in final.parent.iterdir():
        if pattern.match(entry.name) and entry.name not in keep and entry.is_file() and not _is_protected(entry, protected):
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


def _commit(staged: Path, final: Path, guard: InterruptGuard, protected: Iterable[Path]) -> None:
    """Move the staged graph (and its data files) to ``final``: data under fresh names, graph last."""
    guard.check()
    old_data = external_locations(final) if final.is_file() else set()
    new_data = external_locations(staged)
    for name in sorted(new_data):
        if external.escapes(name):
            raise ExportRefused(f"the exporter wrote a graph whose data location {name!r} is outside its folder")
        if not (staged.parent / name).is_file():
            raise ExportRefused(f"the exporter wrote no {name}, which the graph refers to")
        if (final.parent / name).exists():
            raise ExportRefused(f"{final.parent / name} already exists; refusing to overwrite weights in use")
    moved = []
    try:
        for name in sorted(new_data):
            os.replace(staged.parent / name, final.parent / name)
            moved.append(final.parent / name)
        os.replace(staged, final)
    except BaseException:
        for p in moved:
            with contextlib.suppress(OSError):
                p.unlink()
        raise
    for name in old_data - new_data:
        if (_own_data(final).match(name) or name == final.name + ".data") and not external.escapes(name) \
                and not _is_protected(final.parent / name, protected):
            with contextlib.suppress(FileNotFoundError):
                (final.parent / name).unlink()


@contextlib.contextmanager
def atomic_destination(path: str | Path, *, wait: bool = True,
                       inputs: Iterable[str | Path] = ()) -> Iterator[Path]:
    """Yield a temporary path for the artifact; on clean exit move it (and its data files) to ``path``.

    The body may write other scratch files beside the yielded path: they are removed with the
    temporary directory. Only the graph and the external-data files it refers to are moved.
    ``path`` is refused as ``refuse_unsafe_destination`` says (``inputs``: the files the artifact is
    made from), before the body runs and again just before the commit.
    """
    inputs = tuple(inputs)
    final = refuse_unsafe_destination(path, inputs)
    protected = _inputs_and_their_data(inputs)
    with InterruptGuard() as guard, destination_lock(final, wait=wait), workdir_beside(final) as workdir:
        _remove_orphan_data(final, protected)
        staged = workdir / final.name
        yield staged
        if not staged.is_file():
            raise ExportRefused(f"the exporter wrote nothing at {staged}")
        refuse_unsafe_destination(final, inputs)  # the path may have changed under a long run
        with guard.defer():
            _commit(staged, final, guard, protected)
