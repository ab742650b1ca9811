"""Who this process is in ``torch.distributed``, and collectives that give up after a timeout.

A leaf module (it imports nothing of quantship's), so both ``quantize`` (observer merging) and
``export`` (rank 0 writes the file) can use it. Every collective here waits at most
``timeout`` seconds (default ``QUANTSHIP_DIST_TIMEOUT`` or 300): a rank that never arrives turns
into a ``ValueError`` naming the step, never a hang. After such a timeout the process group has
a collective in flight; tear it down (``destroy_process_group``) rather than reuse it.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DEFAULT_TIMEOUT_S = 300.0
TEXT_BYTES = 2048  # room for one status line per rank in an agreement


def world() -> tuple[int, int] | None:
    """``(rank, world_size)`` inside an initialised process group of two or more ranks, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size()
    return (dist.get_rank(), size) if size > 1 else None


def timeout_seconds(timeout: float | None = None) -> float:
    """The wait of a collective: ``timeout``, else ``QUANTSHIP_DIST_TIMEOUT``, else 300 s."""
    if timeout is None:
        raw = os.environ.get("QUANTSHIP_DIST_TIMEOUT")
        try:
            timeout = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"QUANTSHIP_DIST_TIMEOUT={raw!r} must be a number of seconds, e.g. 300") from None
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    return float(timeout)


def _wait(work: Any, what: str, timeout: float | None) -> None:
    seconds = timeout_seconds(timeout)
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as exc:
        rank = world()[0] if world() else 0
        raise ValueError(
            f"{what}: rank {rank} waited {seconds:g} s for the other ranks and gave up ({exc}). A rank failed "
            f"before this step or does not call it: every rank must run the same code on its shard "
            f"(QUANTSHIP_DIST_TIMEOUT sets the wait)"
        ) from exc


def all_reduce(tensor: torch.Tensor, op: Any, what: str, timeout: float | None = None) -> torch.Tensor:
    """In-place ``all_reduce`` of a CPU tensor that waits at most ``timeout`` seconds."""
    import torch.distributed as dist

    _wait(dist.all_reduce(tensor, op=op, async_op=True), what, timeout)
    return tensor


def gather_texts(text: str, what: str, timeout: float | None = None) -> list[str]:
    """Every rank's ``text`` (UTF-8, cut at 2 KiB), in rank order, on every rank."""
    import torch.distributed as dist

    size = dist.get_world_size()
    raw = text.encode("utf-8")[: TEXT_BYTES - 1]
    row = torch.zeros(TEXT_BYTES, dtype=torch.uint8)
    row[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    rows = [torch.zeros_like(row) for _ in range(size)]
    _wait(dist.all_gather(rows, row, async_op=True), what, timeout)
    return [bytes(r[r != 0].tolist()).decode("utf-8", errors="replace") for r in rows]


def rank_zero_writes(what: str) -> Callable[[Callable[..., Path]], Callable[..., Path]]:
    """Decorator for a function that writes a file and returns its path.

    Inside a process group only rank 0 runs the writer and the other ranks wait for its outcome.
    Every rank must call it: an entry agreement with a timeout refuses a call made on some ranks
    only. Rank 0's refusal is raised on every rank; every rank returns the path rank 0 wrote.
    """

    def decorate(writer: Callable[..., Path]) -> Callable[..., Path]:
        @functools.wraps(writer)
        def wrapped(*args: Any, **kwargs: Any) -> Path:
            me = world()
            if me is None:
                return writer(*args, **kwargs)
            rank, size = me
            try:
                gather_texts("enter", f"{what} (entry)")
            except ValueError as exc:
                raise ValueError(
                    f"{what} was called on rank {rank} but not on all {size} ranks within "
                    f"{timeout_seconds():g} s: call it on every rank (rank 0 writes the file, the others wait "
                    f"for it), or destroy the process group first to write from one process"
                ) from exc
            failure: Exception | None = None
            status = ""
            if rank == 0:
                try:
                    status = "ok " + str(writer(*args, **kwargs))
                except Exception as exc:  # handed to every rank, then re-raised here as it was
                    failure, status = exc, f"{type(exc).__name__}: {exc}"
            outcome = gather_texts(status, f"{what} (waiting for rank 0 to write)")[0]
            if failure is not None:
                raise failure
            if not outcome.startswith("ok "):
                raise ValueError(f"{what} refused on rank 0, which writes the file: {outcome}")
            return Path(outcome[3:])

        return wrapped

    return decorate
