"""Post-training algorithms of the ONNX quantizer, side by side with plain quantization, on real models.

For each model (``bench/real.py``'s tasks: same data, calibration and metrics), ``quantize_onnx_file`` runs
once per algorithm setting (plain, ``equalize``, ``bias_correction``, both, ``smooth_quant`` with alpha 0.5,
``seq_mse``, ``adaround``, the last two together; the adaround ones, minutes per model, only when
``--settings`` names them; so are ``bias_correction+int16_worstK``: bias correction plus 16-bit activations for
the K worst nodes of the per-node SQNR report of the bias-corrected file, measured on the calibration data,
their quantize time end to end: that file, the report, the new file) for one preset; each INT8 file is scored in ONNX Runtime at its default
optimizations (what users run) with a Wilson 95% interval, next
to FP32. Quantize time is wall time of the call; peak memory is the process's resident set sampled every
10 ms during the call, above its value when the call started (what the call added; the first setting's
figure also holds the one-time imports and caches of the first call).

    python bench/algorithms.py                                   # ocr_cls, nudenet, magika, mtcnn_onet
    python bench/algorithms.py --models ocr_cls --target tigris
    python bench/algorithms.py --models nudenet --settings plain,bias_correction
    python bench/algorithms.py --models ocr_cls --settings plain,seq_mse,adaround
    python bench/algorithms.py --models nudenet --settings bias_correction,bias_correction+int16_worst1
    python bench/algorithms.py --smoke                           # the classifier at smoke size
    python bench/algorithms.py --path pt2e --models ocr_cls,mtcnn_rnet,mtcnn_onet   # the PyTorch path

``--path pt2e``: the same settings through ``Quantizer.for_target(T, **options)`` + ``export_qdq`` on the
task's PyTorch model (onnx2torch's conversion, or facenet-pytorch's MTCNN nets), as ``bench/real.py``'s
PyTorch rows are made; quantize time is the ``quantize`` call (the export is not counted; the peak memory
figure covers both).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import _smoke
import real

MODELS = ("ocr_cls", "nudenet", "magika", "mtcnn_onet")
SETTINGS = {  # name -> quantize_onnx_file options
    "plain": {},
    "equalize": {"equalize": True},
    "bias_correction": {"bias_correction": True},
    "equalize + bias_correction": {"equalize": True, "bias_correction": True},
    "smooth_quant": {"smooth_quant": 0.5},
    "seq_mse": {"seq_mse": True},
    "adaround": {"adaround": True},
    "seq_mse + adaround": {"seq_mse": True, "adaround": True},
}
# name -> (base setting, k): the base setting plus 16-bit activations (``int16=``) for the k worst nodes of the
# per-node SQNR report (``sensitivity.node_sqnr``, lowest SQNR first) of the base setting's own file, measured on
# the calibration data (never the evaluation data); nothing kept in float
WORST_INT16 = {f"bias_correction+int16_worst{k}": ("bias_correction", k) for k in (1, 2, 4, 8)}
SETTINGS.update({name: SETTINGS[base] for name, (base, _) in WORST_INT16.items()})
PT2E_SETTINGS = ("plain", "equalize", "bias_correction", "equalize + bias_correction", "seq_mse", "adaround",
                 "seq_mse + adaround")  # what Quantizer has
SLOW = ("adaround", "seq_mse + adaround")  # minutes per model on 2 cores: run only when --settings names them
ON_REQUEST = (*SLOW, *WORST_INT16)  # int16: an SQNR report and a second file per setting; run when named


class PeakRSS:
    """The resident set's peak above its starting value, sampled on a thread while the block runs."""

    def __init__(self, period: float = 0.01):
        self.period, self.peak, self._stop = period, 0, threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = self.rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def added_mb(self) -> float:
        return (self.peak - self.start) / 1e6


