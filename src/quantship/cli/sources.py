"""Where the command line gets models and calibration data from.

Models: ``torchvision:NAME``, ``timm:NAME`` (if timm is installed), or ``path/to/file.py:factory``,
with optional ``--weights state_dict.pt``. Data: ``.npy`` / ``.npz`` arrays (N x C x H x W), or a
folder of images with a stated preprocessing (resize, centre crop, normalisation).
Every problem is a ``UsageError``: one line, exit code 2.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantship.cli.main import UsageError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def load_model(spec: str, weights: str | None = None):
    """Build the model a ``MODEL`` argument names, in eval mode, with optional weights."""
    import torch

    kind, _, name = spec.partition(":")
    if kind == "hf" and name:
        return load_hf_model(name, weights)
    if not name:
        raise UsageError(f"MODEL {spec!r} must be torchvision:NAME, timm:NAME or path/to/file.py:factory")
    if kind == "torchvision":
        import torchvision

        try:
            model = torchvision.models.get_model(name, weights=None)
        except (ValueError, KeyError):
            known = torchvision.models.list_models(module=torchvision.models)
            close = [m for m in known if name.lower()[:4] in m][:6] or known[:6]
            raise UsageError(f"unknown torchvision model {name!r}; e.g. {', '.join(close)}") from None
    elif kind == "timm":
        if importlib.util.find_spec("timm") is None:
            raise UsageError("timm is not installed: pip install timm, or use torchvision:NAME")
        import timm

        try:
            model = timm.create_model(name, pretrained=False)
        except RuntimeError as exc:
            raise UsageError(f"unknown timm model {name!r}: {exc}") from None
    elif kind.endswith(".py"):
        path = Path(kind)
        if not path.is_file():
            raise UsageError(f"model file {kind} does not exist")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # the user's file: any failure is bad input
            raise UsageError(f"importing {kind} failed: {type(exc).__name__}: {exc}") from None
        factory = getattr(module, name, None)
        if not callable(factory):
            raise UsageError(f"{kind} has no callable {name!r}")
        model = factory()
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"{kind}:{name}() returned {type(model).__name__}, not a torch.nn.Module")
    else:
        raise UsageError(f"MODEL {spec!r}: unknown source {kind!r}; use torchvision:, timm: or file.py:factory")
    if weights:
        wpath = Path(weights)
        if not wpath.is_file():
            raise UsageError(f"weights file {weights} does not exist")
        try:
            state = torch.load(wpath, map_location="cpu", weights_only=True)
            model.load_state_dict(state)
        except Exception as exc:  # torch raises RuntimeError/UnpicklingError for mismatches
            first = str(exc).strip().splitlines()[0]
            raise UsageError(f"cannot load {weights} into {spec}: {first}") from None
    return model.eval()


@dataclass(frozen=True)
class Preprocessing:
    """How a folder of images becomes model input."""

    resize: int = 256
    crop: int = 224
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD

    def describe(self) -> str:
        return f"resize {self.resize}, centre crop {self.crop}, normalise mean {self.mean} std {self.std}"


def load_array(path: str, key: str | None = None) -> np.ndarray:
    """An N x C x H x W float32 array from ``.npy``/``.npz`` or a folder of images."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"calibration data {path} does not exist")
    if p.is_dir():
        raise UsageError("a folder of images needs load_images(); internal misuse")  # pragma: no cover
    try:
        if p.suffix == ".npy":
            array = np.load(p, allow_pickle=False)
        elif p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as archive:
                names = list(archive.keys())
                if key is None and len(names) != 1:
                    raise UsageError(f"{path} holds arrays {names}: choose one with --key")
                array = archive[key or names[0]]
        else:
            raise UsageError(f"calibration data {path}: use a .npy or .npz file, or a folder of images")
    except (ValueError, OSError) as exc:
        raise UsageError(f"cannot read {path} as a numpy array: {exc}") from None
    if array.ndim != 4:
        raise UsageError(
            f"calibration array {path} has shape {array.shape}; expected N x C x H x W (4 dimensions)")
    if array.shape[-1] in (1, 3) and array.shape[1] not in (1, 3):
        raise UsageError(
            f"calibration array {path} has shape {array.shape}, which looks channels-last; "
            "transpose it to N x C x H x W (np.transpose(a, (0, 3, 1, 2)))")
    return array.astype(np.float32, copy=False)


