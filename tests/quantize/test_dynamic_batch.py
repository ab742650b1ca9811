"""pt2e capture with a symbolic batch: calibration batches of any size, and the guard named when a
model's code fixes the batch."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

from quantship import Quantizer
from quantship.export.capture import STATIC_BATCH_ATTRIBUTE as EXPORT_SIDE_ATTRIBUTE
from quantship.export.capture import static_batch_of
from quantship.quantize.calibration import collect_batches
from quantship.quantize.capture import STATIC_BATCH_ATTRIBUTE, capture


class FixedBatch(nn.Module):
    """A conv whose forward bakes the batch size 8 into a reshape."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.head(self.conv(x).reshape(8, -1))


def _reshape_line() -> int:
    lines, first = inspect.getsourcelines(FixedBatch.forward)
    return first + next(i for i, line in enumerate(lines) if "reshape(8" in line)


def test_both_sides_name_the_same_attribute():
    assert STATIC_BATCH_ATTRIBUTE == EXPORT_SIDE_ATTRIBUTE


def test_calibration_batches_of_8_8_5_and_any_batch_after(residual_net):
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, 1, 8, 8, generator=g) for n in (8, 8, 5)]
    q = Quantizer().quantize(residual_net, batches)
    assert static_batch_of(q) is None and getattr(q, STATIC_BATCH_ATTRIBUTE, None) is None
    for n in (1, 3, 16):
        assert q(torch.randn(n, 1, 8, 8)).shape == (n, 10)


def test_batch_one_calibration_still_gives_a_symbolic_graph(residual_net):
    q = Quantizer().quantize(residual_net, [torch.randn(1, 1, 8, 8)])
    assert static_batch_of(q) is None
    assert q(torch.randn(5, 1, 8, 8)).shape == (5, 10)


def test_a_guard_on_the_batch_falls_back_to_static_and_names_the_line():
    lines: list[str] = []
    captured = capture(FixedBatch().eval(), torch.randn(8, 1, 8, 8), log=lines.append)
    assert captured.static_batch == 8 and not captured.symbolic
    where = f"test_dynamic_batch.py:{_reshape_line()}"
    assert "Eq(" in captured.reason and where in captured.reason and "reshape(8, -1)" in captured.reason
    assert len(lines) == 1 and where in lines[0] and "static batch of 8" in lines[0]
    assert where in getattr(captured.graph, STATIC_BATCH_ATTRIBUTE)


def test_a_guard_on_the_batch_is_refused_when_dynamic_is_required():
    with pytest.raises(ValueError) as info:
        capture(FixedBatch().eval(), torch.randn(8, 1, 8, 8), batch="dynamic")
    message = str(info.value)
    assert "cannot keep the batch dimension of FixedBatch symbolic" in message
    assert f"test_dynamic_batch.py:{_reshape_line()}" in message and "--static-batch" in message


def test_static_capture_refuses_mixed_batch_sizes():
    with pytest.raises(ValueError) as info:
        Quantizer().quantize(FixedBatch().eval(), [torch.randn(8, 1, 8, 8), torch.randn(5, 1, 8, 8)])
    message = str(info.value)
    assert "sizes 8, 5" in message and "static batch of 8" in message and "drop_last" in message


def test_static_capture_with_one_batch_size_quantizes():
    q = Quantizer().quantize(FixedBatch().eval(), [torch.randn(8, 1, 8, 8)] * 2)
    assert static_batch_of(q) == 8
    assert f"test_dynamic_batch.py:{_reshape_line()}" in getattr(q, STATIC_BATCH_ATTRIBUTE)


def test_calibration_batches_are_made_contiguous():
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    view = torch.randn(4, 3, 8, 8).transpose(2, 3)
    for batch in collect_batches([x, (view, None)], 100):
        assert batch.is_contiguous()
    assert torch.equal(collect_batches([x], 100)[0], x)
