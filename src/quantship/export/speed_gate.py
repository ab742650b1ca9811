"""Speed against FP32 on every quantize, for both front-ends: the INT8 file, still in its scratch folder,
timed against its float reference on this CPU (``inspect.run.speed``), the reading written into the
file's metadata (``SPEED_KEY``) and, with ``require_faster``, a slower file refused before it is moved
into place (nothing written).

Only targets whose runtime is ONNX Runtime on this CPU are timed (``Target.runtime_is_onnxruntime``):
another runtime's speed is its own hardware's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from quantship.errors import SpecRefused, SpeedMissed, one_line
from quantship.export.metadata import add_file_metadata
from quantship.inspect.read.float_ops import SPEED_RECORD_KEY
from quantship.inspect.run.speed import BUDGET_SECONDS, SpeedReading, measure_speed, unmeasured
from quantship.inspect.run.timing import median_ms, single_thread_session
from quantship.progress import step as progress_step
from quantship.targets import Target

SPEED_KEY = "quantship.speed"
SEARCH_KEY = SPEED_RECORD_KEY  # what a placement for speed kept float (by profile, or the speed search)
MARGIN = 0.03  # a step must be this much faster (geometric mean over batches) to be kept: above timing noise
TOLERANCE = 0.01  # and no batch this much slower


def refuse_unmeasurable(target: Target, *, speed: bool, require_faster: bool) -> None:
    """``require_faster`` needs the reading: refused, before any work, without it or on a target whose
    runtime does not run here."""
    if not require_faster:
        return
    if not speed:
        raise SpecRefused("require_faster needs the speed reading: drop --no-speed (speed=False), or "
                          "--require-faster")
    if not target.runtime_is_onnxruntime:
        raise SpecRefused(f"require_faster times the file in ONNX Runtime on this CPU; {target.name}'s runtime "
                          "is not that: time its engine on its own hardware, and drop --require-faster")


def onnx_hint(names: list[str]) -> str:
    """What would help, in quantize-onnx's words."""
    keep = f"keep {' '.join(names)} float with --exclude {' '.join(names)}, or " if names else ""
    return f"{keep}let --speed-search time which weighted ops to keep float on this CPU"


def torch_hint(names: list[str]) -> str:
    """What would help, in quantize's words (its --exclude takes module paths)."""
    keep = f"keep them float with --exclude {' '.join(names)}, or " if names else ""
    return f"{keep}quantize the float ONNX export with quantize-onnx --speed-search"


def gate(staged: str | Path, float_path: str | Path, sample: Mapping[str, np.ndarray], batches: Iterable[int], *,
         require_faster: bool = False, hint: Callable[[list[str]], str] = onnx_hint,
         budget: float = BUDGET_SECONDS) -> SpeedReading:
    """Time the ``staged`` INT8 file against ``float_path`` (``measure_speed``), record the reading in its
    metadata and return it; with ``require_faster`` raise ``SpeedMissed`` when it is slower at any batch or
    could not be measured (the caller then moves nothing into place)."""
    return settle(staged, _measured(staged, float_path, sample, batches, budget), require_faster=require_faster,
                  hint=hint)


def _measured(path: str | Path, float_path: str | Path, sample: Mapping[str, np.ndarray], batches: Iterable[int],
              budget: float) -> SpeedReading:
    with progress_step("speed: the INT8 file against FP32 on this CPU (1 thread)"):
        try:
            return measure_speed(path, float_path, sample, batches, budget=budget)
        except Exception as exc:  # any failure to time: a reading that cannot be made is reported, it never costs the file
            return unmeasured(one_line(exc))


def settle(staged: str | Path, reading: SpeedReading, *, require_faster: bool = False,
           hint: Callable[[list[str]], str] = onnx_hint) -> SpeedReading:
    """``reading`` (``unmeasured`` when there was nothing to time against) with its hint, refused with
    ``require_faster`` when slower or not measured, else recorded in ``staged``'s metadata."""
    if reading.slower:
        reading = replace(reading, hint=hint(reading.keep_float_names()))
    if require_faster and reading.not_measured is not None:
        raise SpeedMissed(f"--require-faster: the speed against FP32 could not be measured ({reading.not_measured}); "
                          "nothing written", reading)
    if require_faster and reading.slower:
        raise SpeedMissed(f"--require-faster: {reading.warning()}; nothing written", reading)
    add_file_metadata(staged, {SPEED_KEY: reading.metadata()})
    return reading


def time_written(path: str | Path, float_path: str | Path, sample: Mapping[str, np.ndarray], batches: Iterable[int],
                 *, require_faster: bool = False, hint: Callable[[list[str]], str] = onnx_hint,
                 budget: float = BUDGET_SECONDS) -> SpeedReading:
    """A file already in place (the searches write their own): timed as ``gate`` does, its metadata left as
    written; with ``require_faster`` a slower (or untimed) file is removed, one unlink, and ``SpeedMissed``
    raised: the path then holds nothing."""
    reading = _measured(path, float_path, sample, batches, budget)
    if reading.slower:
        reading = replace(reading, hint=hint(reading.keep_float_names()))
    if require_faster and (reading.slower or reading.not_measured is not None):
        Path(path).unlink(missing_ok=True)
        why = reading.warning() if reading.slower else f"the speed could not be measured ({reading.not_measured})"
        raise SpeedMissed(f"--require-faster: {why}; the file was removed", reading)
    return reading


def time_files(paths: list[Path], feeds: dict[int, dict[str, np.ndarray]], seconds: float,
          sessions: dict[Path, Any] | None = None) -> list[dict[int, float]]:
    """Each file's median ms per batch, the files interleaved; ``sessions`` caches them by path."""
    cache = {} if sessions is None else sessions
    for path in paths:
        if path not in cache:
            cache[path] = single_thread_session(path)
    per_file: list[dict[int, float]] = [{} for _ in paths]
    for b, feed in feeds.items():
        medians, _ = median_ms([cache[p] for p in paths], feed, seconds)
        for k, ms in enumerate(medians):
            per_file[k][b] = ms
    return per_file


def faster(candidate: dict[int, float], best: dict[int, float]) -> bool:
    """Kept: faster by MARGIN in the geometric mean, and no batch slower by more than TOLERANCE."""
    gains = [best[b] / candidate[b] for b in candidate]
    mean = math.exp(sum(math.log(g) for g in gains) / len(gains))
    return mean >= 1 + MARGIN and min(gains) >= 1 - TOLERANCE