def changed(algorithms: dict) -> str:
    """What each algorithm changed, read from the result (the file's provenance says the same). "layer error
    xR": the rewritten layers' summed squared output error against the float layers' outputs, on the
    calibration samples, over nearest rounding's at the scale the algorithm started from."""
    parts = []
    if "equalize" in algorithms:
        parts.append(f"{algorithms['equalize']['pairs_changed']} conv pairs equalized")
    if "bias_correction" in algorithms:
        bc = algorithms["bias_correction"]
        parts.append(f"{bc['n_corrected']} biases corrected ({bc['n_added']} added, {len(bc['skipped'])} skipped) "
                     f"in {bc['n_passes']} passes on {bc['samples']} samples, {bc['seconds']:.1f} s")
    if "smooth_quant" in algorithms:
        sq = algorithms["smooth_quant"]
        parts.append(f"{sq['layers_smoothed']} layers smoothed (alpha {sq['alpha']:g}, {sq['layers_skipped']} skipped, "
                     f"largest s {sq['largest_scale']:.3g}, float proof max abs diff {sq['max_abs_diff'] or 0:.2g}) "
                     f"in {sq['seconds']:.1f} s")
    if "seq_mse" in algorithms:
        sm = algorithms["seq_mse"]
        parts.append(f"{sm['n_channels_changed']} of {sm['n_channels']} weight scales moved (down to "
                     f"{sm['smallest_fraction']:.2f}) in {sm['n_layers']} layers ({len(sm['skipped'])} skipped), layer "
                     f"error x{sm['error_ratio']:.3f} on {sm['samples']} samples, {sm['seconds']:.1f} s")
    if "int16" in algorithms:
        w = algorithms["int16"]
        chosen = ", ".join(f"{n} ({db:.1f} dB)" for n, db in w["nodes"].items())
        parts.append(f"16-bit activations for the {len(w['nodes'])} worst-SQNR node(s) of the {w['base']} file's "
                     f"report on {w['samples']} calibration samples ({w['report_seconds']:.1f} s; output "
                     f"{w['output_sqnr_db']:.1f} dB): {chosen}; {w['n_tensors']} tensors 16-bit, "
                     f"{w['float_weights']} weights left float")
    if "adaround" in algorithms:
        ar = algorithms["adaround"]
        parts.append(f"{ar['n_flipped']} of {ar['n_weights']} weights rounded the other way in {ar['n_layers']} layers "
                     f"({ar['n_kept_nearest']} kept nearest, {len(ar['skipped'])} skipped; {ar['iterations']} steps "
                     f"each), layer error x{ar['error_ratio']:.3f} on {ar['samples']} samples, {ar['seconds']:.1f} s")
    return "; ".join(parts) or "-"


def pt2e_file(task, model, out: Path, target: str, options: dict) -> tuple[float, dict]:
    """``Quantizer.for_target(target, **options)`` on the PyTorch model, exported to ``out``: (seconds of the
    ``quantize`` call, the algorithms' records)."""
    import torch

    from quantship import Quantizer, export_qdq

    quantizer = Quantizer.for_target(target, **options)
    start = time.perf_counter()
    qmodel = quantizer.quantize(model, [torch.from_numpy(b) for b in real.batched(task.calib, task.calib_batch)],
                                max_calibration_samples=len(task.calib))
    seconds = time.perf_counter() - start
    export_qdq(qmodel, torch.from_numpy(task.eval_x[:1]), out, target=target)
    return seconds, quantizer.algorithms


def run_model(name: str, target: str, smoke: bool, workdir: Path, settings: list[str], path: str = "onnx") -> list[str]:
    from quantship.quantize_onnx import quantize_onnx_file, runs_int16

    task = real.make_task(name, smoke, workdir)
    model = task.torch_model() if path == "pt2e" else None
    reference = real.run_ort(task.float_path, task.eval_x, task.eval_batch)
    fp32 = task.score(reference, None)
    lines = [f"## {task.title}", "", f"Data: {task.data}. Preset `{target}`, {path} path; INT8 files in ONNX Runtime at default "
             f"optimizations; {len(task.calib)} calibration samples.", "",
             f"| algorithm | {' | '.join(task.metrics)} | quantize s | peak RSS added, MB | what it changed |",
             "|---|" + "---|" * len(task.metrics) + "---|---|---|",
             "| FP32 | " + " | ".join(real._pct(fp32[m].k, fp32[m].n) if m in fp32 else "-" for m in task.metrics)
             + " | - | - | - |"]
    calibration = real.batched(task.calib, task.calib_batch)
    bases = {WORST_INT16[s][0] for s in settings if s in WORST_INT16}
    kept: dict[str, tuple[Path, float]] = {}  # base setting -> (its file, its quantize seconds), for the reports
    for setting in settings:
        options = SETTINGS[setting]
        out = workdir / f"{name}_{setting.replace(' + ', '_')}.onnx"
        if setting in WORST_INT16 and not runs_int16(target):
            lines.append(f"| {setting} | not run: {target} has no 16-bit activations |"
                         + " - |" * (len(task.metrics) + 2))
            continue
        with PeakRSS() as memory:
            start = time.perf_counter()
            if path == "pt2e":
                seconds, algorithms = pt2e_file(task, model, out, target, options)
            elif setting in WORST_INT16:
                seconds, algorithms = worst_int16_file(task, out, calibration, target, setting, kept)
            else:
                result = quantize_onnx_file(task.float_path, out, calibration, target=target, run_check=False,
                                            **options)
                seconds, algorithms = time.perf_counter() - start, result.algorithms
        batch = real.static_batch(out) or task.eval_batch
        scores = task.score(real.run_ort(out, task.eval_x, batch), reference)
        cells = " | ".join(real._pct(scores[m].k, scores[m].n) for m in task.metrics)
        lines.append(f"| {setting} | {cells} | {seconds:.1f} | {memory.added_mb:.0f} | {changed(algorithms)} |")
        print(f"   {name} {setting}: {cells} ({seconds:.1f} s)", file=sys.stderr, flush=True)
        if setting in bases and path == "onnx":
            kept[setting] = (out, seconds)
        else:
            out.unlink()
    return lines + [""]


