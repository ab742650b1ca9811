"""quantship's histogram range search gives torchao's HistogramObserver's range, bit for bit, in far less time."""

import pytest
import torch
from torchao.quantization.pt2e import HistogramObserver

from quantship.quantize.annotator import activation_observer
from quantship.quantize.histogram_search import _LOWER, _UPPER, HistogramSearchObserver


def _values(kind: str, g: torch.Generator) -> torch.Tensor:
    n = 200_000
    return {
        "normal": lambda: torch.randn(n, generator=g),
        "relu": lambda: torch.relu(torch.randn(n, generator=g)),
        "heavy tail": lambda: torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4,
        "outlier": lambda: torch.cat([torch.randn(n, generator=g), torch.tensor([40.0])]),
        "softmax": lambda: torch.softmax(torch.randn(2000, 100, generator=g) * 5, -1).flatten(),
        "constant": lambda: torch.full((n,), 0.5),
        # the slow cases of torchao's loop (every one of its 100,001 steps runs): a few discrete values
        "two values": lambda: (torch.rand(n, generator=g) > 0.5).float(),
        "attention mask": lambda: torch.where(torch.rand(n, generator=g) > 0.9, -1e4, 0.0),
    }[kind]()


@pytest.mark.parametrize("kind", ["normal", "relu", "heavy tail", "outlier", "softmax", "constant", "two values",
                                  "attention mask"])
@pytest.mark.parametrize("qscheme", [torch.per_tensor_affine, torch.per_tensor_symmetric])
def test_the_same_range_and_qparams_as_torchao(kind, qscheme):
    g = torch.Generator().manual_seed(0)
    kwargs = dict(dtype=torch.int8, qscheme=qscheme, quant_min=-128, quant_max=127)
    theirs, ours = HistogramObserver(**kwargs), HistogramSearchObserver(**kwargs)
    for chunk in _values(kind, g).chunk(3):  # several batches: the histogram is re-binned as ranges grow
        theirs(chunk), ours(chunk)
    assert torch.equal(ours.histogram, theirs.histogram)
    for a, b in zip(ours._non_linear_param_search(), theirs._non_linear_param_search()):
        assert torch.equal(a, b)
    for a, b in zip(ours.calculate_qparams(), theirs.calculate_qparams()):
        assert torch.equal(a, b)


def test_the_quantile_bounds_are_the_loops_own_sums():
    lower, upper = 0.0, 1.0
    for k in range(1, len(_LOWER)):
        lower, upper = lower + 1e-5, upper - 1e-5
        assert (lower, upper) == (_LOWER[k], _UPPER[k]), k


def test_histogram_is_the_fast_search():
    assert activation_observer("histogram") is HistogramSearchObserver
