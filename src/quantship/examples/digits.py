"""The reference task: scikit-learn's digits, upsampled, and a small residual CNN trained on it.

It makes every accuracy and agreement figure real without a download: 1,797 8x8 images of
10 classes ship inside scikit-learn. The split is fixed (stratified, seed 0, 360 held out), the
training is deterministic, and the trained weights are cached after the first run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quantship.examples.models import TinyResNet

IMAGE_SIZE = 32
N_HELD_OUT = 360
_CACHE_VERSION = 1


@dataclass(frozen=True)
class DigitsSplit:
    """Train and held-out tensors: images N x 1 x 32 x 32 (normalised), labels N."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def cache_dir() -> Path:
    """Where trained weights are kept (``QUANTSHIP_CACHE`` overrides ``~/.cache/quantship``)."""
    root = os.environ.get("QUANTSHIP_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "quantship"


def load_split(size: int = IMAGE_SIZE) -> DigitsSplit:
    """The fixed split of scikit-learn's digits, upsampled to ``size`` x ``size``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # values 0..16
    labels = torch.tensor(data.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(
        list(range(len(labels))), test_size=N_HELD_OUT, random_state=0, stratify=data.target
    )
    images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    images = (images - 0.5) / 0.5
    it, ie = torch.tensor(idx_train), torch.tensor(idx_test)
    return DigitsSplit(images[it], labels[it], images[ie], labels[ie])


# The harder variant: fewer, narrower channels, fewer training images, and Gaussian pixel noise on
# every image (train and held-out, fixed seed). FP32 lands near 90%, so an accuracy drop after
# quantization is measurable; the accuracy-aware search is shown on it.
NOISY_SIGMA = 0.35
NOISY_TRAIN = 1000
NOISY_WIDTH = 8
_NOISY_CACHE_VERSION = 2  # trained on one thread


def load_noisy_split(size: int = IMAGE_SIZE, sigma: float = NOISY_SIGMA, n_train: int = NOISY_TRAIN) -> DigitsSplit:
    """The fixed split with ``n_train`` training images and N(0, sigma) noise added to every pixel."""
    clean = load_split(size)
    gen = torch.Generator().manual_seed(1)
    x_train = clean.x_train[:n_train]
    x_train = x_train + sigma * torch.randn(x_train.shape, generator=gen)
    x_test = clean.x_test + sigma * torch.randn(clean.x_test.shape, generator=gen)
    return DigitsSplit(x_train, clean.y_train[:n_train], x_test, clean.y_test)


def noisy_trained_model(*, retrain: bool = False) -> TinyResNet:
    """The harder task's model (width 8), trained on ``load_noisy_split()`` and cached."""
    return cached_model(f"digits_noisy_w{NOISY_WIDTH}_v{_NOISY_CACHE_VERSION}.pt",
                        TinyResNet(in_channels=1, classes=10, width=NOISY_WIDTH),
                        lambda: train(load_noisy_split(), epochs=12, width=NOISY_WIDTH), retrain=retrain)


def build_model() -> TinyResNet:
    """The reference architecture: two residual additions, a Linear head, 10 classes."""
    return TinyResNet(in_channels=1, classes=10, width=16)


def train(split: DigitsSplit, epochs: int = 8, seed: int = 0, width: int = 16) -> TinyResNet:
    """Deterministic training on the training part of the split (a few seconds on 2 cores)."""
    torch.manual_seed(seed)
    model = TinyResNet(in_channels=1, classes=10, width=width)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=epochs * ((len(split.y_train) + 63) // 64))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(split.y_train), generator=gen)
        for start in range(0, len(order), 64):
            batch = order[start:start + 64]
            loss = F.cross_entropy(model(split.x_train[batch]), split.y_train[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


def trained_model(*, retrain: bool = False) -> TinyResNet:
    """The trained reference model, loaded from the cache or trained (and cached) on first use."""
    path = cache_dir() / f"digits_tinyresnet_v{_CACHE_VERSION}.pt"
    model = build_model()
    if path.exists() and not retrain:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()
    model = train(load_split())
    save_state(model, path)
    return model


def cached_model(name: str, model: torch.nn.Module, train_it, *, retrain: bool = False) -> torch.nn.Module:
    """``model`` with the weights cached under ``name`` in ``cache_dir()``, or ``train_it()``'s, trained on one
    thread (the same weights whatever the machine's core count) and cached, on first use or ``retrain``."""
    path = cache_dir() / name
    if path.exists() and not retrain:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = train_it()
    finally:
        torch.set_num_threads(threads)
    save_state(model, path)
    return model


def run_epochs(loss_of, opt: torch.optim.Optimizer, sched, n: int, epochs: int, seed: int, batch: int = 64) -> None:
    """``epochs`` passes over ``n`` samples in seeded random order, one optimizer and scheduler step per
    ``batch`` of indices (``loss_of(indices)`` gives the batch's loss)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, batch):
            loss = loss_of(order[start:start + batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()


def save_state(model: torch.nn.Module, path: Path) -> None:
    """``model``'s state dict at ``path``, written whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(model.state_dict(), tmp)
    tmp.replace(path)


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int | None = None) -> tuple[int, int]:
    """Correct predictions and n. ``batch_size`` splits the inputs (e.g. a captured batch size);
    a remainder that does not fill a batch is left out and not counted."""
    model.eval()
    n = len(y) if batch_size is None else (len(y) // batch_size) * batch_size
    step = batch_size or n
    correct = 0
    with torch.no_grad():
        for start in range(0, n, step):
            pred = model(x[start:start + step]).argmax(-1)
            correct += int((pred == y[start:start + step]).sum())
    return correct, n
