"""Labelled evaluation data for ``--eval`` and top-1 of a model, a quantized model and a file.

Data: a ``.npz`` holding arrays ``x`` (N x C x H x W) and ``y`` (N class indices), or a folder of
images with one subfolder per class (classes in sorted folder-name order, preprocessed like
``--calib`` folders). Every figure comes with its Wilson 95% interval.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantship.cli.common import format_accuracy
from quantship.cli.usage import UsageError
from quantship.inspect.read.feeds import load_images
from quantship.inspect.run.verify import ort_session, run_session
from quantship.intervals import wilson_interval


@dataclass(frozen=True)
class Labelled:
    x: np.ndarray  # N x C x H x W float32
    y: np.ndarray  # N int64
    classes: list[str]


def read_labelled(path: str, prep, images: bool = True) -> Labelled:
    """``--eval DATA``: a .npz with ``x`` and ``y``, or an image folder with one subfolder per class.
    ``images``: x is N x C x H x W float (or uint8) images; otherwise any numeric x, kept in its dtype."""

    p = Path(path)
    if not p.exists():
        raise UsageError(f"evaluation data {path} does not exist")
    if p.is_dir():
        folders = sorted(d for d in p.iterdir() if d.is_dir())
        if len(folders) < 2:
            raise UsageError(f"evaluation folder {path} needs one subfolder per class (at least 2), "
                             f"found {len(folders)}")
        xs, ys = [], []
        for index, folder in enumerate(folders):
            images = load_images(str(folder), prep, limit=10**9)
            xs.append(images)
            ys.append(np.full(len(images), index, dtype=np.int64))
        return Labelled(np.concatenate(xs), np.concatenate(ys), [f.name for f in folders])
    if p.suffix != ".npz":
        raise UsageError(f"evaluation data {path}: give a .npz with arrays x and y, or a folder of class folders")
    try:
        with np.load(p, allow_pickle=False) as archive:
            missing = {"x", "y"} - set(archive.keys())
            if missing:
                raise UsageError(f"{path} lacks array(s) {sorted(missing)}: --eval wants x (N x C x H x W) and "
                                 f"y (N class indices); it holds {list(archive.keys())}")
            x, y = archive["x"], archive["y"]
    except (ValueError, OSError, EOFError) as exc:
        raise UsageError(f"cannot read {path} as a numpy archive: {exc}") from None
    if (images and x.ndim != 4) or y.ndim != 1 or len(x) != len(y) or len(y) == 0:
        raise UsageError(f"{path}: x has shape {x.shape} and y {y.shape}; expected "
                         f"{'N x C x H x W' if images else 'N x ...'} and N (N > 0)")
    if not np.issubdtype(y.dtype, np.integer) or (y < 0).any():
        raise UsageError(f"{path}: y must hold non-negative class indices, got dtype {y.dtype}")
    if images and not np.issubdtype(x.dtype, np.floating) and x.dtype != np.uint8:
        raise UsageError(f"{path}: x must be float or uint8 images, got {x.dtype}")
    x = x.astype(np.float32, copy=False) if images else x
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        raise UsageError(f"{path}: x holds NaN or Inf values")
    return Labelled(x, y.astype(np.int64), [str(c) for c in range(int(y.max()) + 1)])


@dataclass(frozen=True)
class Top1:
    """Correct predictions out of n, with a Wilson 95% interval; ``vacuous`` when one class is always predicted."""

    correct: int
    n: int
    vacuous: bool

    def describe(self) -> str:

        text = format_accuracy(self.correct, self.n)
        return text + (" (VACUOUS: the model predicts one class for every input)" if self.vacuous else "")

    def as_dict(self) -> dict:

        low, high = wilson_interval(self.correct, self.n)
        return {"correct": self.correct, "n": self.n, "accuracy": self.correct / self.n,
                "wilson95": [low, high], "vacuous": self.vacuous}


def top1(run: Callable[[np.ndarray], np.ndarray], data: Labelled, batch_size: int) -> Top1:
    """Top-1 of ``run`` (a batch in, logits out) over ``data`` in batches of ``batch_size``.

    A short last batch is padded with zeros to ``batch_size`` (a static-batch file runs it) and the
    padded rows are dropped from the count.
    """
    predictions = []
    for start in range(0, len(data.y), batch_size):
        x = data.x[start:start + batch_size]
        real = len(x)
        if real < batch_size:
            x = np.concatenate([x, np.zeros((batch_size - real, *x.shape[1:]), dtype=x.dtype)])
        logits = np.asarray(run(np.ascontiguousarray(x)))
        predictions.append(logits.reshape(batch_size, -1)[:real].argmax(-1))
    predicted = np.concatenate(predictions)
    correct = int((predicted == data.y).sum())
    return Top1(correct, len(data.y), vacuous=len(np.unique(predicted)) == 1)


def torch_runner(model) -> Callable[[np.ndarray], np.ndarray]:
    import torch

    def run(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = model(torch.from_numpy(x))
        while isinstance(out, (tuple, list)):
            out = out[0]
        return out.detach().float().numpy()

    return run


def file_runner(path: str | Path) -> Callable[[np.ndarray], np.ndarray]:
    """The ONNX file in ONNX Runtime at its default optimizations (what a user gets)."""

    session = ort_session(path, optimized=True)

    def run(x: np.ndarray) -> np.ndarray:
        return run_session(session, [x])[0]

    return run
