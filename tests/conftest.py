"""Shared fixtures: small models, and the reference ResNet-18 quantized once per session.

ResNet-18 is quantized at 224x224 here (the reference figures) and by the ResNet-18 walk-through
(docs/); tests about graph shape use ``small_resnet``, torchvision's ResNet with one block per
stage, whose counts are read off its own modules.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

warnings.filterwarnings("ignore", message=".*torch.ao.quantization.*deprecated.*")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the 2 cores: one torch thread each (two each oversubscribe the cores, and
    # OpenMP threads spin waiting for the ones that are descheduled)
    torch.set_num_threads(1)

# `make test` runs the suite on two xdist workers. The files below share the session's quantized
# ResNet-18 and MobileNetV2, so they are one unit of work for one worker: each model is quantized
# once per run. Every other file is its own unit. A file that starts using those fixtures without
# being listed here stops the collection (the list cannot go stale silently).
SESSION_MODEL_FILES = frozenset({
    "tests/export/test_qdq_resnet18.py",
    "tests/inspect/test_file_facts.py",
    "tests/inspect/test_graph.py",
    "tests/inspect/test_rules.py",
    "tests/quantize/test_pt2e.py",
})
_SESSION_MODELS = {"resnet18_pt2e", "mobilenet_v2_pt2e"}
# Files whose tests each run child processes for tens of seconds and share nothing: each test is its own
# unit of work, so the two workers split them.
PER_TEST_FILES = frozenset({"tests/test_bench_smoke.py", "tests/test_fresh_process.py"})


# The longest units of work (seconds of test time on the 2-core machine, measured at the end of wave 2),
# handed out first so that the two workers finish together; the others follow in collection order.
# Only the order changes: a file missing here still runs, a bit later.
LONGEST_FIRST = (
    "tests/test_bench_smoke.py",  # 12 bench scripts in fresh processes: 515 s CPU at load 14, split per test
    "tests/test_fresh_process.py",  # ResNet-18 twice and three small models in fresh processes
    "tests/quantize/test_distributed.py",  # 68 s
    "session-models",  # 50 s
    "tests/test_docs.py",  # 49 s
    "tests/quantize/test_transformers.py",  # 47 s
    "tests/test_structured_outputs.py",  # ~90 s CPU (lraspp, DistilBERT QA, a child process), 380 s wall at load 12
    "tests/test_hf_decoders.py",  # GPT-2 and Llama small configs, ~45 s
    "tests/quantize/test_callback.py",  # 41 s
    "tests/cli/test_quantize_cli.py",  # 24 s
    "tests/quantize/test_placement.py",  # 22 s
    "tests/export/test_targets.py",  # 21 s
)


def _unit_of_work(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    if path in PER_TEST_FILES:
        return nodeid
    return "session-models" if path in SESSION_MODEL_FILES else path


def _rank_key(nodeid: str) -> str:
    unit = _unit_of_work(nodeid)
    return unit.split("::", 1)[0] if unit.split("::", 1)[0] in PER_TEST_FILES else unit


# Tests measured at 15 s or more on a slow machine join the slow tier (tests/slow_measured.txt): CI runs
# `make test`, and with them in it could not finish inside its 90 minutes there.
_MEASURED_SLOW = frozenset(line.split("\t", 1)[1].strip()
                           for line in (Path(__file__).parent / "slow_measured.txt").read_text().splitlines()
                           if line and not line.startswith("#"))


@pytest.hookimpl(tryfirst=True)  # before the -m selection reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in _MEASURED_SLOW:
            item.add_marker(pytest.mark.slow)
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if _SESSION_MODELS & set(getattr(item, "fixturenames", ())) and path not in SESSION_MODEL_FILES:
            raise pytest.UsageError(f"{path} uses a session-quantized model: add it to SESSION_MODEL_FILES in "
                                    "tests/conftest.py so that it shares their xdist worker")
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_rank_key(item.nodeid), len(rank)))  # stable: file order kept


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # plain `pytest` without the xdist plugin: nothing to schedule
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    class _SessionModelScheduling(LoadScopeScheduling):
        """xdist's per-scope scheduling, where the scope is the file, or the session-model group."""

        def _split_scope(self, nodeid: str) -> str:
            return _unit_of_work(nodeid)

    def pytest_xdist_make_scheduler(config, log):
        config.option.loadscopereorder = False  # hand units out in the collection order set above
        return _SessionModelScheduling(config, log)


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
def small_resnet():
    """torchvision's ResNet with one BasicBlock per stage (a ResNet-10): ResNet-18's layer kinds
    (stride-2 downsample convs, residual adds, max and average pooling, the fc head) at half the depth."""
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    return ResNet(BasicBlock, [1, 1, 1, 1]).eval()


@pytest.fixture(scope="session")
def small_resnet_counts(small_resnet):
    """Convolutions, Linear layers and residual additions of ``small_resnet``, counted on its modules."""
    from torchvision.models.resnet import BasicBlock

    counts = {"conv": sum(isinstance(m, nn.Conv2d) for m in small_resnet.modules()),
              "linear": sum(isinstance(m, nn.Linear) for m in small_resnet.modules()),
              "add": sum(isinstance(m, BasicBlock) for m in small_resnet.modules())}
    assert counts == {"conv": 12, "linear": 1, "add": 4}  # 1 stem + 4 x 2 + 3 downsample convs
    return counts


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


@pytest.fixture(scope="session")
def mobilenet_v2_pt2e():
    """Untrained torchvision MobileNetV2 (seed 0) quantized by pt2e with the defaults at 96x96, once per
    session; its batch is symbolic, so a file can be written from it at any batch."""
    from torchvision.models import mobilenet_v2

    from quantship import Quantizer

    torch.manual_seed(0)
    model = mobilenet_v2(weights=None).eval()
    calib = [torch.randn(2, 3, 96, 96) for _ in range(2)]
    return Quantizer().quantize(model, calib)
