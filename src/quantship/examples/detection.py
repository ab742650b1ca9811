"""torchvision detectors as ONNX files: untrained, with score thresholds at 0 and a fixed number of detections,
exported with their post-processing (anchors, box decoding, top-k, NMS) as ONNX operators.

``build`` makes one of torchvision's detectors, ``tiny_ssd`` a torchvision ``SSD`` with a two-conv backbone
(the same post-processing, in seconds), ``export_float`` writes the float file the ONNX quantizer reads, and
``detections`` runs a file's session on images. Random weights: graph coverage, never accuracy.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

OUTPUTS = ("boxes", "scores", "labels")
DETECTIONS = 20  # detections kept per image (score threshold 0: an untrained model still returns boxes)
# candidates per class (SSD), per level (RetinaNet, FCOS) or proposals (Faster R-CNN's RPN) that reach NMS: with a
# score threshold of 0 every candidate does, and torchvision's defaults (SSD: 300 x 90 classes) put ~27,000 boxes
# into one NonMaxSuppression, seconds per image in ONNX Runtime whatever the backbone's precision
CANDIDATES = 20


def build(name: str, size: int = 320, detections: int = DETECTIONS) -> torch.nn.Module:
    """torchvision's ``name`` (``weights=None, weights_backbone=None``, seed 0) at ``size`` x ``size``."""
    import torchvision

    torch.manual_seed(0)
    kw: dict = {"weights": None, "weights_backbone": None}
    if name.startswith("ssd"):
        kw.update(score_thresh=0.0, detections_per_img=detections, topk_candidates=CANDIDATES)
    elif name.startswith("fasterrcnn"):
        kw.update(box_score_thresh=0.0, box_detections_per_img=detections, min_size=size, max_size=size,
                  rpn_pre_nms_top_n_test=5 * CANDIDATES, rpn_post_nms_top_n_test=CANDIDATES)
    else:
        kw.update(score_thresh=0.0, detections_per_img=detections, min_size=size, max_size=size,
                  topk_candidates=CANDIDATES)
    return torchvision.models.get_model(name, **kw).eval()


class _TinyBackbone(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, width, 3, 2, 1), torch.nn.BatchNorm2d(width),
                                        torch.nn.ReLU())
        self.down = torch.nn.Sequential(torch.nn.Conv2d(width, width, 3, 2, 1), torch.nn.BatchNorm2d(width),
                                        torch.nn.ReLU())

    def forward(self, x):
        first = self.stem(x)
        return OrderedDict([("0", first), ("1", self.down(first))])


def tiny_ssd(size: int = 64, num_classes: int = 4, width: int = 16, detections: int = DETECTIONS) -> torch.nn.Module:
    """A torchvision ``SSD`` on a two-conv backbone (two feature maps): torchvision's own anchors, box
    decoding, per-class top-k and batched NMS behind a few convolutions."""
    from torchvision.models.detection.anchor_utils import DefaultBoxGenerator
    from torchvision.models.detection.ssd import SSD, SSDHead

    torch.manual_seed(0)
    anchors = DefaultBoxGenerator([[2], [2]])
    head = SSDHead([width, width], anchors.num_anchors_per_location(), num_classes)
    return SSD(_TinyBackbone(width), anchors, (size, size), num_classes, head=head, score_thresh=0.0,
               detections_per_img=detections, topk_candidates=50).eval()


class Batched(torch.nn.Module):
    """A torchvision detector as a file takes it: an image batch in, the first image's (boxes, scores, labels) out."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images):
        found = self.model(list(images))[0]
        return found["boxes"], found["scores"], found["labels"]


class Scores(torch.nn.Module):
    """Every image's detection scores in one tensor (what bench/zoo.py's ``prepare_untrained`` reads)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images):
        return torch.cat([d["scores"] for d in self.model(list(images))])


def export_float(model: torch.nn.Module, size: int, path: str | Path) -> Path:
    """The float file: TorchScript exporter, opset 17, batch 1 at ``size`` x ``size``, outputs ``OUTPUTS``.
    The dynamo exporter cannot capture the data-dependent top-k / NMS (``GuardOnDataDependentSymNode``);
    the TorchScript one writes them as ``TopK`` and ``NonMaxSuppression`` (inside an ``If``)."""
    torch.onnx.export(Batched(model), (torch.rand(1, 3, size, size),), str(path), dynamo=False, opset_version=17,
                      input_names=["images"], output_names=list(OUTPUTS))
    return Path(path)


def detections(session, feeds: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(boxes, labels) of an ONNX Runtime session per image of ``feeds`` (each [1, 3, H, W])."""
    name = session.get_inputs()[0].name
    found = [dict(zip(OUTPUTS, session.run(list(OUTPUTS), {name: x}))) for x in feeds]
    return [(d["boxes"], d["labels"]) for d in found]
