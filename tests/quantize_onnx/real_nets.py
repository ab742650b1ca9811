"""facenet-pytorch's MTCNN nets as float ONNX files for the tests that need a real model (skipped, with
the reason, where the package is not installed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quantship import export_onnx
from quantship.examples import real
from quantship.examples.real import mtcnn


def mtcnn_file(net: str, folder: Path, samples: int = 16, **export) -> tuple[Path, np.ndarray]:
    """``net`` ("pnet", "rnet", "onet") exported by ``export_onnx`` (input ``x``, output ``p``: the face
    probability) and ``samples`` calibration crops at its size (REAL.md's calibration draw, seed 1)."""
    try:
        real.require(mtcnn.MODULE)
    except real.MissingPackage as exc:
        pytest.skip(str(exc))
    crops = mtcnn.make_crops(samples, seed=1).x[net]
    path = export_onnx(mtcnn.FaceProbability(mtcnn.load_net(net)), torch.from_numpy(crops[:1]),
                       folder / f"{net}.onnx", input_names=["x"], output_names=["p"], **export)
    return path, crops
