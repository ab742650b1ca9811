"""A PyTorch model as a user hands it to ``quantship quantize``: a ``file.py:factory`` and a calibration .npy."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def factory_and_calibration(folder: Path, source: str, factory: str, shape: tuple[int, ...]) -> tuple[str, Path]:
    """``source`` written to ``folder/model.py``, ``shape`` uniform samples (seed 0) to ``folder/cal.npy``;
    returns the model argument (``model.py:factory``) and the calibration file."""
    (folder / "model.py").write_text(source)
    np.save(folder / "cal.npy", np.random.default_rng(0).random(shape).astype(np.float32))
    return f"{folder / 'model.py'}:{factory}", folder / "cal.npy"
