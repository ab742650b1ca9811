"""The fidelity repair's ranking on the PyTorch path (``own_loss_order``): each layer's own loss is its inputs'
SQNR less its output's, its inputs traced through the quantized graph to the layers that produced them.

Measured on the notes model (docs/fidelity.md): the six constant-Q octaves rank first, where the accumulated
ranking (the accuracy search's) ranks the CNN after the log first.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from quantship import Quantizer
from quantship.quantize.accuracy import own_loss_order, sensitivity_order
from quantship.quantize.layer_error import layer_error


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.front = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 8, 3, padding=1)
        with torch.no_grad():
            self.front.weight.copy_(torch.randn(8, 3, 3, 3, generator=g) * torch.logspace(0, -4, 8).view(8, 1, 1, 1))
            self.front.bias.zero_()
            self.head.weight.copy_(torch.randn(8, 8, 3, 3, generator=g) * torch.logspace(0, 4, 8).view(1, 8, 1, 1))

    def forward(self, x):
        return self.head(self.front(x))


def test_each_layer_reads_the_sqnr_of_the_layer_before_it_and_the_order_follows_its_own_loss():
    torch.manual_seed(0)
    model = Wide().eval()
    batches = [torch.randn(4, 3, 16, 16) for _ in range(4)]
    quantized = Quantizer.for_target("onnxruntime-cpu").quantize(model, batches)
    rows = {r.module: r for r in layer_error(model, quantized, batches).rows if r.module}
    assert rows["front"].upstream_db == float("inf")  # it reads the graph input only
    assert rows["head"].upstream_db == rows["front"].sqnr_db  # traced through dequantize/quantize
    assert rows["front"].own_loss_db == 60.0 - rows["front"].sqnr_db
    assert rows["head"].own_loss_db == rows["front"].sqnr_db - rows["head"].sqnr_db
    expected = sorted((r for r in rows.values() if r.own_loss_db > 0), key=lambda r: -r.own_loss_db)
    assert own_loss_order(model, quantized, batches) == [r.module for r in expected]
    assert set(sensitivity_order(model, quantized, batches)) == set(rows)
