"""A small Linear model the weight-only tests (int4/int8, GPTQ) quantize and export."""

from __future__ import annotations

import torch.nn as nn


class MLP(nn.Module):
    """Two Linear layers around a GELU: 64 -> 96 -> 32 (every width a multiple of 32)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 96)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(96, 32)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))
