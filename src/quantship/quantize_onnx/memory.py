"""Will quantizing this file fit in memory, and how much of it may calibration hold at once? An estimate from
the file size and the calibration data, against a budget: ``--max-memory`` when given, else what the kernel
says is available (``MemAvailable`` in ``/proc/meminfo``).

The working set of ``quantize_onnx_file``: the process itself (``RUNTIME_BYTES``: Python, torch, ONNX Runtime),
copies of the weights alive at once, the calibration data held as arrays, and the exposed tensors of one
calibration slice. A file read whole (one protobuf) holds ``MODEL_COPIES`` copies (the loaded proto, the onnx_ir
model over it, the normalised proto, ONNX Runtime's session); a file whose weights are in external data is
mapped from disk instead, tensor by tensor, and holds ``MAPPED_COPIES`` (ONNX Runtime's sessions and the
mapped pages a pass read). The written file is read literally a few layers at a time when its dequantized
weights exceed what the budget leaves (``literal_part_bytes``, ``inspect.run.literal``), so that reading no
longer holds a float copy of every weight. What is left of the budget bounds the calibration slices
(``calibrate.observe``, at most ``MEMORY_BUDGET``); a budget that leaves less than one layer's output for one
sample is refused before anything is read or written, with the figures and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from quantship.errors import DataRefused, FileRefused
from quantship.heap import give_back
from quantship.inspect.read.feeds import Feed
from quantship.inspect.read.loading import file_size
from quantship.inspect.run.literal import LITERAL_PART_BYTES

__all__ = ["give_back", "literal_part_bytes"]  # give_back: the one definition is quantship.heap's

# Bytes of exposed tensors held at once at most (calibration, sensitivity, the weight passes slice to it). Here
# and not in ``calibrate``: the refusal reads it before torch (which calibrate's observers need) loads.
MEMORY_BUDGET = 768 << 20
MODEL_COPIES = 4  # proto, onnx_ir model, normalised proto, ONNX Runtime's session (weights held once each)
# external data: the weights are mapped, and the literal reading of the written file runs in parts
# (``inspect.run.literal``): bench/scale.py measured peak RSS = 0.57 GB + 1.74 x float weights at 2 and 4 GB
# (bench/scale_results.md; by its timing the peak is now while the float model is normalised and probed), so 2
# copies bound it
MAPPED_COPIES = 2
RUNTIME_BYTES = 700 << 20  # the process before any model: Python, numpy, torch, onnx, ONNX Runtime (0.62 GB here)
MEMINFO = Path("/proc/meminfo")
GRAPH_PARSED_BELOW = 64 << 20


def available_bytes() -> int | None:
    """``MemAvailable`` in bytes (None where the kernel does not say: not Linux)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class Estimate:
    """Bytes the quantizer needs at its peak, by part."""

    model_bytes: int
    data_bytes: int
    exposed_bytes: int
    copies: int = MODEL_COPIES
    runtime_bytes: int = RUNTIME_BYTES

    @property
    def fixed(self) -> int:
        """Everything but the exposed tensors: what no slicing can lower."""
        return self.runtime_bytes + self.copies * self.model_bytes + self.data_bytes

    @property
    def total(self) -> int:
        return self.fixed + self.exposed_bytes

    def describe(self) -> str:
        return (f"about {gb(self.total)} ({gb(self.runtime_bytes)} for the process, {self.copies} x "
                f"{gb(self.model_bytes)} of weights, {gb(self.data_bytes)} of calibration data, up to "
                f"{gb(self.exposed_bytes)} of exposed tensors)")


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


@dataclass(frozen=True)
class Room:
    """The memory budget of a run and where it comes from (``--max-memory`` or ``MemAvailable``)."""

    bytes: int | None
    source: str

    @classmethod
    def of(cls, max_memory: int | None = None, available: int | None = None) -> Room:
        if max_memory is not None:
            return cls(int(max_memory), "--max-memory")
        return cls(available_bytes() if available is None else available, "MemAvailable")


