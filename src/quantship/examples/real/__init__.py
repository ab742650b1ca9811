"""Real pretrained models that ship inside installed packages, each with a task and ground truth.

One module per model: ``ocr_cls`` (PP-OCR text-orientation classifier), ``ocr_det`` (PP-OCRv4
text detector), ``magika_files`` (magika's file-type model), ``nudenet_yolo`` (nudenet's YOLOv8n)
and ``mtcnn`` (facenet-pytorch's PNet/RNet/ONet). Each finds its weights inside the installed
package (nothing is downloaded), generates its data deterministically under
``cache_dir() / "real"``, and scores a model as counts (k of n) so Wilson intervals apply.
A package that is not installed raises ``MissingPackage`` with the command that installs it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from quantship.intervals import wilson_interval

# the pins of the `real` extra in pyproject.toml; facenet-pytorch is installed with --no-deps
PINS = {
    "rapidocr_onnxruntime": "rapidocr-onnxruntime==1.4.4",
    "magika": "magika==1.0.3",
    "nudenet": "nudenet==3.4.2",
    "onnx2torch": "onnx2torch==1.5.15",
    "nncf": "nncf==3.4.0",
    "facenet_pytorch": "facenet-pytorch==2.6.0",
}
MODELS = ("ocr_cls", "magika", "ocr_det", "nudenet", "mtcnn")


class MissingPackage(ModuleNotFoundError):
    """A model's package is not installed; the message holds the command that installs it."""


def install_command(module: str) -> str:
    pin = PINS.get(module, module)
    if module == "facenet_pytorch":
        return f"pip install --no-deps {pin}"
    return f"pip install {pin}  (or pip install -e '.[real]')"


def require(module: str) -> Path:
    """The installed package folder of ``module``, or ``MissingPackage`` naming the install command."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackage(f"{module} is not installed: {install_command(module)}", name=module)
    return Path(next(iter(spec.submodule_search_locations)))


def package_file(module: str, relative: str) -> Path:
    """A file shipped inside an installed package (never downloaded)."""
    path = require(module) / relative
    if not path.is_file():
        raise MissingPackage(f"{module} is installed but has no {relative}; reinstall it: {install_command(module)}",
                             name=module)
    return path


def data_dir(*parts: str) -> Path:
    """Where a model's generated data lives: ``cache_dir() / "real" / ...`` (created)."""
    from quantship.examples.digits import cache_dir  # the one definition of the cache folder (imports torch)

    path = cache_dir().joinpath("real", *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_npz(path: Path, **arrays) -> Path:
    """Write ``arrays`` atomically (a concurrent reader never sees half a file)."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class Count:
    """k of n, with its Wilson 95% interval."""

    k: int
    n: int

    @property
    def rate(self) -> float:
        return self.k / self.n if self.n else float("nan")

    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.k, self.n)

    def __add__(self, other: Count) -> Count:
        return Count(self.k + other.k, self.n + other.n)

    def __str__(self) -> str:
        if not self.n:
            return "0/0"
        lo, hi = self.interval()
        return f"{self.k}/{self.n} = {self.rate:.4f} [{lo:.4f}, {hi:.4f}]"


__all__ = ["MODELS", "PINS", "Count", "MissingPackage", "data_dir", "install_command", "package_file", "require",
           "save_npz"]