def load_images(folder: str, prep: Preprocessing, limit: int) -> np.ndarray:
    """Up to ``limit`` images from a folder, preprocessed as ``prep`` states."""
    from PIL import Image

    files = sorted(f for f in Path(folder).rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise UsageError(f"folder {folder} holds no image ({', '.join(sorted(IMAGE_SUFFIXES))})")
    mean = np.array(prep.mean, dtype=np.float32).reshape(3, 1, 1)
    std = np.array(prep.std, dtype=np.float32).reshape(3, 1, 1)
    out = []
    for f in files[:limit]:
        try:
            img = Image.open(f).convert("RGB")
        except OSError as exc:
            raise UsageError(f"cannot read image {f}: {exc}") from None
        w, h = img.size
        scale = prep.resize / min(w, h)
        img = img.resize((max(prep.crop, round(w * scale)), max(prep.crop, round(h * scale))), Image.BILINEAR)
        w, h = img.size
        left, top = (w - prep.crop) // 2, (h - prep.crop) // 2
        img = img.crop((left, top, left + prep.crop, top + prep.crop))
        arr = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0
        out.append((arr - mean) / std)
    return np.stack(out)


def calibration_batches(array: np.ndarray, batch_size: int, max_samples: int) -> list[np.ndarray]:
    """Whole batches of ``batch_size`` (the captured batch size) up to ``max_samples``."""
    if batch_size < 1:
        raise UsageError(f"--batch-size {batch_size} must be at least 1")
    n = min(len(array), max_samples)
    if n < batch_size:
        raise UsageError(
            f"calibration data holds {len(array)} sample(s), fewer than --batch-size {batch_size}; "
            "give more samples or a smaller --batch-size")
    usable = (n // batch_size) * batch_size
    return [array[i:i + batch_size] for i in range(0, usable, batch_size)]


def read_calibration(path: str, *, key: str | None, prep: Preprocessing, batch_size: int,
                     max_samples: int) -> list[np.ndarray]:
    """Calibration batches from any accepted source."""
    p = Path(path)
    array = load_images(path, prep, max_samples) if p.is_dir() else load_array(path, key)
    return calibration_batches(array, batch_size, max_samples)


def load_hf_model(name: str, weights: str | None = None):
    """``hf:reference`` (the trained byte-level Llama of quantship.examples.lm), ``hf:DIR`` (a local
    Hugging Face checkpoint, or a folder with only config.json: random weights) or ``hf:config.json``.
    Local files only; the model is wrapped to take token ids and return logits."""
    import torch

    from quantship.examples import lm

    try:
        transformers = lm.require_transformers()
    except ModuleNotFoundError as exc:
        raise UsageError(str(exc)) from None
    if name == "reference":
        model = lm.trained_model(log=lambda m: print(f"training the reference LM (once, cached): {m}", file=sys.stderr))
    else:
        path = Path(name)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise UsageError(f"hf:{name}: give 'reference', a checkpoint folder, or a config.json (local files only)")
        try:
            config = transformers.AutoConfig.from_pretrained(str(config_file.parent), local_files_only=True)
            has_weights = path.is_dir() and any(p.suffix in (".safetensors", ".bin") for p in path.iterdir())
            auto = transformers.AutoModelForCausalLM
            inner = (auto.from_pretrained(str(path), local_files_only=True) if has_weights
                     else auto.from_config(config))
        except (OSError, ValueError, KeyError) as exc:
            raise UsageError(f"hf:{name}: {str(exc).strip().splitlines()[0]}") from None
        if not has_weights:
            print(f"hf:{name}: no weights beside the config: random initial weights", file=sys.stderr)
        model = lm.CausalLMLogits(inner)
    if weights:
        try:
            model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        except Exception as exc:  # torch raises RuntimeError/UnpicklingError for mismatches
            raise UsageError(f"cannot load {weights} into hf:{name}: {str(exc).strip().splitlines()[0]}") from None
    return model.eval()
