"""MTCNN face detection end to end, FP32 against quantship's INT8 files, at the sizes it really runs.

REAL.md scores PNet on 12 x 12 crops, where it is 22 us of FP32 work and its INT8 file is slower
(0.71x). MTCNN runs PNet fully convolutionally on an image pyramid (every scale of the photo from
12 / min_face down to 12 px), then RNet on 24 x 24 and ONet on 48 x 48 crops of its candidates. This
bench exports the three facenet-pytorch 2.6.0 nets with their raw outputs (PNet with dynamic height
and width, RNet and ONet with a dynamic batch), quantizes each with ``quantize_onnx_file`` (the
``onnxruntime-cpu`` preset, calibration: 64 crops of REAL.md's calibration draw, seed 1, at each
net's size; PNet's at 48 x 48), and runs facenet-pytorch's own ``detect_face`` with the nets replaced
by ONNX Runtime sessions (default optimizations), FP32 and INT8 interleaved per image; the INT8
files three ways: as ``quantize-onnx`` writes them, with PNet's first two Convs kept float by hand
(``--exclude``), and as ``quantize-onnx --speed-search`` writes them (each net's search timed at its
calibration crops' size):

- faces: the FP32 pipeline's boxes (after all three stages and their NMS) reproduced by the INT8
  pipeline at IoU >= 0.5, and the INT8 pipeline's boxes FP32 does not have;
- time: each net's session time summed per image (PNet over the whole pyramid), the median over
  images of the median of ``--reps`` runs, FP32 / INT8; with one intra-op thread the CPU time of the
  thread that runs every kernel (steady on a shared machine), with more the wall time.

    python bench/mtcnn_pipeline.py                 # 40 images, 1 and 2 threads
    python bench/mtcnn_pipeline.py --smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _smoke
import numpy as np

MIN_FACE, THRESHOLDS, FACTOR = 20, (0.6, 0.7, 0.7), 0.709  # facenet-pytorch's MTCNN defaults
NETS = ("pnet", "rnet", "onet")


def export_nets(workdir: Path) -> dict[str, Path]:
    """The three nets with every output, as facenet-pytorch returns them; PNet with dynamic H and W."""
    import torch

    from quantship.examples.real import mtcnn

    paths = {}
    for net in NETS:
        path = workdir / f"{net}_fp32.onnx"
        model, size = mtcnn.load_net(net), mtcnn.NETS[net]
        sample = torch.zeros(2, 3, size if net != "pnet" else 48, size if net != "pnet" else 48)
        dims = {0: torch.export.Dim("N", min=1, max=4096)}
        if net == "pnet":
            dims = {0: torch.export.Dim("N", min=1, max=64), 2: torch.export.Dim("H", min=12, max=4096),
                    3: torch.export.Dim("W", min=12, max=4096)}
        names = {"pnet": ["reg", "prob"], "rnet": ["reg", "prob"], "onet": ["reg", "landmarks", "prob"]}[net]
        torch.onnx.export(model, (sample,), str(path), dynamo=True, dynamic_shapes={"x": dims},
                          input_names=["x"], output_names=names, verbose=False, external_data=False)
        paths[net] = path
    return paths


def first_convs(path: Path, n: int) -> list[str]:
    import onnx

    return [node.name for node in onnx.load(str(path)).graph.node if node.op_type == "Conv"][:n]


def quantize_nets(paths: dict[str, Path], calib: dict[str, np.ndarray], workdir: Path,
                  exclude: dict[str, list[str]] | None = None, tag: str = "int8", speed: bool = False
                  ) -> tuple[dict, dict, dict]:
    """Each net through ``quantize_onnx_file`` (``exclude``: node names per net kept float, as
    ``quantize-onnx --exclude`` would), or with ``speed`` through ``speed_search_onnx`` (as
    ``quantize-onnx --speed-search``: timed on the calibration crops' size, PNet's 48 x 48). Returns the
    files, the seconds each took and, with ``speed``, what each search kept float."""
    from quantship.quantize_onnx import quantize_onnx_file, speed_search_onnx

    out, seconds, kept = {}, {}, {}
    for net, path in paths.items():
        x = calib["onet" if net == "pnet" else net]
        start = time.perf_counter()
        out[net] = workdir / f"{net}_{tag}.onnx"
        batches = [x[i:i + 16] for i in range(0, len(x), 16)]
        if speed:
            _, search = speed_search_onnx(path, out[net], batches, target="onnxruntime-cpu", run_check=False)
            kept[net] = list(search.chosen)
        else:
            quantize_onnx_file(path, out[net], batches, target="onnxruntime-cpu", run_check=False,
                               exclude=(exclude or {}).get(net, ()))
        seconds[net] = time.perf_counter() - start
    return out, seconds, kept


class OrtNet:
    """A session that ``detect_face`` can call like the torch net: tensors in, a tuple of tensors out,
    its time summed in ``seconds``."""

    def __init__(self, path: Path, threads: int):
        import onnxruntime as ort
        import torch

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self._param, self.seconds = torch.zeros(1), 0.0
        # one intra-op thread runs every kernel on the calling thread: its CPU time is what the run cost,
        # and holds on a shared machine; with more threads, wall time
        self.clock = time.thread_time if threads == 1 else time.perf_counter

    def parameters(self):
        return iter([self._param])

    def __call__(self, x):
        import torch

        feed = {"x": np.ascontiguousarray(x.numpy(), dtype=np.float32)}
        start = self.clock()
        outs = self.session.run(None, feed)
        self.seconds += self.clock() - start
        return tuple(torch.from_numpy(o) for o in outs)


def eval_images(n: int, seed: int = 0) -> list[np.ndarray]:
    """Photos at deployment sizes: grace_hopper (one face) rescaled, cropped and jittered, and the two
    scikit-learn photos (no face), H x W x 3 uint8."""
    from PIL import Image

    from quantship.examples.real.photos import jitter, photo

    rng = np.random.default_rng([seed, 21])
    images = []
    for i in range(n):
        name = "grace_hopper" if i % 4 else ("china", "flower")[(i // 4) % 2]
        image = photo(name)
        h, w = image.shape[:2]
        if name == "grace_hopper":  # keep the face: crop at most 15% off each side
            y0, x0 = int(rng.uniform(0, 0.15) * h), int(rng.uniform(0, 0.15) * w)
            image = image[y0:h - int(rng.uniform(0, 0.15) * h), x0:w - int(rng.uniform(0, 0.15) * w)]
        side = float(rng.uniform(240, 480))  # the longer side, as a camera frame or a thumbnail would be
        scale = side / max(image.shape[:2])
        size = (max(24, int(image.shape[1] * scale)), max(24, int(image.shape[0] * scale)))
        images.append(jitter(np.asarray(Image.fromarray(image).resize(size, Image.BILINEAR)), rng))
    return images


def detect(nets: dict[str, OrtNet], image: np.ndarray) -> np.ndarray:
    import torch
    from facenet_pytorch.models.utils.detect_face import detect_face

    with torch.no_grad():
        boxes, _ = detect_face(image, MIN_FACE, nets["pnet"], nets["rnet"], nets["onet"], list(THRESHOLDS),
                               FACTOR, "cpu")
    return np.asarray(boxes[0], dtype=np.float64).reshape(-1, 5)


def iou(a: np.ndarray, b: np.ndarray) -> float:
    x0, y0, x1, y1 = max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x1 - x0) * max(0.0, y1 - y0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def matched(reference: np.ndarray, boxes: np.ndarray, threshold: float = 0.5) -> int:
    """Reference boxes with a box of ``boxes`` at IoU >= threshold, one to one, greedy by IoU."""
    used, count = set(), 0
    for r in reference:
        best, best_iou = None, threshold
        for j, b in enumerate(boxes):
            if j not in used and (v := iou(r, b)) >= best_iou:
                best, best_iou = j, v
        if best is not None:
            used.add(best)
            count += 1
    return count


def pyramid_sizes(h: int, w: int) -> list[tuple[int, int]]:
    """The PNet input sizes ``detect_face`` makes for an h x w image (its own scale loop)."""
    scale = 12.0 / MIN_FACE
    sizes, shortest = [], min(h, w) * scale
    while shortest >= 12:
        sizes.append((int(h * scale + 1), int(w * scale + 1)))
        scale, shortest = scale * FACTOR, shortest * FACTOR
    return sizes


def run(images: list[np.ndarray], fp32: dict[str, Path], int8: dict[str, Path], threads: int, reps: int) -> dict:
    from quantship.inspect import wilson_interval

    sessions = {kind: {net: OrtNet(p, threads) for net, p in paths.items()}
                for kind, paths in (("fp32", fp32), ("int8", int8))}
    times = {kind: {net: [] for net in NETS} for kind in sessions}
    found = {"fp32": 0, "int8": 0, "reproduced": 0, "extra": 0}
    for image in images:
        boxes = {}
        per = {kind: {net: [] for net in NETS} for kind in sessions}
        for _ in range(reps):
            for kind, nets in sessions.items():  # interleaved: FP32 then INT8, rep after rep
                for net in nets.values():
                    net.seconds = 0.0
                boxes[kind] = detect(nets, image)
                for name, net in nets.items():
                    per[kind][name].append(net.seconds)
        for kind in sessions:
            for name in NETS:
                times[kind][name].append(statistics.median(per[kind][name]))
        hit = matched(boxes["fp32"], boxes["int8"])
        found["fp32"] += len(boxes["fp32"])
        found["int8"] += len(boxes["int8"])
        found["reproduced"] += hit
        found["extra"] += len(boxes["int8"]) - hit
    ms = {kind: {name: 1e3 * statistics.median(v) for name, v in per_net.items()} for kind, per_net in times.items()}
    for kind in ms:
        ms[kind]["total"] = 1e3 * statistics.median([sum(times[kind][n][i] for n in NETS) for i in range(len(images))])
    found["interval"] = wilson_interval(found["reproduced"], found["fp32"]) if found["fp32"] else None
    return {"ms": ms, "found": found}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=40)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", default="1,2", help="comma-separated ONNX Runtime intra-op thread counts")
    args = _smoke.parse_args(parser, argv)
    from quantship.examples.real import mtcnn

    n_images, reps = (4, 1) if args.smoke else (args.images, args.reps)
    threads = [1] if args.smoke else [int(t) for t in args.threads.split(",")]
    calib = mtcnn.make_crops(16 if args.smoke else 64, seed=1).x
    images = eval_images(n_images)
    lines = [*_smoke.banner(args), *_smoke.cpu_lines("MTCNN end to end: FP32 against quantship INT8 files")]
    with tempfile.TemporaryDirectory(prefix="quantship-mtcnn-") as tmp:
        fp32 = export_nets(Path(tmp))
        int8, seconds, _ = quantize_nets(fp32, calib, Path(tmp))
        # PNet's first two Convs read 3 and 10 channels: ONNX Runtime's QLinearConv runs those slower than
        # its float Conv (bench/conv_speed.py); the same files with them kept float, as a user would
        excluded = first_convs(fp32["pnet"], 2)
        pnet_ex, _, _ = quantize_nets({"pnet": fp32["pnet"]}, calib, Path(tmp), exclude={"pnet": excluded},
                                      tag="int8_ex")
        int8_ex = {**int8, **pnet_ex}  # RNet's and ONet's files are the plain ones
        int8_speed, speed_seconds, kept = ({}, {}, {}) if args.smoke else quantize_nets(fp32, calib, Path(tmp),
                                                                                         tag="int8_speed", speed=True)
        sizes = [pyramid_sizes(*im.shape[:2]) for im in images]
        largest = max(s[0] for s in sizes)
        lines += ["", f"{len(images)} images, longer side 240-480 px (grace_hopper cropped and jittered: 3 in 4; china "
                  f"and flower: 1 in 4); min face {MIN_FACE} px, thresholds {THRESHOLDS}, pyramid factor {FACTOR}: "
                  f"{min(map(len, sizes))}-{max(map(len, sizes))} PNet scales per image, the largest "
                  f"{largest[0]} x {largest[1]}. Quantize time (s): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) + "."
                  + (" The speed search (s): " + ", ".join(f"{k} {v:.1f}" for k, v in speed_seconds.items())
                     + "; kept float: " + "; ".join(f"{k} {', '.join(v) or 'nothing'}" for k, v in kept.items())
                     + "." if kept else ""), ""]
        header = "| INT8 files | threads | faces FP32 finds | reproduced by INT8 (IoU >= 0.5) | INT8 only | " + \
            " | ".join(f"{n} ms FP32 / INT8" for n in (*NETS, "total")) + " |"
        lines += [header, "|---|---|---|---|---|" + "---|" * (len(NETS) + 1)]
        variants = (("quantize-onnx", int8), (f"PNet's {', '.join(excluded)} float (--exclude)", int8_ex),
                    *((("quantize-onnx --speed-search", int8_speed),) if int8_speed else ()))
        for (label, files), t in ((v, t) for v in variants for t in threads):
            r = run(images, fp32, files, t, reps)
            f, ms = r["found"], r["ms"]
            interval = f" [{100 * f['interval'][0]:.1f}, {100 * f['interval'][1]:.1f}]" if f["interval"] else ""
            cells = " | ".join(f"{ms['fp32'][n]:.3g} / {ms['int8'][n]:.3g} ({ms['fp32'][n] / ms['int8'][n]:.2f}x)"
                               for n in (*NETS, "total"))
            lines.append(f"| {label} | {t} | {f['fp32']} | {f['reproduced']}/{f['fp32']}{interval} | {f['extra']} | {cells} |")
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