def worst_int16_file(task, out: Path, calibration: list, target: str, setting: str,
                     kept: dict[str, tuple[Path, float]]) -> tuple[float, dict]:
    """A ``WORST_INT16`` setting's file: the base setting's file (the one this run wrote, else a new one inside the
    report), its per-node SQNR report on the calibration data, then the base options plus ``int16=`` its ``k``
    worst nodes. Seconds: end to end (base file + report + this file), what a user running the three pays."""
    from quantship.quantize_onnx import node_sqnr, quantize_onnx_file

    base, k = WORST_INT16[setting]
    options = SETTINGS[base]
    base_file, base_seconds = kept.get(base, (None, 0.0))
    start = time.perf_counter()
    report = node_sqnr(task.float_path, calibration, target=target, quantized_path=base_file, **options)
    report_seconds = time.perf_counter() - start
    worst = report.worst(k)
    start = time.perf_counter()
    result = quantize_onnx_file(task.float_path, out, calibration, target=target, run_check=False,
                                int16=[r.node for r in worst], **options)
    seconds = time.perf_counter() - start
    record = {"base": base, "nodes": {r.node: r.sqnr_db for r in worst}, "samples": report.n_samples,
              "report_seconds": report_seconds, "output_sqnr_db": report.output_sqnr_db,
              "n_tensors": len(result.int16), "float_weights": result.counts.get("float_weights_of_int16_readers", 0)}
    return base_seconds + report_seconds + seconds, {**result.algorithms, "int16": record}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(real.MODELS)}")
    parser.add_argument("--target", default="onnxruntime-cpu", help="the preset every file is made for")
    parser.add_argument("--path", choices=("onnx", "pt2e"), default="onnx",
                        help="the ONNX quantizer (quantize_onnx_file) or the PyTorch path (Quantizer + export_qdq)")
    parser.add_argument("--settings", default=None,
                        help=f"comma-separated, of {','.join(SETTINGS)} (default: all but {', '.join(ON_REQUEST)}; "
                             f"--path pt2e: of {','.join(PT2E_SETTINGS)})")
    args = _smoke.parse_args(parser, argv, models="ocr_cls")
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in real.MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {list(real.MODELS)}")
    known = PT2E_SETTINGS if args.path == "pt2e" else tuple(SETTINGS)
    args.settings = args.settings or ",".join(s for s in known if s not in ON_REQUEST)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not settings or any(s not in known for s in settings):
        parser.error(f"--settings {args.settings!r}: choose among {list(known)} for the {args.path} path")
    if args.smoke:
        os.environ.setdefault("QUANTSHIP_CACHE", tempfile.mkdtemp(prefix="quantship-algorithms-smoke-"))
    lines = [*_smoke.banner(args), *_smoke.cpu_lines("Post-training algorithms of the "
                                                         + ("PyTorch path" if args.path == "pt2e" else "ONNX quantizer"))]
    with tempfile.TemporaryDirectory(prefix="quantship-algorithms-") as tmp:
        for name in chosen:
            lines += run_model(name, args.target, args.smoke, Path(tmp), settings, args.path)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
