"""Shared fixtures: small models and quantized ResNet-18 built once per session."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

warnings.filterwarnings("ignore", message=".*torch.ao.quantization.*deprecated.*")


class ResidualNet(nn.Module):
    """A small CNN with a residual add and a Linear head (8x8 or larger inputs, 1 channel)."""

    def __init__(self, channels: int = 8, classes: int = 10, in_channels: int = 1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.branch = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels))
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        y = self.stem(x)
        y = self.relu(self.branch(y) + y)
        return self.head(torch.flatten(self.pool(y), 1))


@pytest.fixture
def residual_net():
    torch.manual_seed(0)
    return ResidualNet().eval()


@pytest.fixture(scope="session")
def resnet18():
    from torchvision.models import resnet18 as build

    torch.manual_seed(0)
    return build(weights=None).eval()


@pytest.fixture(scope="session")
def resnet18_calib():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 3, 224, 224, generator=g) for _ in range(4)]


@pytest.fixture(scope="session")
def resnet18_sample():
    return torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="session")
def resnet18_pt2e(resnet18, resnet18_calib):
    from quantship import Quantizer

    return Quantizer(backend="pt2e").quantize(resnet18, resnet18_calib, max_calibration_samples=32)
