"""torchvision detectors end to end through the ONNX path: float export, ``quantize_onnx_file``, boxes matched.

For ``ssdlite320_mobilenet_v3_large``, ``fasterrcnn_mobilenet_v3_large_320_fpn``, ``retinanet_resnet50_fpn_v2``
and ``fcos_resnet50_fpn`` (``weights=None, weights_backbone=None``, seed 0; score thresholds 0 and DETECTIONS
detections per image, so an untrained model still returns boxes), at SIZE x SIZE, batch 1:

1. the model is prepared as bench/zoo.py prepares an untrained one (``prepare_untrained``, its rule read on
   the detection scores), then exported with the TorchScript exporter (``dynamo=False``, opset 17: the
   dynamo exporter cannot capture the data-dependent NMS / top-k, see ZOO-detection.md);
2. ``quantize_onnx_file(..., target='onnxruntime-cpu')`` on CALIB random images (timed);
3. read off the result and the file: Conv/Gemm/MatMul left float and the rule that names each, the
   post-processing tensors the ``detection_postprocess`` island keeps float, ORT's integer-kernel census;
4. detections of the float file vs the INT8 file on IMAGES seeded inputs (the three photos that ship
   with matplotlib / scikit-learn, resized, then random images), ORT literal and ORT default
   optimizations: reference boxes found again (same label, IoU >= 0.5) and the largest corner
   difference among them (``inspect.run.detections``);
5. latency FP32 / INT8 in ORT (default optimizations, batch 1, 2 threads), median of RUNS.

Records go to bench/detection_results.json (one per model, merged across runs), the table to ZOO-detection.md.
Random weights: these figures prove graph coverage (every compute op INT8, the post-processing float, the
file running end to end with the float file's boxes), not accuracy.

    python bench/detection.py                              # the four models
    python bench/detection.py --models ssdlite320_mobilenet_v3_large
    python bench/detection.py --render                     # the table from the records only
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
RESULTS = ROOT / "bench" / "detection_results.json"
TABLE = ROOT / "ZOO-detection.md"
MODELS = ("ssdlite320_mobilenet_v3_large", "fasterrcnn_mobilenet_v3_large_320_fpn", "retinanet_resnet50_fpn_v2",
          "fcos_resnet50_fpn")
SMOKE_MODEL = "tiny_ssd"  # quantship.examples.detection.tiny_ssd: the smoke run's model
SIZE = 320
CALIB = 4
IMAGES = 6
RUNS = 20


def images(size: int, n: int, seed: int = 0) -> list[np.ndarray]:
    """The shipped photos (resized, [0, 1]) first, then seeded random images, each [1, 3, size, size]."""
    from PIL import Image

    from quantship.examples.real.photos import photo, photo_paths

    out = []
    for name in list(photo_paths())[:n]:
        resized = Image.fromarray(photo(name)).resize((size, size), Image.BILINEAR)
        out.append(np.asarray(resized, np.float32).transpose(2, 0, 1)[None] / 255.0)
    rng = np.random.default_rng(seed)
    out += [rng.random((1, 3, size, size), dtype=np.float32) for _ in range(n - len(out))]
    return out


def latency_ms(path: Path, x: np.ndarray, runs: int) -> float:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for _ in range(3):
        session.run(None, {name: x})
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, {name: x})
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def float_rule_of(why: str) -> str:
    from quantship import targets

    FLOAT_RULES = {r.id: (r.why, r.applies) for r in targets.get("onnxruntime-cpu").float_rules}

    return next((rule for rule, (text, _) in FLOAT_RULES.items() if text == why), "?")


def run_model(name: str, workdir: Path, size: int, n_images: int, runs: int) -> dict:
    from zoo import float_compute_ops, prepare_untrained

    from quantship.examples.detection import Scores, build, detections, export_float, tiny_ssd
    from quantship.inspect import match_detections, ort_session
    from quantship.quantize_onnx import quantize_onnx_file

    model = tiny_ssd(size) if name == SMOKE_MODEL else build(name, size)
    gen = torch.Generator().manual_seed(1)
    calib_t = [torch.rand(1, 3, size, size, generator=gen) for _ in range(2)]
    bn, reinit = prepare_untrained(Scores(model), size, calib_t)
    row: dict = {"model": name, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                 "size": size, "prep": f"BN {bn} re-estimated" if bn else "as initialised", "zero_reinit": reinit}
    start = time.perf_counter()
    fp32 = export_float(model, size, workdir / f"{name}.onnx")
    row["export_s"] = round(time.perf_counter() - start, 1)
    rng = np.random.default_rng(1)
    calib = [rng.random((1, 3, size, size), dtype=np.float32) for _ in range(CALIB)]
    int8 = workdir / f"{name}_int8.onnx"
    start = time.perf_counter()
    result = quantize_onnx_file(fp32, int8, calib, target="onnxruntime-cpu")
    row["quantize_s"] = round(time.perf_counter() - start, 1)
    row["n_compute"], row["n_float_compute"] = float_compute_ops(int8)
    kept: dict[str, int] = {}
    for why in result.plan["kept_float"].values():
        rule = float_rule_of(why)
        kept[rule] = kept.get(rule, 0) + 1
    row["float_compute_rules"] = kept
    islands = result.plan["float_islands"]
    row["postprocess_tensors"] = len(islands.get("detection_postprocess", {}).get("tensors", []))
    row["other_islands"] = {k: len(v["tensors"]) for k, v in islands.items() if k != "detection_postprocess"}
    row["census"] = result.census
    row["verdict"] = result.verdict.verdict
    feeds = images(size, n_images)
    reference = detections(ort_session(fp32, optimized=True), feeds)
    # the floor a random detector sets: the float file against itself on the image moved by +-1/255 (one step
    # of an 8-bit image), near-equal scores swap places in the top-k as they do under INT8 rounding
    nudged = [np.clip(x + np.random.default_rng(k).choice([-1, 1], x.shape).astype(np.float32) / 255, 0, 1)
              for k, x in enumerate(feeds)]
    row["matched_fp32_nudged"] = match_detections(reference, detections(ort_session(fp32, optimized=True),
                                                                        nudged)).as_dict()
    row["matched"] = {reading: match_detections(reference, detections(ort_session(int8, optimized=opt), feeds)).as_dict()
                      for reading, opt in (("literal", False), ("default", True))}
    row["n_images"] = len(feeds)
    row["runs"] = runs
    row["fp32_ms"] = round(latency_ms(fp32, feeds[0], runs), 1)
    row["int8_ms"] = round(latency_ms(int8, feeds[0], runs), 1)
    row["load_1min"] = round(os.getloadavg()[0], 1)
    row["measured_utc"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return row


def render(records: dict[str, dict], banner: list[str] | None = None) -> str:
    from quantship import targets
    from quantship.examples.detection import DETECTIONS
    from quantship.inspect import MATCH_IOU
    from quantship.quantize_onnx import ISLAND_RULES

    FLOAT_RULES = {r.id: (r.why, r.applies) for r in targets.get("onnxruntime-cpu").float_rules}

    sizes = sorted({r["size"] for r in records.values()}) or [SIZE]
    n_images = sorted({r["n_images"] for r in records.values()}) or [IMAGES]
    runs = sorted({r.get("runs", RUNS) for r in records.values()}) or [RUNS]
    lines = [
        *(banner or []),
        "# torchvision detectors through the ONNX path (quantize-onnx, onnxruntime-cpu)",
        "",
        "Generated by `python bench/detection.py` from `bench/detection_results.json`; do not edit by hand.",
        "",
        f"Untrained detectors (`weights=None, weights_backbone=None`, seed 0; score thresholds 0, {DETECTIONS} "
        f"detections per image), batch 1, {' / '.join(f'{n} x {n}' for n in sizes)} input, prepared as ZOO.md says "
        "(`prep`: BatchNorm re-estimated on random images where the scores had vanished), exported with the "
        "TorchScript exporter (opset 17: post-processing as `TopK` / `NonMaxSuppression` operators), then "
        f"`quantize_onnx_file(..., target='onnxruntime-cpu')` on {CALIB} random images. `float compute / all`: "
        "Conv/Gemm/MatMul of the INT8 file reading anything other than DequantizeLinear on their first two inputs, "
        "with the rule that keeps each (`Target.float_rules`). `post-processing float`: tensors the "
        "`detection_postprocess` island keeps float. Census: kernels in ONNX Runtime's optimized graph. "
        f"`matched`: detections of the FP32 file found again in the INT8 file (same label, IoU >= {MATCH_IOU}) over "
        f"{' / '.join(map(str, n_images))} images (the three photos shipped with matplotlib / scikit-learn, then "
        "seeded random images), ORT literal (optimizations off) / ORT default; `corner diff`: the largest "
        "coordinate difference of each matched box, pixels, ORT default: median and max over matched boxes (IoU 0.5 "
        "lets a 300-px box move tens of pixels). `FP32 vs FP32 nudged`: the same match "
        "between the FP32 file on the image and on the image moved by +-1/255 per pixel (one 8-bit step): the floor "
        "an untrained detector sets, whose near-equal scores swap places in the top-k under any perturbation. "
        "Candidates reaching NMS are capped (`examples.detection.CANDIDATES`) so that NMS does not dominate the "
        "latency. Latency: ORT default optimizations, 2 "
        f"threads, batch 1, median of {' / '.join(map(str, runs))} runs, under the load given.",
        "",
        "| model | params M | prep | float compute / all (rule) | post-processing float | QLinearConv | float Conv "
        "in ORT | matched literal | matched default | corner diff px median / max | FP32 vs FP32 nudged | FP32 ms | INT8 ms | INT8 speed | "
        "quantize s | load | commit, UTC |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def matched(m: dict) -> str:
        return f"{m['n_matched']}/{m['n_reference']} ({100 * m['share']:.0f}%)" if m["n_reference"] else "n/a"

    names = [n for n in (*MODELS, SMOKE_MODEL) if n in records] or list(MODELS)
    for name in names:
        r = records.get(name)
        if r is None:
            lines.append(f"| {name} | not run yet |" + " |" * 15)
            continue
        rules = ", ".join(f"{n} {rule}" for rule, n in r["float_compute_rules"].items())
        census = r["census"]
        diff = r["matched"]["default"]["max_coordinate_diff"]
        median = r["matched"]["default"].get("median_coordinate_diff")
        lines.append(
            f"| {name} | {r['params_m']} | {r['prep']} | {r['n_float_compute']} / {r['n_compute']}"
            f"{f' ({rules})' if rules else ''} | {r['postprocess_tensors']} | {census['integer'].get('QLinearConv', 0)} | "
            f"{census['n_float']} | {matched(r['matched']['literal'])} | {matched(r['matched']['default'])} | "
            f"{'n/a' if median is None else f'{median:.2f}'} / {'n/a' if diff is None else f'{diff:.2f}'} | {matched(r['matched_fp32_nudged'])} | {r['fp32_ms']} | {r['int8_ms']} | "
            f"{r['fp32_ms'] / r['int8_ms']:.2f}x | {r['quantize_s']} | {r['load_1min']} | {r['commit']}, "
            f"{r['measured_utc']} |")
    used = sorted({rule for r in records.values() for rule in r["float_compute_rules"]})
    lines += ["", "Rules named above:", "",
              f"- `detection_postprocess` (float island): {ISLAND_RULES['detection_postprocess']}."]
    lines += [f"- `{rule}` (float compute): {FLOAT_RULES[rule][0]}." for rule in used if rule in FLOAT_RULES]
    lines += ["", "Random weights: these rows prove graph coverage (the backbone, neck and heads run as integer "
              "kernels but for the convs a float rule names, the post-processing stays float by the rule above, the "
              "INT8 file runs end to end in ONNX Runtime and returns as many boxes as the float file), not accuracy. "
              "How many of the float file's boxes it finds again (`matched`) is to be read against `FP32 vs FP32 "
              "nudged`: an untrained network amplifies a rounding difference layer after layer and its near-equal "
              "scores reorder, so a share below that floor says nothing about a trained detector's boxes.", ""]
    cpus = sorted({r.get("cpu", "?") for r in records.values()})
    lines += [f"CPU: {'; '.join(cpus) or '?'}; 2 cores shared with other developers' runs (hence the load "
              f"column). Python {platform.python_version()}, torch {torch.__version__}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import _smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=[*MODELS, SMOKE_MODEL])
    parser.add_argument("--size", type=int, default=SIZE, help=f"square input side (default {SIZE})")
    parser.add_argument("--images", type=int, default=IMAGES, help=f"images matched (default {IMAGES})")
    parser.add_argument("--runs", type=int, default=RUNS, help=f"timed runs per file (default {RUNS})")
    parser.add_argument("--out", type=Path, default=None, help=f"default: {TABLE.name}")
    parser.add_argument("--results", type=Path, default=None, help=f"the records (default: bench/{RESULTS.name})")
    parser.add_argument("--render", action="store_true", help="only render the table from the records")
    args = _smoke.parse_args(parser, argv, models=[SMOKE_MODEL], size=64, images=2, runs=1)
    _smoke.record_models(args, "bench/detection.py", TABLE, RESULTS, lambda model, tmp: run_model(model, tmp, args.size, args.images, args.runs), render)


if __name__ == "__main__":
    main()
