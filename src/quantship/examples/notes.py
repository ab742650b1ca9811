"""An audio task of the kind 8-bit activations break: which notes sound in a short clip.

Clips are synthesized here (16 kHz, 0.5 s): one to three harmonic notes out of ``N_NOTES``, a clip
level anywhere in ``LEVEL_DB`` (a wide dynamic range), white noise below it. The labels are exact
(the notes that were synthesized). The model's first layers are a fixed constant-Q transform written
as ``Conv1d`` over the raw audio (one convolution per octave, cos/sin kernel pairs, the hop as the
stride), then power (re^2 + im^2) and ``log(1 + gain * power)`` (``log(power + eps)`` plus a constant);
a small trainable CNN reads that and gives one sigmoid per note. Per-tensor 8-bit activations keep the
loud bins and lose the quiet ones after the transform, and the log turns that into a collapse of the
task. The task metric is the fraction of clips whose note set is exactly right (``score``).

Like ``digits``, the training is deterministic (fixed seeds, one thread) and the trained weights are
cached under ``cache_dir()``. ``write_files`` writes the float ONNX file, calibration clips and
held-out clips with their labels to a folder, for tests and benches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

from quantship.examples.digits import cached_model, run_epochs
from quantship.export import export_onnx
from quantship.fidelity import output_sqnr_db  # noqa: F401  (notes.output_sqnr_db: what the note tests measure)
from quantship.inspect.run.consumers import ort_session

SAMPLE_RATE = 16_000
CLIP_SAMPLES = 8_000  # 0.5 s
HOP = 256  # 16 ms between frames: the stride of every constant-Q convolution
FMIN_MIDI = 36  # C2, 65.4 Hz: the lowest constant-Q bin
OCTAVES = 6  # C2 .. B7 (3.95 kHz)
BINS_PER_OCTAVE = 12
N_BINS = OCTAVES * BINS_PER_OCTAVE
FIRST_NOTE_MIDI = 48  # C3: the notes to find are C3 .. B4
N_NOTES = 24
LEVEL_DB = (-60.0, 0.0)  # clip level, dB re full scale
NOTE_SPREAD_DB = 6.0  # each note up to this much below the clip's loudest
SNR_DB = (20.0, 40.0)  # white noise below the clip level
# log compression log(1 + LOG_GAIN * power) = log(LOG_GAIN) + log(power + 1 / LOG_GAIN): the log of the power
# with a floor 120 dB under a full-scale sine's (librosa's default amin: 100 dB), written without a tiny constant (the exporter's
# optimizer, onnxscript's add_0 rule with abs_tol 1e-8, rewrites `x + 1e-10` as `x`, and log(0) is -inf)
LOG_GAIN = 1e12
N_TRAIN, N_HELD_OUT, N_CALIBRATION = 4000, 600, 64
THRESHOLD = 0.5  # a note is present when its sigmoid is above this
_SEEDS = {"train": 11, "held_out": 12, "calibration": 13}
_CACHE_VERSION = 1


@dataclass(frozen=True)
class Clips:
    """Raw audio N x 1 x CLIP_SAMPLES (float32, full scale 1.0) and its labels N x N_NOTES (0/1 float32)."""

    x: torch.Tensor
    y: torch.Tensor


def synthesize(n: int, seed: int) -> Clips:
    """``n`` clips of 1-3 simultaneous notes, deterministic for a seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(CLIP_SAMPLES) / SAMPLE_RATE
    x = np.zeros((n, CLIP_SAMPLES), np.float64)
    y = np.zeros((n, N_NOTES), np.float32)
    for i in range(n):
        notes = rng.choice(N_NOTES, size=rng.integers(1, 4), replace=False)
        y[i, notes] = 1.0
        for note in notes:
            f0 = 440.0 * 2.0 ** ((FIRST_NOTE_MIDI + note - 69 + rng.uniform(-0.15, 0.15)) / 12)
            envelope = np.minimum(t / 0.01, 1.0) * np.exp(-t * rng.uniform(0.0, 3.0))
            k = np.arange(1, rng.integers(3, 7) + 1)[:, None]  # partials
            amplitude = k ** -rng.uniform(0.5, 1.5, size=k.shape)
            tone = (amplitude * np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 2 * np.pi, size=k.shape))).sum(0)
            x[i] += 10 ** (-rng.uniform(0, NOTE_SPREAD_DB) / 20) * envelope * tone
        level = 10 ** (rng.uniform(*LEVEL_DB) / 20)
        x[i] *= level / np.abs(x[i]).max()
        x[i] += level * 10 ** (-rng.uniform(*SNR_DB) / 20) * rng.standard_normal(CLIP_SAMPLES)
    return Clips(torch.from_numpy(x.astype(np.float32)).unsqueeze(1), torch.from_numpy(y))


