"""A recurrent audio task: which of ``N_CLASSES`` sound patterns a short clip holds, read by an LSTM.

Clips are synthesized here (8 kHz, 0.5 s), one pattern each, at a random pitch, timing and level, with
noise below it: rising and falling chirps, a steady tone, two beeps, a two-tone warble, a noise burst, a
tone with a vibrato, a chord. The labels are exact (the pattern that was synthesized). Features are log
mel energies computed with numpy (``N_MELS`` bands, ``N_FRAMES`` frames of 32 ms every 16 ms), so the
model reads N x N_FRAMES x N_MELS: one ``LSTM`` (``hidden`` units, batch first) and a ``Linear`` head
on its last hidden state. The task metric is top-1 accuracy on held-out clips.

Like ``notes``, the training is deterministic (fixed seeds, one thread, a few seconds) and the trained
weights are cached under ``cache_dir()``, one file per hidden size. ``write_files`` writes the float
ONNX file, calibration features and held-out features with their labels to a folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from quantship.examples.digits import cached_model, run_epochs
from quantship.export import export_onnx

SAMPLE_RATE = 8_000
CLIP_SAMPLES = 4_000  # 0.5 s
FRAME, HOP = 256, 128  # 32 ms windows every 16 ms
N_FRAMES = 1 + (CLIP_SAMPLES - FRAME) // HOP
N_MELS = 40
FLOOR = -12.0  # natural log: 52 dB under a clip's loudest band
CLASSES = ("rising chirp", "falling chirp", "steady tone", "two beeps", "warble", "noise burst", "vibrato", "chord")
N_CLASSES = len(CLASSES)
LEVEL_DB = (-40.0, 0.0)  # clip level, dB re full scale
SNR_DB = (15.0, 35.0)  # white noise below the clip level
HIDDEN = 128  # the default LSTM width (bench/recurrent.py tries others)
N_TRAIN, N_HELD_OUT, N_CALIBRATION = 2400, 1000, 64
_SEEDS = {"train": 21, "held_out": 22, "calibration": 23}
_CACHE_VERSION = 1


def _pattern(kind: int, t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One clip's pattern (before level and noise): a frequency track or a noise burst over ``t`` seconds."""
    f0 = rng.uniform(300.0, 1500.0)
    start, length = rng.uniform(0.0, 0.15), rng.uniform(0.25, 0.35)
    on = ((t >= start) & (t < start + length)).astype(np.float64)
    span = np.clip((t - start) / length, 0.0, 1.0)
    if kind == 0:
        track = f0 * 2.0 ** (1.5 * span)
    elif kind == 1:
        track = f0 * 2.0 ** (1.5 * (1.0 - span))
    elif kind in (2, 3, 7):
        track = np.full_like(t, f0)
        if kind == 3:
            on *= (span < 0.4) | (span > 0.6)  # a gap in the middle: two beeps
    elif kind == 4:
        track = f0 * np.where(np.sin(2 * np.pi * rng.uniform(6.0, 10.0) * t) > 0, 1.0, 1.5)
    elif kind == 6:
        track = f0 * 2.0 ** (0.3 * np.sin(2 * np.pi * rng.uniform(5.0, 8.0) * t))
    else:
        return on * rng.standard_normal(t.shape)  # kind 5: a noise burst
    phase = 2 * np.pi * np.cumsum(track) / SAMPLE_RATE + rng.uniform(0, 2 * np.pi)
    tone = np.sin(phase)
    if kind == 7:  # a major chord on f0
        tone = tone + np.sin(phase * 2 ** (4 / 12)) + np.sin(phase * 2 ** (7 / 12))
    return on * tone


