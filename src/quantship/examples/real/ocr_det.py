"""PP-OCRv4 text detector (rapidocr-onnxruntime 1.4.4): find every text line on a page.

Task: pages of 736 x 992 pixels with 6-14 lines of DejaVu text (font, size, indentation, contrast
and noise varied by a seeded generator); ground truth is each line's box (its ink extent).
Pre- and post-processing are rapidocr's own: ``DetPreProcess`` (the configured
``limit_side_len``/``limit_type``, mean, std), ``DBPostProcess`` with rapidocr's configured
thresholds and ``TextDetector.filter_tag_det_res``. A detection matches a line when the IoU of
their axis-aligned boxes is at least 0.5 (one-to-one, greedy by IoU): recall is matched lines /
lines, precision matched detections / detections.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantship.examples.real import Count, data_dir, package_file, require, save_npz
from quantship.examples.real import text as _text

MODULE = "rapidocr_onnxruntime"
MODEL_FILE = "models/ch_PP-OCRv4_det_infer.onnx"
PAGE_HW = (736, 992)
IOU = 0.5
_VERSION = 1


def model_path() -> Path:
    """The detector's ONNX file inside the installed rapidocr-onnxruntime."""
    return package_file(MODULE, MODEL_FILE)


@functools.cache
def det_config() -> dict:
    """rapidocr's own ``Det`` section of its packaged config.yaml."""
    from rapidocr_onnxruntime.utils import read_yaml

    return dict(read_yaml(str(package_file(MODULE, "config.yaml")))["Det"])


@dataclass(frozen=True)
class Pages:
    """``x``: N x 3 x H x W float32 as rapidocr feeds the model; ``boxes[i]``: K x 4 (x0, y0, x1, y1) lines
    of page i in the page's own pixels; ``hw``: the page size before pre-processing."""

    x: np.ndarray
    boxes: list[np.ndarray]
    hw: tuple[int, int] = PAGE_HW


def render_page(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One page (H x W x 3 uint8) and its line boxes (K x 4)."""
    from PIL import Image, ImageDraw

    height, width = PAGE_HW
    background = int(rng.integers(170, 256))
    page = Image.new("L", (width, height), background)
    draw = ImageDraw.Draw(page)
    boxes = []
    y = int(rng.integers(10, 40))
    for _ in range(int(rng.integers(6, 15))):
        size = int(rng.integers(16, 37))
        font = _text.font_for(rng, size)
        x = int(rng.integers(10, 300))
        line = _text.random_text(rng, int(rng.integers(2, 9)))
        box = _text.ink_box(draw, (x, y), line, font)
        while box[2] > width - 10 and " " in line:  # drop words until the line fits
            line = line.rsplit(" ", 1)[0]
            box = _text.ink_box(draw, (x, y), line, font)
        if box[3] > height - 10 or box[2] > width - 10:
            break
        ink = int(rng.integers(0, max(1, background - 90)))
        draw.text((x, y), line, fill=ink, font=font)
        boxes.append(box)
        y = box[3] + int(rng.integers(size // 2 + 4, 2 * size + 10))
    grey = _text.add_noise(np.asarray(page), rng, float(rng.uniform(0, 10)))
    return np.repeat(grey[:, :, None], 3, axis=2), np.asarray(boxes, dtype=np.float32).reshape(-1, 4)


def preprocess(page: np.ndarray) -> np.ndarray:
    """rapidocr's ``DetPreProcess`` with its configured settings: 1 x 3 x H' x W' float32."""
    require(MODULE)
    from rapidocr_onnxruntime.ch_ppocr_det.utils import DetPreProcess

    cfg = det_config()
    return DetPreProcess(cfg["limit_side_len"], cfg["limit_type"], cfg["mean"], cfg["std"])(page)


def make_pages(n: int, seed: int = 0) -> Pages:
    """``n`` pages, cached under ``cache_dir()/real/ocr_det``."""
    path = data_dir("ocr_det") / f"pages_v{_VERSION}_seed{seed}_n{n}.npz"
    if path.exists():
        with np.load(path) as f:
            return Pages(f["x"], [f[f"boxes{i}"] for i in range(n)])
    rng = np.random.default_rng([seed, 27])
    xs, boxes = [], []
    for _ in range(n):
        page, page_boxes = render_page(rng)
        xs.append(preprocess(page)[0])
        boxes.append(page_boxes)
    pages = Pages(np.stack(xs).astype(np.float32), boxes)
    save_npz(path, x=pages.x, **{f"boxes{i}": b for i, b in enumerate(boxes)})
    return pages


@functools.cache
def _postprocessors():
    from rapidocr_onnxruntime.ch_ppocr_det.text_detect import TextDetector
    from rapidocr_onnxruntime.ch_ppocr_det.utils import DBPostProcess

    cfg = det_config()
    db = DBPostProcess(thresh=cfg["thresh"], box_thresh=cfg["box_thresh"], max_candidates=cfg["max_candidates"],
                       unclip_ratio=cfg["unclip_ratio"], score_mode=cfg["score_mode"],
                       use_dilation=cfg["use_dilation"])
    detector = object.__new__(TextDetector)  # only its box filter: no session is built
    return db, detector.filter_tag_det_res


def detect(prob_map: np.ndarray, hw: tuple[int, int] = PAGE_HW) -> np.ndarray:
    """rapidocr's DB post-processing of one page's 1 x 1 x H x W map: K x 4 axis-aligned boxes."""
    db, filter_boxes = _postprocessors()
    quads, _ = db(np.asarray(prob_map, dtype=np.float32), hw)
    quads = filter_boxes(quads, hw)
    if len(quads) == 0:
        return np.zeros((0, 4), np.float32)
    quads = np.asarray(quads, dtype=np.float32)
    return np.concatenate([quads.min(axis=1), quads.max(axis=1)], axis=1)


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of boxes (x0, y0, x1, y1)."""
    if len(a) == 0 or len(b) == 0:
        return np.zeros((len(a), len(b)))
    x0 = np.maximum(a[:, None, 0], b[None, :, 0])
    y0 = np.maximum(a[:, None, 1], b[None, :, 1])
    x1 = np.minimum(a[:, None, 2], b[None, :, 2])
    y1 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    area = lambda r: (r[:, 2] - r[:, 0]) * (r[:, 3] - r[:, 1])  # noqa: E731
    return inter / (area(a)[:, None] + area(b)[None, :] - inter)


def match(found: np.ndarray, truth: np.ndarray, threshold: float = IOU) -> int:
    """Greedy one-to-one matches at IoU >= ``threshold``, best pairs first."""
    iou = iou_matrix(found, truth)
    matched = 0
    while iou.size and iou.max() >= threshold:
        i, j = np.unravel_index(int(iou.argmax()), iou.shape)
        matched += 1
        iou[i, :] = -1
        iou[:, j] = -1
    return matched


def recall_precision(detections: list[np.ndarray], truth: list[np.ndarray]) -> tuple[Count, Count]:
    """Line recall and detection precision at IoU >= 0.5, over all pages."""
    hits = [match(d, t) for d, t in zip(detections, truth)]
    return (Count(sum(hits), sum(len(t) for t in truth)), Count(sum(hits), sum(len(d) for d in detections)))
