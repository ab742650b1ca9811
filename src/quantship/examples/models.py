"""Small built-in models for demos and tests."""

from __future__ import annotations

import torch
import torch.nn as nn


class TinyResNet(nn.Module):
    """A compact CNN with two residual additions and a Linear head, for 1-channel images."""

    def __init__(self, in_channels: int = 1, classes: int = 10, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.block1 = _Block(width)
        self.down = nn.Sequential(nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(2 * width), nn.ReLU())
        self.block2 = _Block(2 * width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.down(self.block1(self.stem(x))))
        return self.head(torch.flatten(self.pool(x), 1))


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + x)
