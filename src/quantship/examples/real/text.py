"""Rendered text for the OCR tasks: DejaVu fonts from matplotlib's mpl-data, words from the stdlib.

The fonts ship with matplotlib (a dependency of quantship), so every machine renders the same
glyphs whatever fonts its system has. Words come from the Zen of Python (``this``) plus digits
and punctuation, drawn with a seeded generator.
"""

from __future__ import annotations

import codecs
import functools
import importlib
from pathlib import Path

import numpy as np

from quantship.examples.real import require

FONT_NAMES = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSansMono.ttf",
              "DejaVuSansMono-Bold.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf")


@functools.cache
def fonts() -> tuple[Path, ...]:
    """The DejaVu TrueType files inside matplotlib's mpl-data."""
    import matplotlib

    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    found = tuple(folder / name for name in FONT_NAMES if (folder / name).is_file())
    if not found:
        raise FileNotFoundError(f"no DejaVu fonts in {folder}: reinstall matplotlib")
    return found


@functools.cache
def _font(path: Path, size: int):
    from PIL import ImageFont

    return ImageFont.truetype(str(path), size)


@functools.cache
def vocabulary() -> tuple[str, ...]:
    import ast
    import importlib.util

    # the Zen of Python, read from this.py's source (importing it would print it)
    source = Path(importlib.util.find_spec("this").origin).read_text()
    assign = next(node for node in ast.parse(source).body if isinstance(node, ast.Assign))
    text = codecs.decode(ast.literal_eval(assign.value), "rot13")
    words = sorted({w.strip(".,!*-'\"") for w in text.split()} - {""})
    return tuple(words) + ("2024", "3.14", "42", "No.7", "ID:", "x=1", "(a+b)", "100%", "v1.4.4", "OK")


def random_text(rng: np.random.Generator, n_words: int) -> str:
    words = vocabulary()
    return " ".join(words[i] for i in rng.integers(0, len(words), n_words))


def font_for(rng: np.random.Generator, size: int):
    paths = fonts()
    return _font(paths[int(rng.integers(0, len(paths)))], size)


def ink_box(draw, xy: tuple[int, int], text: str, font) -> tuple[int, int, int, int]:
    """The (x0, y0, x1, y1) pixel box of ``text`` drawn at ``xy``."""
    return tuple(int(v) for v in draw.textbbox(xy, text, font=font))


def add_noise(image: np.ndarray, rng: np.random.Generator, sigma: float) -> np.ndarray:
    """Gaussian pixel noise, clipped back to uint8."""
    if sigma <= 0:
        return image
    noisy = image.astype(np.float32) + rng.normal(0.0, sigma, image.shape).astype(np.float32)
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8)


@functools.cache
def rapidocr_resize(module: str, name: str, shape_field: str, shape: tuple[int, int, int]):
    """The ``resize_norm_img`` of rapidocr's class ``module.name`` (its pre-processing only: the instance is made
    without ``__init__``, no session is built) with ``shape_field`` set to ``shape``."""
    require("rapidocr_onnxruntime")
    part = object.__new__(getattr(importlib.import_module(module), name))
    setattr(part, shape_field, list(shape))
    return part.resize_norm_img
