"""Real pretrained models and their tasks: FP32, ORT's quantizer, NNCF and quantship side by side.

Every model of ``quantship.examples.real`` (weights inside installed packages, data generated here,
ground truth) is scored as FP32, then as INT8 made by each tool: ONNX Runtime's ``quantize_static``
(QDQ, defaults and per-channel), NNCF's ``nncf.quantize`` (ONNX backend, defaults and
``model_type=TRANSFORMER`` where it applies), ``quantship quantize-onnx --target T`` run as a user
runs it (a subprocess, one per preset), and quantship's PyTorch path (``Quantizer.for_target(T)``
+ ``export_qdq``) where a PyTorch model exists. Each INT8 file is scored in ONNX Runtime at its
default optimizations (what users run) and read literally (optimizations off; on a subset where
that is slow), in torch for the PyTorch path, and in OpenVINO / TiGrIS's host runtime for the
openvino / tigris presets' files. Latency: FP32 and INT8 files in ONNX Runtime at batch 1 and 8,
interleaved in the same run, median. A row that cannot be produced keeps its reason.

Rows are cached in bench/real_results.json keyed by (model, path, tool); REAL.md is rendered from
every record.

    python bench/real.py                          # every model, every row (27 min on 2 idle cores)
    python bench/real.py --models ocr_cls,magika  # only these models' rows are re-measured
    python bench/real.py --rows quantship         # only rows whose key contains this substring
    python bench/real.py --smoke                  # tiny sizes, one repetition, into a temp dir
    python bench/real.py --render                 # REAL.md from the records only
    python bench/real.py --keep DIR               # ... and keep every INT8 file in DIR
    python bench/real.py --retime DIR             # latency only, again, from those files (an idle machine)
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "real_results.json"
REAL_MD = ROOT / "REAL.md"
PRESETS = ("onnxruntime-cpu", "tensorrt", "openvino", "tigris")
CONSUMER_OF = {"openvino": "openvino", "tigris": "tigris"}  # preset -> the runtime its file is also scored in


# ---------------------------------------------------------------- tasks

@dataclass
class Task:
    """One model with its data: what every row of that model is scored on."""

    model: str
    title: str
    float_path: Path
    calib: np.ndarray
    eval_x: np.ndarray
    score: Callable[[np.ndarray, np.ndarray | None], dict]  # (outputs, FP32 outputs or None) -> {metric: Count}
    metrics: tuple[str, ...]  # names, the task metric first
    eval_batch: int = 64
    calib_batch: int = 8
    subset: int | None = None  # samples for the slow readings (ORT literal, torch INT8, TiGrIS); None: all
    reps: tuple[int, int] = (20, 10)  # latency repetitions at batch 1 and 8
    torch_model: Callable[[], object] | None = None
    transformer: bool = False  # NNCF's model_type=TRANSFORMER applies
    notes: str = ""
    data: str = ""


def _example(x: np.ndarray):
    """One input of a model (what onnx2torch's shape folding runs once)."""
    import torch

    return torch.from_numpy(x[:1])


def _ocr_cls(smoke: bool) -> Task:
    from quantship.examples.real import ocr_cls
    from quantship.examples.real.convert import to_torch

    n = 48 if smoke else 600
    lines, calib = ocr_cls.make_lines(n, seed=0), ocr_cls.make_lines(16 if smoke else 64, seed=1)

    def score(out, ref):
        result = {"accuracy": ocr_cls.accuracy(out, lines.y[:len(out)])}
        if ref is not None:
            result["agrees with FP32"] = ocr_cls.agreement(out, ref)
        return result

    return Task("ocr_cls", "PP-OCR text-orientation classifier (rapidocr-onnxruntime 1.4.4, "
                "`ch_ppocr_mobile_v2.0_cls_infer.onnx`, 0.6 MB)", ocr_cls.model_path(), calib.x, lines.x, score,
                ("accuracy", "agrees with FP32"), subset=None if smoke else 200, reps=(1, 1) if smoke else (20, 10),
                torch_model=lambda: to_torch(ocr_cls.model_path(), _example(calib.x)),
                data=f"{n} rendered lines (seed 0), half rotated 180 degrees; calibration: {len(calib.y)} other "
                     "lines (seed 1); rapidocr's resize/normalise to 3 x 48 x 192")


def _magika(smoke: bool) -> Task:
    from quantship.examples.real import magika_files

    n_cal = 16 if smoke else 300
    n = 48 if smoke else 2000
    files = magika_files.make_files(n, seed=0, skip=n_cal)
    calib = magika_files.make_files(n_cal, seed=0, skip=0)
    labels = sorted({magika_files.labels_space()[i] for i in files.y})

    def score(out, ref):
        result = {"accuracy": magika_files.accuracy(out, files.y[:len(out)])}
        if ref is not None:
            result["agrees with FP32"] = magika_files.agreement(out, ref)
        return result

    def no_torch():
        from quantship.examples.real.convert import to_torch

        return to_torch(magika_files.model_path(), _example(calib.x))

    return Task("magika", "magika 1.0.3 file-type model (`standard_v3_3/model.onnx`, 3.2 MB, int32 input "
                "`bytes` [N, 2048], 214 labels)", magika_files.model_path(), calib.x, files.x, score,
                ("accuracy", "agrees with FP32"), eval_batch=250, calib_batch=10, subset=None if smoke else 500,
                reps=(1, 1) if smoke else (20, 10), torch_model=no_torch, transformer=True,
                data=f"{n} files of this machine ({len(labels)} labels from unambiguous extensions, drawn round-robin "
                     f"over labels, seed 0) after {n_cal} calibration files of the same draw (disjoint); "
                     "magika's own feature extraction; top-1 label before magika's thresholds")


def _ocr_det(smoke: bool) -> Task:
    from quantship.examples.real import ocr_det
    from quantship.examples.real.convert import to_torch

    n = 2 if smoke else 40
    pages, calib = ocr_det.make_pages(n, seed=0), ocr_det.make_pages(1 if smoke else 8, seed=1)

    def score(out, ref):
        found = [ocr_det.detect(out[i:i + 1]) for i in range(len(out))]
        recall, precision = ocr_det.recall_precision(found, pages.boxes[:len(out)])
        return {"line recall": recall, "precision": precision}

    return Task("ocr_det", "PP-OCRv4 text detector (rapidocr-onnxruntime 1.4.4, `ch_PP-OCRv4_det_infer.onnx`, "
                "4.7 MB)", ocr_det.model_path(), calib.x, pages.x, score, ("line recall", "precision"),
                eval_batch=1, calib_batch=1, subset=None if smoke else 10, reps=(1, 1) if smoke else (5, 2),
                torch_model=lambda: to_torch(ocr_det.model_path(), _example(calib.x)),
                data=f"{n} rendered pages of 736 x 992 (seed 0), {sum(len(b) for b in pages.boxes)} lines; "
                     f"calibration: {len(calib.x)} other pages (seed 1); rapidocr's DetPreProcess and DB "
                     "post-processing with its packaged config; IoU >= 0.5, one-to-one")


def _nudenet(smoke: bool) -> Task:
    from quantship.examples.real import nudenet_yolo
    from quantship.examples.real.convert import to_torch

    n = 8 if smoke else 200
    images, calib = nudenet_yolo.make_images(n, seed=0), nudenet_yolo.make_images(4 if smoke else 32, seed=1)

    def score(out, ref):
        if ref is None:
            dets = [nudenet_yolo.detect(out[i:i + 1], images.meta[i]) for i in range(len(out))]
            from quantship.examples.real import Count

            return {"FP32 detections reproduced": Count(sum(map(len, dets)), sum(map(len, dets)))}
        mine = [nudenet_yolo.detect(out[i:i + 1], images.meta[i]) for i in range(len(out))]
        theirs = [nudenet_yolo.detect(ref[i:i + 1], images.meta[i]) for i in range(len(out))]
        reproduced, kept = nudenet_yolo.reproduced(theirs, mine)
        return {"FP32 detections reproduced": reproduced, "detections FP32 has": kept}

    return Task("nudenet", "nudenet 3.4.2 detector (`320n.onnx`, YOLOv8n, 12 MB, opset 17): no labelled data here, "
                "fidelity to FP32 only", nudenet_yolo.model_path(), calib.x, images.x, score,
                ("FP32 detections reproduced", "detections FP32 has"), eval_batch=8, calib_batch=4,
                subset=None if smoke else 64, reps=(1, 1) if smoke else (10, 4),
                torch_model=lambda: to_torch(nudenet_yolo.model_path(), _example(calib.x)),
                data=f"{n} random crops of the photos shipped in matplotlib/scikit-learn (seed 0), letterboxed by "
                     f"nudenet's own `_read_image`; calibration: {len(calib.x)} other crops (seed 1); decoded by "
                     "nudenet's `_postprocess` (score >= 0.2, NMS); a detection is reproduced by one of the same "
                     "class at IoU >= 0.5")


def _mtcnn(net: str, smoke: bool, workdir: Path) -> Task:
    from quantship.examples.real import mtcnn

    n = 32 if smoke else 600
    crops, calib = mtcnn.make_crops(n, seed=0), mtcnn.make_crops(16 if smoke else 64, seed=1)

    def model():
        return mtcnn.FaceProbability(mtcnn.load_net(net))

    float_path = workdir / f"mtcnn_{net}_fp32.onnx"
    if not float_path.exists():
        import torch

        from quantship import export_onnx

        export_onnx(model(), torch.from_numpy(crops.x[net][:1]), float_path, dynamic_batch=True,
                    input_names=["x"], output_names=["face_probability"])

    def score(out, ref):
        result = {"face accuracy": mtcnn.accuracy(out, crops.y[:len(out)])}
        if ref is not None:
            result["agrees with FP32"] = mtcnn.agreement(out, ref)
        return result

    size = mtcnn.NETS[net]
    return Task(f"mtcnn_{net}", f"facenet-pytorch 2.6.0 MTCNN {net.upper()} ({size} x {size}; PyTorch weights "
                f"`data/{net}.pt`; FP32 ONNX by `quantship.export_onnx`)", float_path, calib.x[net], crops.x[net],
                score, ("face accuracy", "agrees with FP32"), reps=(1, 1) if smoke else (20, 10), torch_model=model,
                data=f"{n} square crops (seed 0), half faces (IoU >= 0.65 with the face facenet-pytorch's FP32 MTCNN "
                     f"finds in grace_hopper.jpg), half not (IoU < 0.3, or other photos); calibration: "
                     f"{len(calib.y)} other crops (seed 1)")


def make_task(name: str, smoke: bool, workdir: Path) -> Task:
    if name.startswith("mtcnn_"):
        return _mtcnn(name.removeprefix("mtcnn_"), smoke, workdir)
    return {"ocr_cls": _ocr_cls, "magika": _magika, "ocr_det": _ocr_det, "nudenet": _nudenet}[name](smoke)


MODELS = ("ocr_cls", "magika", "ocr_det", "nudenet", "mtcnn_pnet", "mtcnn_rnet", "mtcnn_onet")


def row_keys(task_name: str) -> list[tuple[str, str]]:
    """(path, tool) of every row of a model, in table order."""
    keys = [("onnx", "fp32"), ("onnx", "ort-defaults"), ("onnx", "ort-per-channel"), ("onnx", "nncf")]
    if task_name == "magika":
        keys.append(("onnx", "nncf-transformer"))
    keys += [("onnx", f"quantship:{p}") for p in PRESETS]
    keys += [("pt2e", "fp32")] + [("pt2e", f"quantship:{p}") for p in PRESETS]
    return keys


# ---------------------------------------------------------------- records

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

    @property
    def key(self) -> str:
        return f"{self.model}|{self.path}|{self.tool}"


def head_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "src", "bench/real.py")
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
    import hashlib

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


