"""PP-OCRv4 text recognizer (rapidocr-onnxruntime 1.4.4): read the characters of a text line.

Task: single text lines of one to four words rendered with DejaVu fonts (font, size, contrast and
pixel noise varied by a seeded generator, as the orientation classifier's lines). Ground truth is the
rendered string. Pre-processing is rapidocr's own (``TextRecognizer.resize_norm_img``: height 48,
width 320, zero padding on the right). The model writes per-column character probabilities
``[N, 40, 6625]``; a line is read by greedy CTC decoding (the best class per column, repeats merged,
blanks dropped) over the character list the file carries in its metadata (``character``), with the
blank first and the space last, as rapidocr's ``CTCLabelDecode`` lays them out. A line is correct
when its reading equals the rendered string, spaces ignored (the recognizer's spaces between words
are not what is measured).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantship.examples.real import Count, data_dir, package_file, save_npz
from quantship.examples.real import text as _text

MODULE = "rapidocr_onnxruntime"
MODEL_FILE = "models/ch_PP-OCRv4_rec_infer.onnx"
INPUT_SHAPE = (3, 48, 320)  # rapidocr's rec_img_shape
_VERSION = 1


def model_path() -> Path:
    """The recognizer's ONNX file inside the installed rapidocr-onnxruntime."""
    return package_file(MODULE, MODEL_FILE)


@functools.cache
def characters() -> tuple[str, ...]:
    """Class index -> character: the blank, the file's ``character`` list, the space."""
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(model_path()), load_external_data=False).metadata_props}
    return ("", *meta["character"].splitlines(), " ")


@dataclass(frozen=True)
class Lines:
    """``x``: N x 3 x 48 x 320 float32, as rapidocr feeds the model; ``text``: the rendered strings."""

    x: np.ndarray
    text: np.ndarray


def _readable(line: str) -> bool:
    known = set(characters())
    return all(ch in known for ch in line)


def render_line(rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """One text line that fits rapidocr's 48 x 320 input unshrunk in width: H x W x 3 uint8, its string."""
    from PIL import Image, ImageDraw

    while True:
        size = int(rng.integers(12, 41))
        font = _text.font_for(rng, size)
        line = _text.random_text(rng, int(rng.integers(1, 5)))
        probe = ImageDraw.Draw(Image.new("L", (1, 1)))
        x0, y0, x1, y1 = _text.ink_box(probe, (0, 0), line, font)
        pad_x, pad_y = int(rng.integers(2, 10)), int(rng.integers(2, 8))
        width, height = x1 - x0 + 2 * pad_x, y1 - y0 + 2 * pad_y
        if width <= height * INPUT_SHAPE[2] / INPUT_SHAPE[1] and _readable(line):
            break
    background = int(rng.integers(150, 256))
    ink = int(rng.integers(0, max(1, background - 40)))
    if rng.random() < 0.25:  # light text on a dark background
        background, ink = 255 - background, 255 - ink
    image = Image.new("L", (width, height), background)
    ImageDraw.Draw(image).text((pad_x - x0, pad_y - y0), line, fill=ink, font=font)
    grey = _text.add_noise(np.asarray(image), rng, float(rng.uniform(0, 24)))
    return np.repeat(grey[:, :, None], 3, axis=2), line


def preprocess(images: list[np.ndarray]) -> np.ndarray:
    """rapidocr's resize and normalisation at the default width: N x 3 x 48 x 320 float32."""
    resize_norm = _text.rapidocr_resize("rapidocr_onnxruntime.ch_ppocr_rec.text_recognize", "TextRecognizer",
                                        "rec_image_shape", INPUT_SHAPE)
    ratio = INPUT_SHAPE[2] / INPUT_SHAPE[1]
    return np.stack([resize_norm(img, ratio) for img in images]).astype(np.float32)


def make_lines(n: int, seed: int = 0) -> Lines:
    """``n`` lines, cached under ``cache_dir()/real/ocr_rec``."""
    path = data_dir("ocr_rec") / f"lines_v{_VERSION}_seed{seed}_n{n}.npz"
    if path.exists():
        with np.load(path) as f:
            return Lines(f["x"], f["text"])
    rng = np.random.default_rng([seed, 48])
    images, strings = zip(*(render_line(rng) for _ in range(n)))
    lines = Lines(preprocess(list(images)), np.array(strings))
    save_npz(path, x=lines.x, text=lines.text)
    return lines


def read(probs: np.ndarray) -> list[str]:
    """Greedy CTC reading of ``[N, T, classes]`` probabilities: best class per column, repeats merged, blanks out."""
    chars = characters()
    best = np.asarray(probs).argmax(-1)
    out = []
    for row in best:
        kept = [k for i, k in enumerate(row) if k != 0 and (i == 0 or k != row[i - 1])]
        out.append("".join(chars[k] for k in kept))
    return out


def _bare(s: str) -> str:
    return "".join(s.split())


def accuracy(probs: np.ndarray, text: np.ndarray) -> Count:
    """Lines read exactly (spaces ignored), as a count."""
    got = read(probs)
    return Count(sum(_bare(g) == _bare(str(t)) for g, t in zip(got, text)), len(got))


def agreement(probs: np.ndarray, reference: np.ndarray) -> Count:
    """Lines whose reading equals the FP32 model's reading of the same line (spaces ignored)."""
    got, ref = read(probs), read(reference)
    return Count(sum(_bare(g) == _bare(r) for g, r in zip(got, ref)), len(got))
