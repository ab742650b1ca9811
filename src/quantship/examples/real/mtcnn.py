"""facenet-pytorch 2.6.0's MTCNN (PNet 12 x 12, RNet 24 x 24, ONet 48 x 48): PyTorch weights in the wheel.

Task: face / not-face on square crops of the photographs shipped in matplotlib and scikit-learn.
The face box of ``grace_hopper.jpg`` is found once by facenet-pytorch's own FP32 MTCNN; a crop is
a face when its IoU with that box is at least 0.65 and not a face below 0.3 (MTCNN's own
training convention), jittered in brightness, contrast, flips and noise. Crops are resized to
each net's input and normalised as facenet-pytorch does (``(x - 127.5) * 0.0078125``). The score
is each net's face probability argmax (its softmax output) against that label.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from quantship.examples.real import Count, data_dir, package_file, require, save_npz
from quantship.examples.real.photos import jitter, photo

MODULE = "facenet_pytorch"
NETS = {"pnet": 12, "rnet": 24, "onet": 48}
POSITIVE_IOU, NEGATIVE_IOU = 0.65, 0.3
_VERSION = 1


def load_net(name: str):
    """PNet/RNet/ONet with the wheel's weights (``facenet_pytorch/data/{name}.pt``), in eval mode."""
    package_file(MODULE, f"data/{name}.pt")
    from facenet_pytorch.models import mtcnn as nets

    return {"pnet": nets.PNet, "rnet": nets.RNet, "onet": nets.ONet}[name](pretrained=True).eval()


class FaceProbability:
    """A wrapper whose single output is the net's N x 2 softmax (face is column 1): one output to
    quantize, export and compare for every net."""

    def __new__(cls, net):
        import torch

        class _Face(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.net = inner

            def forward(self, x):
                return self.net(x)[-1].flatten(1)

        return _Face(net).eval()


@functools.cache
def face_box() -> tuple[float, float, float, float]:
    """grace_hopper.jpg's face, as facenet-pytorch's FP32 MTCNN finds it (x0, y0, x1, y1)."""
    require(MODULE)
    import torch
    from facenet_pytorch import MTCNN

    with torch.no_grad():
        boxes, _ = MTCNN(keep_all=True, device="cpu").detect(photo("grace_hopper"))
    if boxes is None or len(boxes) != 1:
        raise RuntimeError(f"facenet-pytorch's MTCNN found {0 if boxes is None else len(boxes)} faces in "
                           "grace_hopper.jpg (1 expected)")
    return tuple(float(v) for v in boxes[0])


def _iou(a, b) -> float:
    x0, y0, x1, y1 = max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x1 - x0) * max(0.0, y1 - y0)
    area = lambda r: (r[2] - r[0]) * (r[3] - r[1])  # noqa: E731
    return inter / (area(a) + area(b) - inter)


def _crop(rng: np.random.Generator, face: bool) -> tuple[str, tuple[int, int, int, int]]:
    box = face_box()
    side = max(box[2] - box[0], box[3] - box[1])
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    while True:
        if face:
            s = side * rng.uniform(0.8, 1.2)
            x0, y0 = cx + rng.uniform(-0.15, 0.15) * side - s / 2, cy + rng.uniform(-0.15, 0.15) * side - s / 2
            name = "grace_hopper"
        else:
            name = ("grace_hopper", "china", "flower")[int(rng.integers(0, 3))]
            h, w = photo(name).shape[:2]
            s = rng.uniform(24, min(h, w) * 0.8)
            x0, y0 = rng.uniform(0, w - s), rng.uniform(0, h - s)
        h, w = photo(name).shape[:2]
        crop = (int(x0), int(y0), int(x0 + s), int(y0 + s))
        if crop[0] < 0 or crop[1] < 0 or crop[2] > w or crop[3] > h:
            continue
        iou = _iou(crop, box) if name == "grace_hopper" else 0.0
        if (face and iou >= POSITIVE_IOU) or (not face and iou < NEGATIVE_IOU):
            return name, crop


@dataclass(frozen=True)
class Crops:
    """``x[net]``: N x 3 x S x S float32 normalised as facenet-pytorch does; ``y``: 1 face, 0 not."""

    x: dict[str, np.ndarray]
    y: np.ndarray


def make_crops(n: int, seed: int = 0) -> Crops:
    path = data_dir("mtcnn") / f"crops_v{_VERSION}_seed{seed}_n{n}.npz"
    if path.exists():
        with np.load(path) as f:
            return Crops({k: f[k] for k in NETS}, f["y"])
    from PIL import Image

    rng = np.random.default_rng([seed, 12])
    labels = rng.permutation(np.arange(n) % 2)
    xs: dict[str, list[np.ndarray]] = {k: [] for k in NETS}
    for label in labels:
        name, (x0, y0, x1, y1) = _crop(rng, bool(label))
        pixels = Image.fromarray(jitter(photo(name)[y0:y1, x0:x1], rng))
        for net, size in NETS.items():
            resized = np.asarray(pixels.resize((size, size), Image.BILINEAR), dtype=np.float32)
            xs[net].append(((resized - 127.5) * 0.0078125).transpose(2, 0, 1))
    crops = Crops({k: np.stack(v).astype(np.float32) for k, v in xs.items()}, labels.astype(np.int64))
    save_npz(path, y=crops.y, **crops.x)
    return crops


def accuracy(probabilities: np.ndarray, labels: np.ndarray) -> Count:
    return Count(int((np.asarray(probabilities).reshape(len(labels), -1).argmax(-1) == labels).sum()), int(len(labels)))


def agreement(probabilities: np.ndarray, reference: np.ndarray) -> Count:
    a = np.asarray(probabilities).reshape(len(reference), -1).argmax(-1)
    return Count(int((a == np.asarray(reference).reshape(len(reference), -1).argmax(-1)).sum()), int(len(a)))