# ---------------------------------------------------------------- running files

class Refused(RuntimeError):
    """quantship's command exited without writing the file; the message is its own one-line reason."""


def first_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if isinstance(exc, BaseException) and not isinstance(exc, Refused):
        line = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return line[:400]


def static_batch(path: Path) -> int | None:
    """The file's fixed batch size, or None when dimension 0 is dynamic."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    first = next(i for i in model.graph.input if i.name not in inits)
    dim = first.type.tensor_type.shape.dim[0]
    return dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None


def input_name(path: Path) -> str:
    from quantship.inspect.run.consumers import ort_session

    return ort_session(path).get_inputs()[0].name


def batched(x: np.ndarray, size: int) -> list[np.ndarray]:
    return [x[i:i + size] for i in range(0, len(x), size)]


def run_ort(path: Path, x: np.ndarray, batch: int, optimized: bool = True) -> np.ndarray:
    from quantship.inspect.run.consumers import ort_session

    session = ort_session(path, optimized=optimized)
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: b})[0] for b in batched(x, batch)])


def run_torch(model, x: np.ndarray, batch: int) -> np.ndarray:
    import torch

    with torch.no_grad():
        outs = []
        for b in batched(x, batch):
            out = model(torch.from_numpy(b))
            outs.append(torch.as_tensor(out[0] if isinstance(out, (tuple, list)) else out).numpy())
    return np.concatenate(outs)


def run_consumer(consumer: str, path: Path, x: np.ndarray, batch: int) -> np.ndarray:
    import onnx

    from quantship.inspect.run.consumers import run_openvino, run_tigris

    name = input_name(path)
    if consumer == "tigris":
        batch = 1  # a TiGrIS plan is compiled for batch 1 whatever the file declares
    feeds = [{name: b} for b in batched(x, batch)]
    if consumer == "openvino":
        outs = run_openvino(path, feeds)
    else:
        outs = run_tigris(path, feeds, onnx.load(str(path), load_external_data=False))
    return np.concatenate([np.asarray(o[0]) for o in outs])


def latency(float_path: Path, int8_path: Path, x: np.ndarray, reps: tuple[int, int]) -> dict:
    """Median ms of FP32 and INT8 in ONNX Runtime (default optimizations), interleaved, batch 1 and 8."""
    from quantship.inspect.run.consumers import ort_session

    fixed = static_batch(int8_path)
    sessions = [ort_session(float_path, optimized=True), ort_session(int8_path, optimized=True)]
    result = {}
    for label, batch, n in (("b1", 1, reps[0]), ("b8", 8, reps[1])):
        if fixed is not None and fixed != batch:
            result[label] = f"the file has a static batch of {fixed}"
            continue
        if len(x) < batch:
            result[label] = f"fewer than {batch} samples"
            continue
        result[label] = interleaved_ms(sessions, x[:batch], n)
    return result


def interleaved_ms(sessions: list, feed: np.ndarray, n: int) -> list[float]:
    """Median ms of each session on ``feed`` (its first input), after one warm-up run each, the sessions
    run in turn ``n`` times (so a change in the machine's load reaches all of them alike)."""
    names = [s.get_inputs()[0].name for s in sessions]
    for s, name in zip(sessions, names):
        s.run(None, {name: feed})
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(n):
        for i, (s, name) in enumerate(zip(sessions, names)):
            start = time.perf_counter()
            s.run(None, {name: feed})
            times[i].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def counts(scores: dict) -> dict:
    return {name: [c.k, c.n] for name, c in scores.items()}


class Runner:
    """Scores files and models of one task; FP32 outputs are computed once."""

    def __init__(self, task: Task, workdir: Path):
        self.task, self.workdir = task, workdir

    @functools.cached_property
    def reference(self) -> np.ndarray:
        return run_ort(self.task.float_path, self.task.eval_x, self.task.eval_batch)

    def subset(self) -> np.ndarray:
        return self.task.eval_x[:self.task.subset] if self.task.subset else self.task.eval_x

    def score_file(self, row: Row, path: Path, preset: str | None = None) -> None:
        t = self.task
        fixed = static_batch(path)
        batch = fixed or t.eval_batch
        ref = self.reference
        row.scores["ort"] = counts(t.score(run_ort(path, t.eval_x, batch), ref))
        sub = self.subset()
        row.scores["ort-literal"] = counts(t.score(run_ort(path, sub, batch, optimized=False), ref[:len(sub)]))
        consumer = CONSUMER_OF.get(preset or "")
        if consumer:
            x = t.eval_x if consumer == "openvino" else sub
            try:
                row.scores[consumer] = counts(t.score(run_consumer(consumer, path, x, batch), ref[:len(x)]))
            except Exception as exc:  # the consumer would not compile or run the file: its reason is the cell
                row.scores[consumer] = first_line(exc)
        row.size_bytes = path.stat().st_size
        row.float_size_bytes = t.float_path.stat().st_size
        row.latency_ms = latency(t.float_path, path, t.eval_x, t.reps)


# ---------------------------------------------------------------- tools

class CalibReader:
    """ONNX Runtime's calibration reader over the calibration array."""

    def __init__(self, name: str, calib: np.ndarray, batch: int):
        self.feeds = iter([{name: b} for b in batched(calib, batch)])

    def get_next(self):
        return next(self.feeds, None)

    def rewind(self):  # not used by MinMax
        pass


def ort_quantize(task: Task, out: Path, per_channel: bool) -> str:
    """ORT's documented flow: ``quant_pre_process`` then ``quantize_static`` (QDQ, defaults otherwise).
    Where pre-processing fails, the file as shipped is quantized and the note says why."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quant_pre_process, quantize_static

    class Reader(CalibReader, CalibrationDataReader):
        pass

    source, note = task.float_path, ""
    pre = out.with_name(out.stem + "_pre.onnx")
    try:
        quant_pre_process(str(task.float_path), str(pre))
        source = pre
    except Exception as exc:  # ORT's pre-processing refuses some real files: quantize the file as shipped
        note = f"quant_pre_process failed ({first_line(exc)}); quantized the file as shipped"
    quantize_static(str(source), str(out), Reader(input_name(task.float_path), task.calib, task.calib_batch),
                    quant_format=QuantFormat.QDQ, per_channel=per_channel)
    return note


def nncf_quantize(task: Task, out: Path, transformer: bool) -> str:
    import nncf
    import onnx

    name = input_name(task.float_path)
    items = [{name: b} for b in batched(task.calib, task.calib_batch)]
    extra = {"model_type": nncf.ModelType.TRANSFORMER} if transformer else {}
    # subset_size counts dataset items (batches here): every calibration sample is used
    quantized = nncf.quantize(onnx.load(str(task.float_path)), nncf.Dataset(items), subset_size=len(items), **extra)
    onnx.save(quantized, str(out))
    return ""


def quantship_cli(task: Task, out: Path, preset: str) -> str:
    """``quantship quantize-onnx FLOAT --calib CAL.npy --out OUT --target T``, as a user runs it.

    Raises ``Refused`` with the command's one-line message when it writes nothing."""
    calib = out.with_name(f"{task.model}_calib.npy")
    np.save(calib, task.calib)  # the dtype the input declares (int32 for magika, float32 otherwise)
    exe = Path(sys.executable).parent / "quantship"
    command = [str(exe) if exe.exists() else (shutil.which("quantship") or "quantship"), "quantize-onnx",
               str(task.float_path), "--calib", str(calib), "--out", str(out), "--target", preset]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode == 1 and out.exists():  # written; its own check did not accept it (exit 1): scored, said
        verdicts = [ln.strip(" │|") for ln in done.stdout.splitlines() if re.search(r"check \S+ --run", ln)]
        return f"written; quantize-onnx exit 1, its check: {' '.join(verdicts[-1].split()) if verdicts else '?'}"[:300]
    if done.returncode != 0 or not out.exists():
        lines = [ln.strip() for ln in (done.stderr + "\n" + done.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if re.match(r"^(error|quantship|refused)", ln, re.I)]
        message = (errors or lines or ["no message"])[-1].replace(str(task.float_path), task.float_path.name)
        message = re.sub(r"^quantship quantize-onnx: error: ", "", message)
        raise Refused(f"`quantize-onnx` refused (exit {done.returncode}): {message[:400]}")
    return ""


def pt2e_quantize(task: Task, model, out: Path, preset: str):
    import torch

    from quantship import Quantizer, export_qdq

    batches = [torch.from_numpy(b) for b in batched(task.calib, task.calib_batch)]
    quantizer = Quantizer.for_target(preset)
    qmodel = quantizer.quantize(model, batches, max_calibration_samples=len(task.calib))
    export_qdq(qmodel, torch.from_numpy(task.eval_x[:1]), out, target=preset)
    note = ""
    report = getattr(quantizer, "report", None)
    if report is not None and getattr(report, "float_ops", None):
        from quantship.quantize.pt2e import describe_float_ops

        note = f"kept in float (no role): {describe_float_ops(report)}"
    return qmodel, note


def int8_path(task: Task, path_kind: str, tool: str, workdir: Path) -> Path:
    """Where a row's INT8 file is written (and kept, with ``--keep``, under the same name)."""
    if path_kind == "pt2e":
        return workdir / f"{task.model}_pt2e_{tool.removeprefix('quantship:')}.onnx"
    return workdir / f"{task.model}_{tool.replace(':', '_')}.onnx"


def measure(task: Task, runner: Runner, path_kind: str, tool: str, workdir: Path,
            torch_cache: dict) -> Row:
    row = Row(task.model, path_kind, tool)
    t = task
    start = time.perf_counter()
    try:
        if path_kind == "onnx" and tool == "fp32":
            row.scores["ort"] = counts(t.score(runner.reference, None))
            row.size_bytes = row.float_size_bytes = t.float_path.stat().st_size
            row.latency_ms = latency(t.float_path, t.float_path, t.eval_x, t.reps)
            return row
        if path_kind == "pt2e":
            if "model" not in torch_cache:
                try:
                    torch_cache["model"] = t.torch_model()
                except Exception as exc:  # onnx2torch has no converter for an op of this file
                    torch_cache["model"] = exc
            model = torch_cache["model"]
            if isinstance(model, Exception):
                row.status = f"no PyTorch model: onnx2torch conversion failed ({first_line(model)})"
                return row
            if tool == "fp32":
                row.scores["torch"] = counts(t.score(run_torch(model, t.eval_x, t.eval_batch), runner.reference))
                return row
            preset = tool.removeprefix("quantship:")
            out = int8_path(t, path_kind, tool, workdir)
            qmodel, row.notes = pt2e_quantize(t, model, out, preset)
            row.seconds = time.perf_counter() - start
            sub = runner.subset()
            row.scores["torch"] = counts(t.score(run_torch(qmodel, sub, t.eval_batch), runner.reference[:len(sub)]))
            runner.score_file(row, out, preset)
            return row
        out = int8_path(t, path_kind, tool, workdir)
        preset = None
        if tool.startswith("ort-"):
            row.notes = ort_quantize(t, out, per_channel=tool == "ort-per-channel")
        elif tool.startswith("nncf"):
            row.notes = nncf_quantize(t, out, transformer=tool == "nncf-transformer")
        else:
            preset = tool.removeprefix("quantship:")
            row.notes = quantship_cli(t, out, preset)
        row.seconds = time.perf_counter() - start
        runner.score_file(row, out, preset)
    except Exception as exc:  # the row cannot be produced: its reason is the record
        if not isinstance(exc, Refused):
            traceback.print_exc()
        row.status = first_line(exc)
        if row.seconds is None:
            row.seconds = time.perf_counter() - start
    return row


# ---------------------------------------------------------------- REAL.md

def _pct(k: int, n: int) -> str:
    from quantship.intervals import wilson_interval

    if not n:
        return "0/0"
    lo, hi = wilson_interval(k, n)
    return f"{k}/{n} {100 * k / n:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def _cell(row: Row, reading: str, metric: str) -> str:
    value = row.scores.get(reading)
    if value is None:
        return "-"
    if isinstance(value, str):
        return f"not run: {value}"
    if metric not in value:
        return "-"
    return _pct(*value[metric])


def _latency(row: Row, key: str) -> str:
    value = row.latency_ms.get(key)
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    fp32, int8 = value
    if row.tool == "fp32":
        return f"{fp32:.3g}"
    return f"{fp32:.3g} / {int8:.3g} ({fp32 / int8:.2f}x)"


def _short_note(note: str) -> str:
    """A long 'kept in float' list as its count and its first entries."""
    head = "kept in float (no role): "
    if note.startswith(head):
        items = note.removeprefix(head).split("; ")
        if len(items) > 3:
            return f"{head}{len(items)} ops ({'; '.join(items[:3])}; ...)"
    return note


def _size(row: Row) -> str:
    if not row.size_bytes:
        return "-"
    if row.float_size_bytes and row.size_bytes != row.float_size_bytes:
        return f"{row.size_bytes / 1e6:.2f} MB ({row.size_bytes / row.float_size_bytes:.2f}x FP32)"
    return f"{row.size_bytes / 1e6:.2f} MB"


PENDING = "not measured yet: the run was stopped before this row (re-run `python bench/real.py --models MODEL`)"

TOOL_NAMES = {
    "fp32": "FP32", "ort-defaults": "ORT `quantize_static` (QDQ, defaults)",
    "ort-per-channel": "ORT `quantize_static` (QDQ, per_channel=True)", "nncf": "NNCF `nncf.quantize` (defaults)",
    "nncf-transformer": "NNCF (`model_type=TRANSFORMER`)",
}


def render(records: dict[str, Row], tasks: dict[str, dict], smoke: bool = False) -> str:
    import onnxruntime as ort
    import torch

    from quantship.inspect.run.consumers import cpu_info

    cpu, flags = cpu_info()
    int8_flags = sorted(f for f in flags if f in {"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8",
                                                   "avx512_bf16", "amx_bf16", "avxvnni"})
    versions = []
    for module in ("onnxruntime", "nncf", "openvino", "onnx2torch", "tigris"):
        try:
            from importlib.metadata import version

            versions.append(f"{module} {version(module if module != 'tigris' else 'tigris-ml')}")
        except Exception:  # not installed: say so
            versions.append(f"{module} not installed")
    rows = list(records.values())
    commits = sorted({r.commit for r in rows if r.commit})
    times = sorted(r.measured_utc for r in rows if r.measured_utc)
    loads = [r.load_avg for r in rows if r.load_avg is not None]
    retimed = [r for r in rows if r.retimed_utc]
    retimed_loads = [r.retimed_load for r in retimed if r.retimed_load is not None]
    lines = [
        "# Real pretrained models: FP32, ONNX Runtime's quantizer, NNCF and quantship on real tasks", "",
        "Generated by `python bench/real.py` from `bench/real_results.json` (one record per model x path x tool, "
        "with the commit and UTC time it was measured at); do not edit by hand."
        + (" **SMOKE RUN: tiny sizes, not figures.**" if smoke else ""), "",
        f"- CPU: {cpu}; int8-relevant flags: {' '.join(int8_flags) or 'none found'}; {os.cpu_count()} cores "
        f"(1-min load average when each row finished: {f'{min(loads):.1f}..{max(loads):.1f}' if loads else '-'}); "
        "latencies are FP32 and INT8 interleaved in the same run, median"
        + ("; under a load above the core count, as here, even the ratios move from row to row (compare each "
           "FP32 column across rows of a model): read them as rough, and re-measure on an idle machine "
           "(`--keep`, then `--retime`) before quoting one"
           if loads and max(loads) > 1.5 * (os.cpu_count() or 1) else
           "; nothing else ran on the machine, yet the FP32 columns of one model still move by up to 1.8x "
           "between rows at batch 1 (20 short runs each): read a ratio within 0.8-1.25 as a tie"),
        f"- Python {platform.python_version()}, torch {torch.__version__}, onnxruntime {ort.__version__}; "
        + ", ".join(versions),
        f"- commits: {', '.join(commits) or '-'}; measured {times[0] if times else '-'} .. {times[-1] if times else '-'}",
        "- Every cell of a metric is `k/n percent [Wilson 95% interval]`. Readings: **ORT** = the file in ONNX "
        "Runtime at its default optimizations (what `InferenceSession(path)` runs); **ORT literal** = optimizations "
        "off (the arithmetic the Q/DQ pairs describe), on the subset named per model; **torch** = the quantized "
        "model in PyTorch (PyTorch path), on the same subset; OpenVINO (CPU, f32 inference precision, as "
        "quantship's consumers run it) for the openvino preset's file, TiGrIS's host runtime (its compiled plan, "
        "subset) for the tigris preset's file. Second metric: agreement of the top-1 answer with FP32 (ORT) on "
        "the same samples.",
        "- Latency: ONNX Runtime, default optimizations, default threads; FP32 file / INT8 file in ms (speed-up), "
        "batch 1 and batch 8 (a ratio above 1 is faster than FP32). Size: the INT8 file on disk, and its size "
        "as a multiple of the FP32 file's."
        + (f" Latency of {len(retimed)} of {len(rows)} rows re-timed from the same files in a later, quieter run "
           f"(`--keep` then `--retime`), {min(r.retimed_utc for r in retimed)} .. "
           f"{max(r.retimed_utc for r in retimed)}, 1-min load average "
           f"{min(retimed_loads):.1f}..{max(retimed_loads):.1f}." if retimed and retimed_loads else ""),
        "- Tools: ORT = `onnxruntime.quantization.quantize_static` after `quant_pre_process` as ORT documents "
        "(where pre-processing fails, the file as shipped, noted), QDQ format, MinMax; NNCF = `nncf.quantize` on "
        "the `onnx.ModelProto` (ONNX backend), `subset_size` = the calibration set; quantship ONNX path = the "
        "command `quantship quantize-onnx FLOAT.onnx --calib CAL.npy --out INT8.onnx --target T` in a subprocess, "
        "calibration array in the input's own dtype; quantship PyTorch path = `Quantizer.for_target(T).quantize` "
        "+ `export_qdq(..., target=T)` on the PyTorch model (the wheel's for MTCNN; `onnx2torch` 1.5.15 after "
        "lifting Constants to initializers and freezing constant Reshape/Resize arguments, "
        "`quantship.examples.real.convert`, for the ONNX models). All tools get the same calibration data.",
        "",
    ]
    order = {m: i for i, m in enumerate(MODELS)}
    models = sorted({r.model for r in rows}, key=lambda m: order.get(m, 99))
    never = [m for m in MODELS if m not in models]
    if never:
        lines += [f"- Not measured yet (the run was stopped before them): {', '.join(never)}", ""]
    summary = [("onnx", "fp32"), ("onnx", "ort-defaults"), ("onnx", "ort-per-channel"), ("onnx", "nncf"),
               ("onnx", "quantship:onnxruntime-cpu"), ("pt2e", "quantship:onnxruntime-cpu")]
    lines += ["## Summary: the task metric of each file in ONNX Runtime (default optimizations)", "",
              "| model | metric | FP32 | ORT defaults | ORT per-channel | NNCF | quantship ONNX path, onnxruntime-cpu "
              "| quantship PyTorch path, onnxruntime-cpu |", "|---|---|---|---|---|---|---|---|"]
    for model in models:
        info = tasks.get(model, {})
        metric = (info.get("metrics") or ["-"])[0]
        cells = []
        for key in summary:
            r = records.get(f"{model}|{key[0]}|{key[1]}")
            if r is None:
                cells.append("not run")
            elif r.status != "ok":
                cells.append("not produced (reason below)")
            else:
                cells.append(_cell(r, "ort", metric))
        lines.append(f"| {model} | {metric} | " + " | ".join(cells) + " |")
    lines.append("")
    for model in models:
        info = tasks.get(model, {})
        metrics = info.get("metrics") or sorted({m for r in rows if r.model == model for v in r.scores.values()
                                                 if isinstance(v, dict) for m in v})
        primary, secondary = metrics[0], (metrics[1] if len(metrics) > 1 else None)
        lines += [f"## {info.get('title', model)}", "", f"Data: {info.get('data', '-')}.", ""]
        if info.get("subset"):
            lines += [f"Slow readings (ORT literal, torch, TiGrIS) on the first {info['subset']} samples.", ""]
        head = (f"| path | tool / preset | {primary}, ORT | {primary}, ORT literal | {primary}, torch | "
                f"{primary}, OpenVINO / TiGrIS | " + (f"{secondary}, ORT | " if secondary else "")
                + "size | ms b1 FP32 / INT8 | ms b8 FP32 / INT8 | status, notes |")
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        keys = row_keys(model)
        mine = sorted((r for r in rows if r.model == model),
                      key=lambda r: keys.index((r.path, r.tool)) if (r.path, r.tool) in keys else 99)
        measured = {(r.path, r.tool) for r in mine}
        pending = [Row(model, p, t, status=PENDING) for p, t in keys if (p, t) not in measured]
        for r in mine + pending:
            consumer = next((c for c in ("openvino", "tigris") if c in r.scores), None)
            status = "ok" if r.status == "ok" else f"**not produced**: {r.status}"
            if r.notes:
                status += f"; {_short_note(r.notes)}"
            tool = TOOL_NAMES.get(r.tool, f"quantship `{r.tool.removeprefix('quantship:')}`")
            if r.path == "pt2e" and r.tool == "fp32":
                tool = "FP32 in PyTorch"
            lines.append(
                f"| {'ONNX' if r.path == 'onnx' else 'PyTorch (pt2e)'} | {tool} | {_cell(r, 'ort', primary)} | "
                f"{_cell(r, 'ort-literal', primary)} | {_cell(r, 'torch', primary)} | "
                f"{(consumer + ': ' + _cell(r, consumer, primary)) if consumer else '-'} | "
                + (f"{'reference' if (r.path, r.tool) == ('onnx', 'fp32') else _cell(r, 'torch' if r.tool == 'fp32' else 'ort', secondary)} | "
                   if secondary else "")
                + f"{_size(r)} | {_latency(r, 'b1')} | {_latency(r, 'b8')} | {status} |")
        lines.append("")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--rows", default=None,
                        help="re-measure only rows whose 'model|path|tool' contains this (comma-separated: any of them)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition, into a temp dir")
    parser.add_argument("--render", action="store_true", help="only render REAL.md from the records")
    parser.add_argument("--results", type=Path, default=None, help="records file (default bench/real_results.json)")
    parser.add_argument("--out", type=Path, default=None, help="markdown file (default REAL.md)")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep every INT8 file written in DIR (for --retime)")
    parser.add_argument("--retime", type=Path, default=None, metavar="DIR",
                        help="re-measure only the latency of the rows whose files --keep left in DIR (on an idle "
                             "machine), keeping every other figure")
    args = parser.parse_args(argv)
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {list(MODELS)}")
    scratch = None
    if args.smoke:
        scratch = Path(tempfile.mkdtemp(prefix="quantship-real-smoke-"))
        os.environ.setdefault("QUANTSHIP_CACHE", str(scratch / "cache"))
        if args.models == ",".join(MODELS):
            chosen = ["ocr_cls"]
    results = args.results or (scratch / "real_results.json" if scratch else RESULTS)
    out_md = args.out or (scratch / "REAL.md" if scratch else REAL_MD)
    if args.smoke and out_md.resolve() == REAL_MD.resolve():
        parser.error("a smoke run never writes REAL.md")
    if args.render:
        out_md.write_text(render(*load_records(results), smoke=args.smoke))
        print(f"wrote {out_md}")
        return 0
    if args.retime:
        return retime(chosen, args.retime, results, out_md, args.rows, args.smoke)
    commit = head_commit()
    started = time.perf_counter()
    results, out_md, home = results.resolve(), out_md.resolve(), os.getcwd()
    with tempfile.TemporaryDirectory(prefix="quantship-real-") as tmp:
        workdir = Path(tmp)
        os.chdir(workdir)  # ORT's quantizer leaves <uuid>.data files in the working directory
        for name in chosen:
            wanted = [w for w in (args.rows or "").split(",") if w]
            keys = [k for k in row_keys(name) if not wanted or any(w in f"{name}|{k[0]}|{k[1]}" for w in wanted)]
            if args.smoke:
                keys = [k for k in keys if k in {("onnx", "fp32"), ("onnx", "ort-defaults"),
                                                 ("onnx", "quantship:onnxruntime-cpu"), ("pt2e", "fp32")}]
            if not keys:
                continue
            print(f"== {name}: {len(keys)} row(s)", flush=True)
            try:
                task = make_task(name, args.smoke, workdir)
            except Exception as exc:  # a missing package or data: every row of the model says why
                traceback.print_exc()
                rows = [Row(name, p, t, status=f"model not loaded: {first_line(exc)}") for p, t in keys]
                out_md.write_text(render(*save_records(rows, results), smoke=args.smoke))
                continue
            meta = {name: {"title": task.title, "data": task.data, "metrics": list(task.metrics),
                           "subset": task.subset}}
            runner, torch_cache = Runner(task, workdir), {}
            for path_kind, tool in keys:
                t0 = time.perf_counter()
                row = measure(task, runner, path_kind, tool, workdir, torch_cache)
                row.commit, row.load_avg = commit, round(os.getloadavg()[0], 1)
                row.measured_utc = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                print(f"   {row.key}: {row.status} {row.scores.get('ort') or row.scores.get('torch') or ''} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                out_md.write_text(render(*save_records([row], results, meta), smoke=args.smoke))
                made = int8_path(task, path_kind, tool, workdir)
                if args.keep and row.status == "ok" and made.exists():
                    args.keep.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(made, args.keep / made.name)
            for f in workdir.glob(f"{name}_*"):
                f.unlink()
        os.chdir(home)
    if scratch is not None:
        shutil.rmtree(scratch / "cache", ignore_errors=True)  # the smoke run's generated data
    print(f"wrote {out_md} and {results} in {time.perf_counter() - started:.0f} s")
    return 0


def retime(chosen: list[str], kept: Path, results: Path, out_md: Path, rows: str | None, smoke: bool = False) -> int:
    """Latency again, FP32 and INT8 interleaved as in a full run, from the files a ``--keep`` run left:
    what an idle machine measures, without quantizing anything again. Other figures stay as measured."""
    records, _ = load_records(results)
    wanted = [w for w in (rows or "").split(",") if w]
    done = []
    with tempfile.TemporaryDirectory(prefix="quantship-real-") as tmp:
        for name in chosen:
            mine = [r for r in records.values() if r.model == name and r.status == "ok"
                    and (not wanted or any(w in r.key for w in wanted))]
            if not mine:
                continue
            task = make_task(name, smoke, Path(tmp))
            for row in mine:
                path = task.float_path if (row.path, row.tool) == ("onnx", "fp32") else \
                    int8_path(task, row.path, row.tool, kept)
                if row.tool == "fp32" and row.path == "pt2e":
                    continue  # a PyTorch reading: no file, no latency
                if not path.exists():
                    print(f"   {row.key}: no kept file {path.name}; latency left as measured", flush=True)
                    continue
                row.latency_ms = latency(task.float_path, path, task.eval_x, task.reps)
                row.retimed_utc = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                row.retimed_load = round(os.getloadavg()[0], 1)
                print(f"   {row.key}: {row.latency_ms} (load {row.retimed_load})", flush=True)
                out_md.write_text(render(*save_records([row], results), smoke=smoke))
                done.append(row)
    print(f"re-timed {len(done)} row(s); wrote {out_md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
