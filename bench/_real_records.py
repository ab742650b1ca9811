"""bench/real.py's records: one Row per model x path x tool, kept in bench/real_results.json and merged under a lock."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _real_timing import WALL

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ("onnxruntime-cpu", "tensorrt", "openvino", "tigris")
SPEED_TOOL = "quantship-speed:onnxruntime-cpu"  # quantize-onnx --speed-search, the onnxruntime-cpu preset
MODELS = ("ocr_cls", "magika", "ocr_det", "nudenet", "mtcnn_pnet", "mtcnn_rnet", "mtcnn_onet", "ocr_rec")


def row_keys(task_name: str) -> list[tuple[str, str]]:
    """(path, tool) of every row of a model, in table order."""
    keys = [("onnx", "fp32"), ("onnx", "ort-defaults"), ("onnx", "ort-per-channel"), ("onnx", "nncf")]
    if task_name in ("magika", "ocr_rec"):
        keys.append(("onnx", "nncf-transformer"))
    keys += [("onnx", f"quantship:{p}") for p in PRESETS] + [("onnx", SPEED_TOOL)]
    keys += [("pt2e", "fp32")] + [("pt2e", f"quantship:{p}") for p in PRESETS]
    return keys


@dataclass
class Row:
    model: str
    path: str  # "onnx" (a float ONNX file in) or "pt2e" (quantship's PyTorch path)
    tool: str
    status: str = "ok"  # "ok" or the reason the row could not be produced
    scores: dict = field(default_factory=dict)  # reading -> metric -> [k, n]
    size_bytes: int | None = None
    float_size_bytes: int | None = None
    latency_ms: dict = field(default_factory=dict)  # "b1"/"b8" -> [fp32 ms, int8 ms] or a reason string
    seconds: float | None = None  # time to make the file
    notes: str = ""
    commit: str = ""
    measured_utc: str = ""
    load_avg: float | None = None
    retimed_utc: str = ""  # latency_ms re-measured from the kept file (``--retime``), at this time
    retimed_load: float | None = None  # 1-min load average when it was
    # how latency_ms was measured (_real_timing.STEADY or WALL); "" on records from before it was recorded,
    # all of which were measured at default threads by wall time (read it with latency_method_of)
    latency_method: str = ""
    latency_rounds: dict = field(default_factory=dict)  # "b1"/"b8" -> interleaved rounds timed
    # the CPU and its int8 flags the row was measured on (its latency: retimed rows where retimed); "" on records
    # from before it was recorded, all of which were measured on the machine REAL.md's header named then
    cpu: str = ""

    @property
    def key(self) -> str:
        return f"{self.model}|{self.path}|{self.tool}"


def latency_method_of(row: Row) -> str:
    """How the row's latency was measured; a record from before the field holds the older method's figures."""
    return row.latency_method or WALL


def head_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "src", "bench/real.py", "bench/_real_*.py")
    return git("rev-parse", "--short=7", "HEAD") + ("+dirty" if dirty else "")


def load_records(path: Path) -> tuple[dict[str, Row], dict[str, dict]]:
    """(records by key, each model's task description) from the results file."""
    if not path.exists():
        return {}, {}
    doc = json.loads(path.read_text())
    names = {f.name for f in Row.__dataclass_fields__.values()}
    rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in doc["records"]]
    return {r.key: r for r in rows}, doc.get("tasks", {})


def save_records(updates: list[Row], path: Path, tasks: dict[str, dict] | None = None
                 ) -> tuple[dict[str, Row], dict[str, dict]]:
    """Merge ``updates`` (and task descriptions) into the file under a lock (another run may have saved since).

    The lock file lives in the temp folder (never unlinked: a waiting process must lock the same file)."""
    tag = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    with open(Path(tempfile.gettempdir()) / f"quantship-real-{tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records, known = load_records(path)
        records.update({r.key: r for r in updates})
        known.update(tasks or {})
        doc = {"version": 1, "generator": "bench/real.py", "tasks": known,
               "records": [asdict(r) for r in records.values()]}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
    return records, known