def held_out() -> Clips:
    """The held-out clips (``N_HELD_OUT``), disjoint from training and calibration by seed."""
    return synthesize(N_HELD_OUT, _SEEDS["held_out"])


def calibration() -> Clips:
    """Clips for range calibration (``N_CALIBRATION``), from their own seed."""
    return synthesize(N_CALIBRATION, _SEEDS["calibration"])


def cqt_kernels(octave: int) -> tuple[torch.Tensor, int]:
    """One octave's constant-Q kernels as a Conv1d weight (2 x BINS_PER_OCTAVE) x 1 x L: the cos kernels
    then the sin kernels, Hann-windowed and centred, each of the length its frequency needs (Q cycles),
    scaled so that a sine of amplitude A at a bin's frequency gives that bin a magnitude A."""
    q = 1.0 / (2 ** (1 / BINS_PER_OCTAVE) - 1)
    freqs = [440.0 * 2.0 ** ((FMIN_MIDI + octave * BINS_PER_OCTAVE + b - 69) / 12) for b in range(BINS_PER_OCTAVE)]
    length = 2 * (math.ceil(q * SAMPLE_RATE / freqs[0]) // 2) + 1  # odd: centred, same frame count per octave
    weight = torch.zeros(2 * BINS_PER_OCTAVE, 1, length, dtype=torch.float64)
    for b, f in enumerate(freqs):
        n = 2 * (math.ceil(q * SAMPLE_RATE / f) // 2) + 1
        window = torch.hann_window(n + 2, periodic=False, dtype=torch.float64)[1:-1]
        phase = 2 * math.pi * f / SAMPLE_RATE * (torch.arange(n, dtype=torch.float64) - n // 2)
        start = (length - n) // 2
        weight[b, 0, start:start + n] = 2 * window * torch.cos(phase) / window.sum()
        weight[BINS_PER_OCTAVE + b, 0, start:start + n] = 2 * window * torch.sin(phase) / window.sum()
    return weight.float(), length


class ConstantQ(nn.Module):
    """A fixed constant-Q transform: one strided Conv1d per octave, power, log compression.
    Output N x 1 x N_BINS x frames."""

    def __init__(self):
        super().__init__()
        self.octaves = nn.ModuleList()
        for octave in range(OCTAVES):
            weight, length = cqt_kernels(octave)
            conv = nn.Conv1d(1, 2 * BINS_PER_OCTAVE, length, stride=HOP, padding=length // 2, bias=False)
            conv.weight.data.copy_(weight)
            conv.weight.requires_grad_(False)
            self.octaves.append(conv)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        bins = []
        for conv in self.octaves:
            z = conv(audio)
            re, im = z[:, :BINS_PER_OCTAVE], z[:, BINS_PER_OCTAVE:]
            bins.append(re * re + im * im)
        power = torch.cat(bins, dim=1)
        return torch.log(1.0 + LOG_GAIN * power).unsqueeze(1)


class NoteNet(nn.Module):
    """The fixed constant-Q front-end, then a small CNN; one sigmoid per note (N x N_NOTES)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.cqt = ConstantQ()
        self.register_buffer("log_offset", torch.tensor(0.0))  # centres the log power (training data)
        self.register_buffer("log_scale", torch.tensor(1.0))
        self.cnn = nn.Sequential(
            nn.AvgPool2d((1, 4)),  # 64 ms frames
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        )
        self.head = nn.Linear(2 * width * N_BINS, N_NOTES)

    def features(self, audio: torch.Tensor) -> torch.Tensor:
        """The normalised log constant-Q power, N x 1 x N_BINS x frames (no trainable weight)."""
        return (self.cqt(audio) - self.log_offset) * self.log_scale

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """One logit per note from the features (the CNN, the mean over frames, the head)."""
        return self.head(torch.flatten(self.cnn(features).mean(dim=3), 1))

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(self.features(audio)))


def train(epochs: int = 10, n_train: int = N_TRAIN, seed: int = 0) -> NoteNet:
    """Deterministic training of the CNN on ``n_train`` synthesized clips (the front-end stays fixed):
    about 40 s of one core at the defaults."""
    torch.manual_seed(seed)
    model = NoteNet()
    clips = synthesize(n_train, _SEEDS["train"])
    with torch.no_grad():
        logs = model.cqt(clips.x)
        model.log_offset.fill_(float(logs.mean()))
        model.log_scale.fill_(1.0 / float(logs.std()))
        features = model.features(clips.x)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-3, total_steps=epochs * ((n_train + 63) // 64))
    model.train()
    run_epochs(lambda batch: F.binary_cross_entropy_with_logits(model.logits(features[batch]), clips.y[batch]),
               opt, sched, n_train, epochs, seed)
    return model.eval()


def trained_model(*, retrain: bool = False) -> NoteNet:
    """The trained model, loaded from the cache or trained (one thread, then cached) on first use."""
    return cached_model(f"notes_cqt_v{_CACHE_VERSION}.pt", NoteNet(), train, retrain=retrain)


@dataclass(frozen=True)
class NoteScore:
    """Thresholded sigmoids against the labels: labels right of all, and clips whose whole note set is right."""

    labels_correct: int
    n_labels: int
    clips_exact: int
    n_clips: int

    @property
    def label_accuracy(self) -> float:
        return self.labels_correct / self.n_labels

    @property
    def exact_accuracy(self) -> float:
        return self.clips_exact / self.n_clips

    def as_dict(self) -> dict:
        return {"labels_correct": self.labels_correct, "n_labels": self.n_labels, "clips_exact": self.clips_exact,
                "n_clips": self.n_clips, "label_accuracy": self.label_accuracy, "exact_accuracy": self.exact_accuracy}


def score(probabilities: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor) -> NoteScore:
    """The task metric of sigmoid outputs N x N_NOTES against 0/1 labels."""
    right = (np.asarray(probabilities) > THRESHOLD) == (np.asarray(labels) > 0.5)
    return NoteScore(int(right.sum()), right.size, int(right.all(axis=1).sum()), len(right))


def predict(model: nn.Module, audio: torch.Tensor, batch_size: int = 100) -> np.ndarray:
    """The model's sigmoid outputs for ``audio``, in batches."""
    model.eval()
    with torch.no_grad():
        return torch.cat([model(audio[i:i + batch_size]) for i in range(0, len(audio), batch_size)]).numpy()


def run_file(path: str | Path, audio: np.ndarray | torch.Tensor, *, optimized: bool = True,
             batch_size: int = 100) -> np.ndarray:
    """An ONNX file's sigmoid outputs for ``audio`` in ONNX Runtime on the CPU: with its default graph
    optimizations (what a deployment runs), or read literally (``optimized=False``); in batches of
    ``batch_size``, or of the file's batch size when it declares one."""
    session = ort_session(path, optimized=optimized)
    spec = session.get_inputs()[0]
    if isinstance(spec.shape[0], int):  # a file written for one batch size: the last batch padded, then cut
        batch_size = spec.shape[0]
    audio = np.asarray(audio, dtype=np.float32)
    n = len(audio)
    padded = np.concatenate([audio, np.zeros((-n % batch_size, *audio.shape[1:]), np.float32)])
    return np.concatenate([session.run(None, {spec.name: padded[i:i + batch_size]})[0]
                           for i in range(0, len(padded), batch_size)])[:n]


def front_end_nodes(path: str | Path) -> list[str]:
    """The names of the constant-Q convolutions in an ONNX file of this model (their weights are ``cqt.*``),
    what ``quantize-onnx --exclude`` takes to keep the front-end float."""
    graph = onnx.load(str(path), load_external_data=False).graph
    return [n.name for n in graph.node if n.op_type == "Conv" and n.input[1].startswith("cqt.")]


@dataclass(frozen=True)
class NotesFiles:
    """What ``write_files`` wrote: the float ONNX file, calibration clips (.npy) and held-out clips (.npz, x and y)."""

    float_onnx: Path
    calibration: Path
    held_out: Path


def write_files(folder: str | Path) -> NotesFiles:
    """Export the trained model to ``folder/notes_float.onnx`` (``export_onnx``), with ``notes_calib.npy``
    (N_CALIBRATION x 1 x CLIP_SAMPLES) and ``notes_held_out.npz`` (x, y) beside it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = NotesFiles(folder / "notes_float.onnx", folder / "notes_calib.npy", folder / "notes_held_out.npz")
    model = trained_model()
    calib, test = calibration(), held_out()
    export_onnx(model, calib.x[:8], files.float_onnx)
    np.save(files.calibration, calib.x.numpy())
    np.savez(files.held_out, x=test.x.numpy(), y=test.y.numpy())
    return files
