"""nudenet 3.4.2's detector (``320n.onnx``, a YOLOv8n with 18 classes): fidelity only.

There is no labelled data for this model on the machine, so there is no task metric: the
figures are coverage (does the file quantize and run), speed, and fidelity to FP32. Images are
random crops of the photographs shipped in matplotlib and scikit-learn (see ``photos``), with
brightness, contrast, flips and noise varied by a seeded generator, pre-processed by nudenet's
own ``_read_image`` (letterbox to 320 x 320) and decoded by nudenet's own ``_postprocess``
(score >= 0.2, NMS). A detection of FP32 is reproduced when the candidate has one of the same
class at IoU >= 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantship.examples.real import Count, data_dir, package_file, require, save_npz
from quantship.examples.real.ocr_det import match
from quantship.examples.real.photos import jitter, photo

MODULE = "nudenet"
MODEL_FILE = "320n.onnx"
SIZE = 320
IOU = 0.5
_VERSION = 1


def model_path() -> Path:
    return package_file(MODULE, MODEL_FILE)


@dataclass(frozen=True)
class Images:
    """``x``: N x 3 x 320 x 320 float32 as nudenet feeds the model; ``meta``: N x 6 of nudenet's
    (x_ratio, y_ratio, x_pad, y_pad, width, height), which its post-processing needs."""

    x: np.ndarray
    meta: np.ndarray


def render_image(rng: np.random.Generator) -> np.ndarray:
    """A random crop (40-100% of each side) of one photo, jittered; H x W x 3 uint8 BGR (what cv2 reads)."""
    name = ("grace_hopper", "china", "flower")[int(rng.integers(0, 3))] if rng.random() < 0.5 else "grace_hopper"
    image = photo(name)
    h, w = image.shape[:2]
    ch, cw = int(h * rng.uniform(0.4, 1.0)), int(w * rng.uniform(0.4, 1.0))
    y0, x0 = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    return np.ascontiguousarray(jitter(image[y0:y0 + ch, x0:x0 + cw], rng)[:, :, ::-1])


def make_images(n: int, seed: int = 0) -> Images:
    path = data_dir("nudenet") / f"images_v{_VERSION}_seed{seed}_n{n}.npz"
    if path.exists():
        with np.load(path) as f:
            return Images(f["x"], f["meta"])
    require(MODULE)
    from nudenet.nudenet import _read_image

    rng = np.random.default_rng([seed, 320])
    xs, metas = [], []
    for _ in range(n):
        blob, x_ratio, y_ratio, x_pad, y_pad, width, height = _read_image(render_image(rng), SIZE)
        xs.append(blob[0])
        metas.append((x_ratio, y_ratio, x_pad, y_pad, width, height))
    images = Images(np.stack(xs).astype(np.float32), np.asarray(metas, dtype=np.float64))
    save_npz(path, x=images.x, meta=images.meta)
    return images


def detect(output: np.ndarray, meta: np.ndarray) -> list[dict]:
    """nudenet's own decoding of one image's 1 x 22 x A output."""
    from nudenet.nudenet import _postprocess

    x_ratio, y_ratio, x_pad, y_pad, width, height = meta
    return _postprocess([output], int(x_pad), int(y_pad), x_ratio, y_ratio, int(width), int(height), SIZE, SIZE)


def _xyxy(det: dict) -> np.ndarray:
    x, y, w, h = det["box"]
    return np.asarray([x, y, x + w, y + h], dtype=np.float64)


def reproduced(reference: list[list[dict]], candidate: list[list[dict]]) -> tuple[Count, Count]:
    """(FP32 detections the candidate reproduces, candidate detections that FP32 has), same class, IoU >= 0.5."""
    hits, n_ref, n_cand = 0, 0, 0
    for ref, cand in zip(reference, candidate):
        n_ref, n_cand = n_ref + len(ref), n_cand + len(cand)
        for label in {d["class"] for d in ref} | {d["class"] for d in cand}:
            a = np.asarray([_xyxy(d) for d in cand if d["class"] == label]).reshape(-1, 4)
            b = np.asarray([_xyxy(d) for d in ref if d["class"] == label]).reshape(-1, 4)
            hits += match(a, b, IOU)
    return Count(hits, n_ref), Count(hits, n_cand)
