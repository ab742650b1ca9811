"""Detections of two runs matched one to one: how many of the reference's boxes the other run finds again.

A detector's quantized file is judged by its boxes, not its raw outputs: a reference detection is matched
by the unmatched detection of the other run with the same label and the largest IoU, if that IoU reaches
``MATCH_IOU``. The share matched and the largest coordinate difference among matched boxes are the
figures (bench/detection.py, ZOO-detection.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MATCH_IOU = 0.5


@dataclass(frozen=True)
class DetectionMatch:
    """Reference detections found again (same label, IoU >= ``iou``) and how far their corners moved."""

    n_reference: int
    n_matched: int
    n_other: int
    max_coordinate_diff: float | None  # pixels, over matched boxes (None: nothing matched)
    iou: float = MATCH_IOU
    median_coordinate_diff: float | None = None  # pixels, each matched box's largest corner difference

    @property
    def share(self) -> float | None:
        return self.n_matched / self.n_reference if self.n_reference else None

    def as_dict(self) -> dict:
        return {"n_reference": self.n_reference, "n_matched": self.n_matched, "n_other": self.n_other,
                "share": self.share, "max_coordinate_diff": self.max_coordinate_diff,
                "median_coordinate_diff": self.median_coordinate_diff, "iou": self.iou}


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of ``a`` [N, 4] with every box of ``b`` [M, 4], corners (x1, y1, x2, y2)."""
    a, b = np.asarray(a, np.float64).reshape(-1, 4), np.asarray(b, np.float64).reshape(-1, 4)
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    hi = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(hi - lo, 0, None).prod(-1)
    area_a = np.clip(a[:, 2:] - a[:, :2], 0, None).prod(-1)
    area_b = np.clip(b[:, 2:] - b[:, :2], 0, None).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def match_detections(reference: Sequence[tuple[np.ndarray, np.ndarray]], other: Sequence[tuple[np.ndarray, np.ndarray]],
                     iou: float = MATCH_IOU) -> DetectionMatch:
    """Match per image: ``reference`` and ``other`` list (boxes [N, 4], labels [N]) for the same images."""
    if len(reference) != len(other):
        raise ValueError(f"match_detections: {len(reference)} reference images but {len(other)} others; "
                         "pass the detections of the same images")
    n_ref = n_matched = n_other = 0
    diffs: list[float] = []
    for (ref_boxes, ref_labels), (boxes, labels) in zip(reference, other):
        ref_boxes, boxes = np.asarray(ref_boxes).reshape(-1, 4), np.asarray(boxes).reshape(-1, 4)
        ref_labels, labels = np.asarray(ref_labels).reshape(-1), np.asarray(labels).reshape(-1)
        n_ref, n_other = n_ref + len(ref_boxes), n_other + len(boxes)
        overlap = box_iou(ref_boxes, boxes)
        overlap[ref_labels[:, None] != labels[None, :]] = -1.0
        free = np.ones(len(boxes), dtype=bool)
        for k in range(len(ref_boxes)):
            candidates = np.where(free, overlap[k], -1.0)
            j = int(np.argmax(candidates)) if len(boxes) else -1
            if j < 0 or candidates[j] < iou:
                continue
            free[j] = False
            n_matched += 1
            diffs.append(float(np.abs(ref_boxes[k].astype(np.float64) - boxes[j].astype(np.float64)).max()))
    return DetectionMatch(n_ref, n_matched, n_other, max(diffs) if diffs else None, iou,
                          float(np.median(diffs)) if diffs else None)
