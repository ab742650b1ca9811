"""Real pretrained models and their tasks: FP32, ORT's quantizer, NNCF and quantship side by side.

Every model of ``quantship.examples.real`` (weights inside installed packages, data generated here,
ground truth) is scored as FP32, then as INT8 made by each tool: ONNX Runtime's ``quantize_static``
(QDQ, defaults and per-channel), NNCF's ``nncf.quantize`` (ONNX backend, defaults and
``model_type=TRANSFORMER`` where it applies), ``quantship quantize-onnx --target T`` run as a user
runs it (a subprocess, one per preset), and quantship's PyTorch path as ``quantship quantize`` runs it by
default (``quantize_export_judged``: ``Quantizer.for_target(T)``, ``export_qdq``, the fidelity budget, placement
by profile) where a PyTorch model exists. Each INT8 file is scored in ONNX Runtime at its
default optimizations (what users run) and read literally (optimizations off; on a subset where
that is slow), in torch for the PyTorch path, and in OpenVINO / TiGrIS's host runtime for the
openvino / tigris presets' files. Latency: FP32 and INT8 files in ONNX Runtime at batch 1 and 8,
one thread each, timed by the thread's CPU time, interleaved in the same run, median (bench/_real_timing.py:
steady on a shared machine). A row that cannot be produced keeps its reason.

Rows are cached in bench/real_results.json keyed by (model, path, tool) (bench/_real_records.py); REAL.md
is rendered from every record (bench/_real_render.py).

    python bench/real.py                          # every model, every row (27 min on 2 idle cores, older timing)
    python bench/real.py --models ocr_cls,magika  # only these models' rows are re-measured
    python bench/real.py --rows quantship         # only rows whose key contains this substring
    python bench/real.py --smoke                  # tiny sizes, one repetition, into a temp dir
    python bench/real.py --render                 # REAL.md from the records only
    python bench/real.py --keep DIR               # ... and keep every INT8 file in DIR
    python bench/real.py --retime DIR             # latency only, again, from those files
    python bench/real.py --wall-threads ...       # latency at default threads by wall time (the older method)
    python bench/real.py --models mtcnn_pnet --results /tmp/r.json --out /tmp/REAL.md   # a scratch copy
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _real_records import MODELS, ROOT, SPEED_TOOL, Row, head_commit, load_records, row_keys, save_records
from _real_render import _pct, render  # noqa: F401  (_pct: bench/algorithms.py and int16.py read real._pct)
from _real_timing import DEFAULT_ROUNDS, SMOKE_ROUNDS, STEADY, WALL, Rounds, latency, wall_ms

from quantship.inspect import cpu_line

warnings.filterwarnings("ignore")
RESULTS = ROOT / "bench" / "real_results.json"
REAL_MD = ROOT / "REAL.md"
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
    reps: tuple[int, int] = (20, 10)  # latency repetitions at batch 1 and 8 by the older method (--wall-threads)
    torch_model: Callable[[], object] | None = None
    transformer: bool = False  # NNCF's model_type=TRANSFORMER applies
    notes: str = ""
    data: str = ""


def _example(x: np.ndarray):
    """One input of a model (what onnx2torch's shape folding runs once)."""
    import torch

    return torch.from_numpy(x[:1])


def _converted(path: Path, x: np.ndarray) -> Callable[[], object]:
    """The PyTorch model onnx2torch makes of ``path`` (``convert.to_torch``), built when a row asks for it."""
    def build():
        from quantship.examples.real.convert import to_torch

        return to_torch(path, _example(x))

    return build


def _answers(metric: str, accuracy: Callable, agreement: Callable, truth) -> Callable:
    """A task's score: ``metric`` against ``truth``, and agreement with FP32's outputs when they are given."""
    def score(out, ref):
        result = {metric: accuracy(out, truth[:len(out)])}
        if ref is not None:
            result["agrees with FP32"] = agreement(out, ref)
        return result

    return score


def _ocr_cls(smoke: bool) -> Task:
    from quantship.examples.real import ocr_cls

    n = 48 if smoke else 600
    lines, calib = ocr_cls.make_lines(n, seed=0), ocr_cls.make_lines(16 if smoke else 64, seed=1)
    score = _answers("accuracy", ocr_cls.accuracy, ocr_cls.agreement, lines.y)

    return Task("ocr_cls", "PP-OCR text-orientation classifier (rapidocr-onnxruntime 1.4.4, "
                "`ch_ppocr_mobile_v2.0_cls_infer.onnx`, 0.6 MB)", ocr_cls.model_path(), calib.x, lines.x, score,
                ("accuracy", "agrees with FP32"), subset=None if smoke else 200, reps=(1, 1) if smoke else (20, 10),
                torch_model=_converted(ocr_cls.model_path(), calib.x),
                data=f"{n} rendered lines (seed 0), half rotated 180 degrees; calibration: {len(calib.y)} other "
                     "lines (seed 1); rapidocr's resize/normalise to 3 x 48 x 192")


def _magika(smoke: bool) -> Task:
    from quantship.examples.real import magika_files

    n_cal = 16 if smoke else 300
    n = 48 if smoke else 2000
    files = magika_files.make_files(n, seed=0, skip=n_cal)
    calib = magika_files.make_files(n_cal, seed=0, skip=0)
    labels = sorted({magika_files.labels_space()[i] for i in files.y})

    score = _answers("accuracy", magika_files.accuracy, magika_files.agreement, files.y)

    return Task("magika", "magika 1.0.3 file-type model (`standard_v3_3/model.onnx`, 3.2 MB, int32 input "
                "`bytes` [N, 2048], 214 labels)", magika_files.model_path(), calib.x, files.x, score,
                ("accuracy", "agrees with FP32"), eval_batch=250, calib_batch=10, subset=None if smoke else 500,
                reps=(1, 1) if smoke else (20, 10), torch_model=_converted(magika_files.model_path(), calib.x),
                transformer=True,
                data=f"{n} files of this machine ({len(labels)} labels from unambiguous extensions, drawn round-robin "
                     f"over labels, seed 0) after {n_cal} calibration files of the same draw (disjoint); "
                     "magika's own feature extraction; top-1 label before magika's thresholds")


def _ocr_det(smoke: bool) -> Task:
    from quantship.examples.real import ocr_det

    n = 2 if smoke else 40
    pages, calib = ocr_det.make_pages(n, seed=0), ocr_det.make_pages(1 if smoke else 8, seed=1)

    def score(out, ref):
        found = [ocr_det.detect(out[i:i + 1]) for i in range(len(out))]
        recall, precision = ocr_det.recall_precision(found, pages.boxes[:len(out)])
        return {"line recall": recall, "precision": precision}

    return Task("ocr_det", "PP-OCRv4 text detector (rapidocr-onnxruntime 1.4.4, `ch_PP-OCRv4_det_infer.onnx`, "
                "4.7 MB)", ocr_det.model_path(), calib.x, pages.x, score, ("line recall", "precision"),
                eval_batch=1, calib_batch=1, subset=None if smoke else 10, reps=(1, 1) if smoke else (5, 2),
                torch_model=_converted(ocr_det.model_path(), calib.x),
                data=f"{n} rendered pages of 736 x 992 (seed 0), {sum(len(b) for b in pages.boxes)} lines; "
                     f"calibration: {len(calib.x)} other pages (seed 1); rapidocr's DetPreProcess and DB "
                     "post-processing with its packaged config; IoU >= 0.5, one-to-one")


def _nudenet(smoke: bool) -> Task:
    from quantship.examples.real import nudenet_yolo

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
                torch_model=_converted(nudenet_yolo.model_path(), calib.x),
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


def _ocr_rec(smoke: bool) -> Task:
    from quantship.examples.real import ocr_rec

    n = 48 if smoke else 600
    lines, calib = ocr_rec.make_lines(n, seed=0), ocr_rec.make_lines(16 if smoke else 64, seed=1)

    score = _answers("lines read", ocr_rec.accuracy, ocr_rec.agreement, lines.text)

    return Task("ocr_rec", "PP-OCRv4 text recognizer (rapidocr-onnxruntime 1.4.4, `ch_PP-OCRv4_rec_infer.onnx`, "
                "10.9 MB, SVTR-style: convolutions then attention, CTC over 6,625 characters)", ocr_rec.model_path(),
                calib.x, lines.x, score, ("lines read", "agrees with FP32"), eval_batch=50, calib_batch=8,
                subset=None if smoke else 200, reps=(1, 1) if smoke else (10, 5),
                torch_model=_converted(ocr_rec.model_path(), calib.x),
                transformer=True,
                data=f"{n} rendered lines of 1-4 words (seed 0); calibration: {len(calib.x)} other lines (seed 1); "
                     "rapidocr's resize/normalise to 3 x 48 x 320; greedy CTC reading over the file's own character "
                     "list; a line is read when it equals the rendered string, spaces ignored")


def make_task(name: str, smoke: bool, workdir: Path) -> Task:
    if name.startswith("mtcnn_"):
        return _mtcnn(name.removeprefix("mtcnn_"), smoke, workdir)
    return {"ocr_cls": _ocr_cls, "magika": _magika, "ocr_det": _ocr_det, "nudenet": _nudenet,
            "ocr_rec": _ocr_rec}[name](smoke)


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
    from quantship.inspect import ort_session

    return ort_session(path).get_inputs()[0].name


def batched(x: np.ndarray, size: int) -> list[np.ndarray]:
    return [x[i:i + size] for i in range(0, len(x), size)]


def run_ort(path: Path, x: np.ndarray, batch: int, optimized: bool = True) -> np.ndarray:
    from quantship.inspect import ort_session

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

    from quantship.inspect import run_openvino, run_tigris

    name = input_name(path)
    if consumer == "tigris":
        batch = 1  # a TiGrIS plan is compiled for batch 1 whatever the file declares
    feeds = [{name: b} for b in batched(x, batch)]
    if consumer == "openvino":
        outs = run_openvino(path, feeds)
    else:
        outs = run_tigris(path, feeds, onnx.load(str(path), load_external_data=False))
    return np.concatenate([np.asarray(o[0]) for o in outs])


def counts(scores: dict) -> dict:
    return {name: [c.k, c.n] for name, c in scores.items()}


def interleaved_ms(sessions: list, feed: np.ndarray, n: int) -> list[float]:
    """Median ms of each session on ``feed``, ``n`` interleaved rounds by wall time (the older reading), as
    bench/yolo_head.py times its files."""
    return wall_ms(sessions, feed, n).median_ms


def time_row(row: Row, task: Task, path: Path, method: str = STEADY, rounds: Rounds = DEFAULT_ROUNDS) -> None:
    """The row's latency: the task's FP32 file and ``path`` interleaved at batch 1 and 8, by ``method``."""
    row.latency_ms, row.latency_rounds = latency(task.float_path, path, task.eval_x, fixed_batch=static_batch(path),
                                                 method=method, rounds=rounds, wall_reps=task.reps)
    row.latency_method = method


class Runner:
    """Scores files and models of one task; FP32 outputs are computed once; latency by ``method``."""

    def __init__(self, task: Task, workdir: Path, method: str = STEADY, rounds: Rounds = DEFAULT_ROUNDS):
        self.task, self.workdir, self.method, self.rounds = task, workdir, method, rounds

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
        time_row(row, t, path, self.method, self.rounds)


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


def quantship_cli(task: Task, out: Path, preset: str, extra: tuple[str, ...] = ()) -> str:
    """``quantship quantize-onnx FLOAT --calib CAL.npy --out OUT --target T [extra]``, as a user runs it.

    Raises ``Refused`` with the command's one-line message when it writes nothing."""
    calib = out.with_name(f"{task.model}_calib.npy")
    np.save(calib, task.calib)  # the dtype the input declares (int32 for magika, float32 otherwise)
    exe = Path(sys.executable).parent / "quantship"
    command = [str(exe) if exe.exists() else (shutil.which("quantship") or "quantship"), "quantize-onnx",
               str(task.float_path), "--calib", str(calib), "--out", str(out), "--target", preset, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode == 1 and out.exists():  # written; its own check did not accept it (exit 1): scored, said
        verdicts = [ln.strip(" │|") for ln in done.stdout.splitlines() if re.search(r"check \S+ --run", ln)]
        return f"written; quantize-onnx exit 1, its check: {' '.join(verdicts[-1].split()) if verdicts else '?'}"[:300]
    if done.returncode != 0 or not out.exists():
        lines = [ln.strip() for ln in (done.stderr + "\n" + done.stdout).splitlines() if ln.strip()]
        # the CLI's own one-line refusal first (a report's table rows may also start with "quantship")
        errors = [ln for ln in lines if re.match(r"^quantship \S+: (?!warning)", ln)] or [
            ln for ln in lines if re.match(r"^(error|quantship|refused)", ln, re.I)]
        message = (errors or lines or ["no message"])[-1].replace(str(task.float_path), task.float_path.name)
        message = re.sub(r"^quantship quantize-onnx: (error: )?", "", message)
        closest = re.search(r"The closest: .*?(would keep it)?\.(?= |$)", message)  # the repair's nearest file
        tail = f" ... {closest.group(0)}" if closest and closest.start() >= 400 else ""
        raise Refused(f"`quantize-onnx` refused (exit {done.returncode}): {message[:400]}{tail}")
    return ""


# the speed search's steps after the first, bounded on the two large models for the bench's time (there each
# step quantizes the file again and times it at batch 1 and 8: about a minute on the detector)
SPEED_MAX_STEPS = {"ocr_det": 6, "nudenet": 12}


def speed_note(path: Path, steps: int | None) -> str:
    """What the speed search kept float, as the written file records it."""
    import onnx

    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    said = props.get("quantship.speed_search", "no speed-search record in the file")
    bound = f"--max-steps {steps} (the bench's time on this model); " if steps else ""
    return f"{bound}{said.split('; measured on')[0]}"


CLI_MAX_SAMPLES = 100  # the commands' --max-samples default (cli/common.py)


def pt2e_quantize(task: Task, model, out: Path, preset: str):
    """The PyTorch path as ``quantship quantize`` runs it by default (``quantize_export_judged``: quantize, export,
    the fidelity budget judged and repaired, placement by profile on ONNX Runtime targets), on the task's
    calibration data split as the command splits ``--calib`` (``split_held_out``: the last fifth held out to
    judge fidelity on, the same samples the ONNX path's rows hold out)."""
    import torch

    from quantship import Budget, Quantizer
    from quantship.export import quantize_export_judged, split_held_out
    from quantship.targets import get

    calib, held, label = split_held_out({"x": task.calib}, CLI_MAX_SAMPLES)
    batches = [torch.from_numpy(b) for b in batched(calib["x"], task.calib_batch)]
    held_batches = [torch.from_numpy(b) for b in batched(held["x"], task.calib_batch)] if held else None
    judged = quantize_export_judged(
        model, batches, torch.from_numpy(task.eval_x[:1]), out, target=get(preset), overrides={}, held=held_batches,
        held_label=f"sample(s): {label}", budget=Budget(), make_quantizer=Quantizer.for_target,
        quantize_kwargs={"max_calibration_samples": len(calib["x"])})
    note = ""
    report = getattr(judged.quantizer, "report", None)
    if report is not None and getattr(report, "float_ops", None):
        from quantship.quantize import describe_float_ops

        note = f"kept in float (no role): {describe_float_ops(report)}"
    if judged.profile is not None and judged.profile.kept_float:
        note = "; ".join(n for n in (note, f"placement by profile: {judged.profile.describe()}") if n)
    return judged.qmodel, note


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
            time_row(row, t, t.float_path, runner.method, runner.rounds)
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
        elif tool == SPEED_TOOL:
            preset = "onnxruntime-cpu"
            steps = SPEED_MAX_STEPS.get(t.model)
            row.notes = quantship_cli(t, out, preset, ("--speed-search",) + (("--max-steps", str(steps)) if steps else ()))
            row.notes = "; ".join(n for n in (row.notes, speed_note(out, steps)) if n)
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
    parser.add_argument("--wall-threads", action="store_true",
                        help="latency by the older method: ONNX Runtime's default threads, wall time, a fixed "
                             "count (spreads 2-10x with a shared machine's load; default: 1 thread, CPU time)")
    args = parser.parse_args(argv)
    method = WALL if args.wall_threads else STEADY
    rounds = SMOKE_ROUNDS if args.smoke else DEFAULT_ROUNDS
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
        return retime(chosen, args.retime, results, out_md, args.rows, args.smoke, method)
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
            runner, torch_cache = Runner(task, workdir, method, rounds), {}
            for path_kind, tool in keys:
                t0 = time.perf_counter()
                row = measure(task, runner, path_kind, tool, workdir, torch_cache)
                row.commit, row.load_avg = commit, round(os.getloadavg()[0], 1)
                row.cpu = cpu_line()
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


def retime(chosen: list[str], kept: Path, results: Path, out_md: Path, rows: str | None, smoke: bool = False,
           method: str = STEADY) -> int:
    """Latency again, by ``method``, FP32 and INT8 interleaved as in a full run, from the files a ``--keep`` run
    left, without quantizing anything again. Other figures stay as measured."""
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
                time_row(row, task, path, method, SMOKE_ROUNDS if smoke else DEFAULT_ROUNDS)
                row.retimed_utc = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                row.retimed_load = round(os.getloadavg()[0], 1)
                row.cpu = cpu_line()
                print(f"   {row.key}: {row.latency_ms} ({row.latency_method}, rounds {row.latency_rounds}, "
                      f"load {row.retimed_load})", flush=True)
                out_md.write_text(render(*save_records([row], results), smoke=smoke))
                done.append(row)
    print(f"re-timed {len(done)} row(s); wrote {out_md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
