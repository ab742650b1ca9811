"""Will quantizing this file fit in memory? An estimate from the file size and the calibration data,
compared with what the kernel says is available (``MemAvailable`` in ``/proc/meminfo``).

The working set of ``quantize_onnx_file``: ``MODEL_COPIES`` copies of the weights alive at once (the
loaded proto, the onnx_ir model, the normalised proto, ONNX Runtime's session of it with tensors
exposed), the calibration data held as arrays, and the exposed tensors of one calibration slice,
which ``calibrate.observe`` bounds at ``MEMORY_BUDGET``. A file whose estimate exceeds the
available memory is refused before it is read, with the figure and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from quantship.errors import DataRefused, FileRefused
from quantship.inspect.read.feeds import Feed
from quantship.inspect.read.loading import file_size

# Bytes of exposed tensors held at once (calibration, sensitivity, the weight passes slice to it). Here
# and not in ``calibrate``: the refusal reads it before torch (which calibrate's observers need) loads.
MEMORY_BUDGET = 768 << 20
MODEL_COPIES = 4  # proto, onnx_ir model, normalised proto, ONNX Runtime's session (weights held once each)
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

    @property
    def total(self) -> int:
        return MODEL_COPIES * self.model_bytes + self.data_bytes + self.exposed_bytes

    def describe(self) -> str:
        return (f"about {_gb(self.total)} ({MODEL_COPIES} x {_gb(self.model_bytes)} of weights, {_gb(self.data_bytes)} "
                f"of calibration data, up to {_gb(self.exposed_bytes)} of exposed tensors)")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def estimate(model_bytes: int, feeds: Sequence[Feed] = ()) -> Estimate:
    data = sum(int(a.nbytes) for feed in feeds for a in feed.values())
    batch = max((sum(int(a.nbytes) for a in feed.values()) for feed in feeds), default=0)
    # one slice's exposed tensors (bounded by calibrate) and the batch ORT copies in for the run
    return Estimate(model_bytes, data, MEMORY_BUDGET + batch)


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


def refuse_if_too_large(path: str | Path, feeds: Sequence[Feed] = (), *, available: int | None = None) -> Estimate:
    """Refuse (one line, the figures, what to do) when the estimate exceeds ``available`` bytes
    (default: ``MemAvailable`` now). Without ``feeds`` only the file is counted: call it before reading it."""
    size = stored_bytes(path)
    needed = estimate(size, feeds)
    room = available_bytes() if available is None else available
    if room is None or needed.total <= room:
        return needed
    if not feeds or MODEL_COPIES * size + MEMORY_BUDGET > room:
        raise FileRefused(f"{path} is {_gb(size)}: quantizing it needs {needed.describe()}, and {_gb(room)} is "
                          "available (MemAvailable); free memory or quantize it on a machine with more")
    raise DataRefused(f"quantizing {path} on this calibration data needs {needed.describe()}, and {_gb(room)} is "
                      "available (MemAvailable); give fewer samples (--max-samples) or a smaller --batch-size")