def estimate(model_bytes: int, feeds: Sequence[Feed] = (), *, mapped: bool = False) -> Estimate:
    data = sum(int(a.nbytes) for feed in feeds for a in feed.values())
    batch = max((sum(int(a.nbytes) for a in feed.values()) for feed in feeds), default=0)
    # the data, and the batch ONNX Runtime copies in for a run; at most MEMORY_BUDGET of exposed tensors
    return Estimate(model_bytes, data + batch, MEMORY_BUDGET, MAPPED_COPIES if mapped else MODEL_COPIES)


def stored_bytes(path: str | Path) -> int:
    """The file's bytes, with its external data when it has some. Only a graph under ``GRAPH_PARSED_BELOW``
    is parsed to find its data files (a file that keeps its weights outside is small), so a large single
    file is measured without being read."""
    size = Path(path).stat().st_size
    if size >= GRAPH_PARSED_BELOW:
        return size
    try:
        return file_size(path)
    except Exception:  # not ONNX: load_onnx refuses it next, in its own words
        return size


def is_mapped(path: str | Path) -> bool:
    """True when most of the file's bytes are external data (read tensor by tensor from disk)."""
    graph = Path(path).stat().st_size
    return stored_bytes(path) > 2 * graph


def refuse_if_too_large(path: str | Path, feeds: Sequence[Feed] = (), *, available: int | None = None,
                        max_memory: int | None = None) -> Estimate:
    """Refuse (one line, the figures, what to do) when what no slicing can lower (the process, the weights,
    the data) exceeds the budget: ``max_memory`` bytes when given, else ``available`` (default:
    ``MemAvailable`` now); below it the calibration slices shrink to fit (``slice_budget``). Without ``feeds``
    only the file is counted: call it before reading it."""
    size = stored_bytes(path)
    needed = estimate(size, feeds, mapped=is_mapped(path))
    room = Room.of(max_memory, available)
    if room.bytes is None or needed.fixed < room.bytes:
        return needed
    if feeds and needed.fixed - needed.data_bytes < room.bytes:
        raise DataRefused(f"quantizing {path} on this calibration data needs {needed.describe()}, and {room.source} "
                          f"is {gb(room.bytes)}; give fewer samples (--max-samples) or a smaller --batch-size")
    way_out = (f"give --max-memory at least {gb(needed.fixed - needed.data_bytes)} plus the calibration data"
               if room.source == "--max-memory" else "free memory or quantize it on a machine with more")
    raise FileRefused(f"{path} is {gb(size)}: quantizing it needs {needed.describe()}, and {room.source} is "
                      f"{gb(room.bytes)}; {way_out}")


def literal_part_bytes(needed: Estimate | None, room: Room) -> int:
    """Bytes of weights (stored and dequantized) one literal session of the written file may hold
    (``inspect.run.literal``): what ``room`` leaves after ``needed.fixed``, at most ``LITERAL_PART_BYTES``; a
    file whose weights dequantize to more is read a few layers at a time."""
    if needed is None or room.bytes is None:
        return LITERAL_PART_BYTES
    return max(1, min(LITERAL_PART_BYTES, room.bytes - needed.fixed))


def slice_budget(needed: Estimate, room: Room, one_layer: int, largest: str) -> int:
    """Bytes of exposed tensors calibration may hold at once: what ``room`` leaves after ``needed.fixed``, at
    most ``MEMORY_BUDGET``; refused when that is less than ``one_layer`` (the largest tensor to observe, one
    sample: ``largest``), since no slice can be smaller."""
    if room.bytes is None:
        return MEMORY_BUDGET
    left = room.bytes - needed.fixed
    if left < one_layer:
        raise DataRefused(f"{room.source} {gb(room.bytes)} leaves {gb(max(left, 0))} for calibration after "
                          f"{needed.describe()}; one sample of {largest!r} alone needs {gb(one_layer)}: give at "
                          f"least {gb(needed.fixed + one_layer)}")
    return min(MEMORY_BUDGET, left)
