"""PP-OCR text-orientation classifier (rapidocr-onnxruntime 1.4.4): is a text line upright or upside down?

Task: single text lines rendered with DejaVu fonts (font, size, ink/background contrast and
pixel noise varied by a seeded generator), half of them rotated by 180 degrees. Ground truth is
the rotation; the model's classes are rapidocr's ``label_list`` ['0', '180']. Pre-processing is
rapidocr's own (``TextClassifier.resize_norm_img``: height 48, width up to 192, zero padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantship.examples.real import Count, data_dir, package_file, save_npz
from quantship.examples.real import text as _text

MODULE = "rapidocr_onnxruntime"
MODEL_FILE = "models/ch_ppocr_mobile_v2.0_cls_infer.onnx"
INPUT_SHAPE = (3, 48, 192)  # rapidocr's cls_image_shape
_VERSION = 1


def model_path() -> Path:
    """The classifier's ONNX file inside the installed rapidocr-onnxruntime."""
    return package_file(MODULE, MODEL_FILE)


@dataclass(frozen=True)
class Lines:
    """``x``: N x 3 x 48 x 192 float32, as rapidocr feeds the model; ``y``: 0 upright, 1 rotated 180."""

    x: np.ndarray
    y: np.ndarray


def render_line(rng: np.random.Generator) -> np.ndarray:
    """One upright text line, H x W x 3 uint8 (BGR order is moot: grey levels)."""
    from PIL import Image, ImageDraw

    size = int(rng.integers(16, 41))
    font = _text.font_for(rng, size)
    line = _text.random_text(rng, int(rng.integers(2, 7)))
    background = int(rng.integers(150, 256))
    ink = int(rng.integers(0, max(1, background - 70)))
    if rng.random() < 0.25:  # light text on a dark background
        background, ink = 255 - background, 255 - ink
    probe = ImageDraw.Draw(Image.new("L", (1, 1)))
    x0, y0, x1, y1 = _text.ink_box(probe, (0, 0), line, font)
    pad_x, pad_y = int(rng.integers(2, 12)), int(rng.integers(2, 10))
    image = Image.new("L", (x1 - x0 + 2 * pad_x, y1 - y0 + 2 * pad_y), background)
    ImageDraw.Draw(image).text((pad_x - x0, pad_y - y0), line, fill=ink, font=font)
    grey = _text.add_noise(np.asarray(image), rng, float(rng.uniform(0, 12)))
    return np.repeat(grey[:, :, None], 3, axis=2)


def preprocess(images: list[np.ndarray]) -> np.ndarray:
    """rapidocr's resize and normalisation of the cls model, batched: N x 3 x 48 x 192 float32."""
    resize_norm = _text.rapidocr_resize("rapidocr_onnxruntime.ch_ppocr_cls.text_cls", "TextClassifier",
                                        "cls_image_shape", INPUT_SHAPE)
    return np.stack([resize_norm(img) for img in images]).astype(np.float32)


def make_lines(n: int, seed: int = 0) -> Lines:
    """``n`` lines (labels alternate, then shuffled), cached under ``cache_dir()/real/ocr_cls``."""
    path = data_dir("ocr_cls") / f"lines_v{_VERSION}_seed{seed}_n{n}.npz"
    if path.exists():
        with np.load(path) as f:
            return Lines(f["x"], f["y"])
    rng = np.random.default_rng([seed, 25])
    labels = rng.permutation(np.arange(n) % 2)
    images = []
    for label in labels:
        img = render_line(rng)
        images.append(np.ascontiguousarray(img[::-1, ::-1]) if label else img)
    lines = Lines(preprocess(images), labels.astype(np.int64))
    save_npz(path, x=lines.x, y=lines.y)
    return lines


def accuracy(logits: np.ndarray, labels: np.ndarray) -> Count:
    """Top-1 accuracy as a count (column 0 is '0', column 1 is '180', rapidocr's label_list)."""
    return Count(int((np.asarray(logits).argmax(-1) == labels).sum()), int(len(labels)))


def agreement(logits: np.ndarray, reference: np.ndarray) -> Count:
    return Count(int((np.asarray(logits).argmax(-1) == np.asarray(reference).argmax(-1)).sum()), int(len(logits)))