def synthesize(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` clips N x CLIP_SAMPLES (float32, full scale 1.0) and their classes (int64), deterministic for a seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(CLIP_SAMPLES) / SAMPLE_RATE
    labels = rng.integers(0, N_CLASSES, n)
    clips = np.zeros((n, CLIP_SAMPLES), np.float64)
    for i, kind in enumerate(labels):
        x = _pattern(int(kind), t, rng)
        level = 10 ** (rng.uniform(*LEVEL_DB) / 20)
        x *= level / max(np.abs(x).max(), 1e-12)
        clips[i] = x + level * 10 ** (-rng.uniform(*SNR_DB) / 20) * rng.standard_normal(CLIP_SAMPLES)
    return clips.astype(np.float32), labels.astype(np.int64)


def mel_filters() -> np.ndarray:
    """Triangular mel filters (N_MELS x FRAME // 2 + 1) from 60 Hz to the Nyquist frequency."""
    def mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)

    edges = 700.0 * (10 ** (np.linspace(mel(60.0), mel(SAMPLE_RATE / 2), N_MELS + 2) / 2595.0) - 1.0)
    freqs = np.linspace(0, SAMPLE_RATE / 2, FRAME // 2 + 1)
    low, centre, high = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    return np.maximum(0.0, np.minimum((freqs - low) / (centre - low), (high - freqs) / (high - centre)))


def features(clips: np.ndarray) -> np.ndarray:
    """Log mel energies N x N_FRAMES x N_MELS (float32) of clips N x CLIP_SAMPLES, relative to each clip's
    largest, floored at ``FLOOR`` (the clip's level does not matter)."""
    index = np.arange(FRAME)[None, :] + HOP * np.arange(N_FRAMES)[:, None]
    frames = clips[:, index] * np.hanning(FRAME)
    power = np.abs(np.fft.rfft(frames, axis=-1)) ** 2
    logs = np.log(power @ mel_filters().T + 1e-10)
    return np.maximum(logs - logs.max(axis=(1, 2), keepdims=True), FLOOR).astype(np.float32)


@dataclass(frozen=True)
class Split:
    """Features N x N_FRAMES x N_MELS and labels N."""

    x: np.ndarray
    y: np.ndarray


def split(name: str, n: int) -> Split:
    clips, labels = synthesize(n, _SEEDS[name])
    return Split(features(clips), labels)


def held_out() -> Split:
    """The held-out clips (``N_HELD_OUT``), disjoint from training and calibration by seed."""
    return split("held_out", N_HELD_OUT)


def calibration() -> Split:
    return split("calibration", N_CALIBRATION)


class KeywordLSTM(nn.Module):
    """Normalised log mel frames -> LSTM -> Linear on the last hidden state: N x N_CLASSES logits."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.register_buffer("offset", torch.tensor(0.0))  # centres the log energies (training data)
        self.register_buffer("scale", torch.tensor(1.0))
        self.lstm = nn.LSTM(N_MELS, hidden, batch_first=True)
        self.head = nn.Linear(hidden, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm((x - self.offset) * self.scale)
        return self.head(out[:, -1])


def train(hidden: int = HIDDEN, epochs: int = 16, n_train: int = N_TRAIN, seed: int = 0) -> KeywordLSTM:
    """Deterministic training on ``n_train`` synthesized clips: a few seconds of one core at the defaults."""
    torch.manual_seed(seed)
    model = KeywordLSTM(hidden)
    data = split("train", n_train)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    model.offset.fill_(float(x.mean()))
    model.scale.fill_(1.0 / float(x.std()))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=epochs * ((n_train + 63) // 64))
    model.train()
    run_epochs(lambda batch: F.cross_entropy(model(x[batch]), y[batch]), opt, sched, n_train, epochs, seed)
    return model.eval()


def trained_model(hidden: int = HIDDEN, *, retrain: bool = False) -> KeywordLSTM:
    """The trained model, loaded from the cache or trained (one thread, then cached) on first use."""
    return cached_model(f"keywords_lstm{hidden}_v{_CACHE_VERSION}.pt", KeywordLSTM(hidden), lambda: train(hidden),
                        retrain=retrain)


@dataclass(frozen=True)
class KeywordFiles:
    """What ``write_files`` wrote: the float ONNX file, calibration features (.npy), held-out features (.npz, x, y)."""

    float_onnx: Path
    calibration: Path
    held_out: Path


def write_files(folder: str | Path, hidden: int = HIDDEN) -> KeywordFiles:
    """Export the trained model to ``folder/keywords_lstm{hidden}.onnx`` (``export_onnx``), with calibration and
    held-out features beside it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = KeywordFiles(folder / f"keywords_lstm{hidden}.onnx", folder / "keywords_calib.npy",
                         folder / "keywords_held_out.npz")
    calib, test = calibration(), held_out()
    export_onnx(trained_model(hidden), torch.from_numpy(calib.x[:8]), files.float_onnx)
    np.save(files.calibration, calib.x)
    np.savez(files.held_out, x=test.x, y=test.y)
    return files


def accuracy(logits: np.ndarray, labels: np.ndarray) -> tuple[int, int]:
    """Correct top-1 predictions and n."""
    return int((np.asarray(logits).argmax(-1) == np.asarray(labels)).sum()), len(labels)
