"""Small models whose forward returns a dict or a tuple; run as a script by tests/test_structured_outputs.py:

    python -m tests.fresh.structured ORDER OUT_DIR

ORDER is ``fp32-first`` (the float file of the dict model first, then quantize and the INT8 export: the
order in which the exporter's shared translation table once leaked) or ``alone`` (quantize and the
INT8 export only). The INT8 file goes to OUT_DIR/int8.onnx; its output names and per-output readings
are printed.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
import torch.nn as nn


class TwoHeads(nn.Module):
    """A conv body with a dense head (``out``: N x 4 x H x W) and a pooled classifier (``aux``: N x 5)."""

    def __init__(self, kind: str = "dict"):
        super().__init__()
        self.kind = kind
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.seg = nn.Conv2d(8, 4, 1)
        self.cls = nn.Linear(8, 5)

    def forward(self, x):
        f = self.body(x)
        out, aux = self.seg(f), self.cls(f.mean((2, 3)))
        if self.kind == "tuple":
            return out, aux
        if self.kind == "none":
            return out, None
        if self.kind == "nested":
            return {"seg": {"out": out}, "cls": [aux]}
        return collections.OrderedDict(out=out, aux=aux)


def two_heads(kind: str = "dict") -> tuple[nn.Module, list[torch.Tensor], torch.Tensor]:
    """(model, two calibration batches, a sample), all seeded."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = TwoHeads(kind).eval()
    return model, [torch.randn(2, 3, 12, 12, generator=g) for _ in range(2)], torch.randn(2, 3, 12, 12, generator=g)


def main(order: str, out: Path) -> None:
    import onnx

    from quantship import Quantizer, export_onnx, export_qdq

    # the class from the module by its name, not from __main__: the file records each node's module scope
    from tests.fresh.structured import two_heads as named_two_heads

    model, calibration, sample = named_two_heads("dict")
    if order == "fp32-first":
        export_onnx(model, sample, out / "fp32.onnx")
    elif order != "alone":
        raise SystemExit(f"unknown order {order!r}: fp32-first or alone")
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, calibration_dl=calibration)
    path = export_qdq(qmodel, sample, out / "int8.onnx", target="onnxruntime-cpu")
    print("names:", [o.name for o in onnx.load(str(path)).graph.output])
    print("per_output:", {name: r.literal_lsb for name, r in path.readings.per_output.items()})


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
