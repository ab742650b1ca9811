"""The photographs that ship inside installed packages: matplotlib's ``grace_hopper.jpg`` (a portrait)
and scikit-learn's ``china.jpg`` and ``flower.jpg``. Real pixels for the detectors, no download."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np


def photo_paths() -> dict[str, Path]:
    import matplotlib
    import sklearn

    paths = {
        "grace_hopper": Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg",
        "china": Path(sklearn.__file__).parent / "datasets" / "images" / "china.jpg",
        "flower": Path(sklearn.__file__).parent / "datasets" / "images" / "flower.jpg",
    }
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"photos missing from the installed matplotlib/scikit-learn: {missing}")
    return paths


@functools.cache
def photo(name: str) -> np.ndarray:
    """H x W x 3 uint8, RGB."""
    from PIL import Image

    with Image.open(photo_paths()[name]) as image:
        return np.asarray(image.convert("RGB")).copy()


def jitter(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Brightness/contrast change, optional horizontal flip, mild pixel noise."""
    out = image.astype(np.float32)
    out = (out - 128.0) * float(rng.uniform(0.7, 1.3)) + 128.0 + float(rng.uniform(-30, 30))
    if rng.random() < 0.5:
        out = out[:, ::-1]
    out += rng.normal(0.0, float(rng.uniform(0, 6)), out.shape).astype(np.float32)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)
