"""An INT8 file judged against the float file it came from: what lets ``check --run`` and ``compare``
gate a release. Comparing a file with itself (ONNX Runtime literal against fused) proves nothing about
the model: a file whose int8 weights were scrambled reads the same both ways.

The reference is the float file given (``--reference``), else the one the INT8 file's metadata names
(``SOURCE_KEY``: its file name and SHA-256, written by quantize-onnx) when that file lies beside it with
the same digest. Both run on the same inputs; the INT8 file in its target's reading
(``run.consumers.fidelity_reading``); ``quantship.fidelity`` judges each output by the budget.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx

from quantship.errors import DataRefused, FileRefused, cause
from quantship.fidelity import Budget, Fidelity, measure
from quantship.inspect.run.consumers import fidelity_reading, ort_session
from quantship.targets import Target

SOURCE_KEY = "quantship.source"  # {"name": the float file's name, "sha256": its digest}


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def source_record(float_path: str | Path) -> str:
    """The ``SOURCE_KEY`` entry an INT8 file made from ``float_path`` carries."""
    path = Path(float_path)
    return json.dumps({"name": path.name, "sha256": _digest(path)}, sort_keys=True)


def named_reference(int8_path: str | Path) -> tuple[Path | None, str]:
    """The float file the INT8 file's metadata names, when it lies beside it unchanged; and a line saying
    what was found (for a report that says why fidelity was or was not judged)."""
    path = Path(int8_path)
    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    if SOURCE_KEY not in props:
        return None, "the file names no float source (give --reference FLOAT.onnx)"
    try:
        record = json.loads(props[SOURCE_KEY])
        beside = path.parent / Path(record["name"]).name
        digest = record["sha256"]
    except (ValueError, KeyError, TypeError):
        return None, f"the file's {SOURCE_KEY} entry is unreadable (give --reference FLOAT.onnx)"
    if not beside.is_file():
        return None, f"its float source {beside.name} is not beside it (give --reference FLOAT.onnx)"
    if _digest(beside) != digest:
        return None, f"{beside.name} beside it is not the float file it was made from (its digest differs)"
    return beside, f"{beside.name}, named by the file's metadata"


def _outputs(session, feeds: Sequence[dict[str, np.ndarray]]) -> list[np.ndarray]:
    runs = [session.run(None, feed) for feed in feeds]
    return [np.concatenate([r[k] for r in runs]) for k in range(len(runs[0]))]


def judge_reference(int8_path: str | Path, float_path: str | Path, feeds: Sequence[dict[str, np.ndarray]],
                    target: Target, budget: Budget | None, data: str) -> Fidelity:
    """Each output of the INT8 file against the float file's, on ``feeds`` (one dict per batch, by input
    name), judged by ``budget``. Files whose inputs or outputs differ are refused (not the same model)."""
    try:
        reference_session = ort_session(Path(float_path), optimized=True)
    except Exception as exc:
        raise FileRefused(f"the reference {float_path} does not load in ONNX Runtime: {cause(exc)}") from exc
    fused, runtime = fidelity_reading(target)
    session = ort_session(Path(int8_path), optimized=fused)
    names = [o.name for o in session.get_outputs()]
    theirs = [o.name for o in reference_session.get_outputs()]
    if sorted(i.name for i in session.get_inputs()) != sorted(i.name for i in reference_session.get_inputs()):
        raise DataRefused(f"the reference {float_path} takes inputs {[i.name for i in reference_session.get_inputs()]}"
                          f" and the INT8 file {[i.name for i in session.get_inputs()]}: not the same model")
    if len(names) != len(theirs):
        raise DataRefused(f"the reference {float_path} has outputs {theirs} and the INT8 file {names}: not the "
                          "same model")
    try:
        reference = _outputs(reference_session, feeds)
        outputs = _outputs(session, feeds)
    except Exception as exc:
        raise DataRefused(f"the inputs do not run through both files: {cause(exc)}") from exc
    return measure(names, reference, outputs, budget=budget, data=data, runtime=runtime)
