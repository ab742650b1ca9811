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
        # under TINY: searched scaled by a power of two, where torchao's float32 error does not underflow yet
        "small": lambda: torch.randn(n, generator=g) * 1e-7,
        # above HUGE: scaled too, where torchao's float32 error does not overflow yet (its cubes reach ~1e28)
        "large": lambda: torch.randn(n, generator=g) * 1e9,
    }[kind]()


@pytest.mark.parametrize("kind", ["normal", "relu", "heavy tail", "outlier", "softmax", "constant", "two values",
                                  "attention mask", "small", "large"])
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


# -140: subnormal float32 values, a factor beyond float32's range; 47: values near 1.4e14
@pytest.mark.parametrize("power", [-70, -140, 47])
def test_a_range_whose_error_underflows_or_overflows_is_searched_as_the_same_range_near_one(power):
    """Values near 2^-70 or 2^-140 (an untrained MobileViT's branches hold both): torchao's float32 error is
    0 at every step; near 2^47 (an untrained timm mobileone_s0's activations), inf or nan. Either way its
    search narrows the range bin by bin to about one bin; ours keeps what the search keeps at unit scale
    (at 2^-70 and 2^47, the unit-scale result scaled back, bit for bit; at 2^-140 the histogram of
    subnormal values is binned differently, so only the share kept is checked)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g)
    tiny = (x.double() * 2.0 ** power).float()
    kwargs = dict(dtype=torch.int8, qscheme=torch.per_tensor_affine, quant_min=-128, quant_max=127)
    unit, ours, theirs = (HistogramSearchObserver(**kwargs), HistogramSearchObserver(**kwargs),
                          HistogramObserver(**kwargs))
    unit(x), ours(tiny), theirs(tiny)
    kept = [(float(hi) - float(lo)) / (float(o.max_val) - float(o.min_val))
            for o, (lo, hi) in ((o, o._non_linear_param_search()) for o in (unit, ours, theirs))]
    assert kept[0] > 0.8 and kept[1] > 0.8  # measured 0.95 at unit scale, 0.95 at 2^-70, 0.84 at 2^-140
    assert kept[2] <= 2 / theirs.bins  # torchao's: collapsed to a bin or two
    if power in (-70, 47):
        for a, b in zip(ours._non_linear_param_search(), unit._non_linear_param_search()):
            assert torch.equal(a, (b.double() * 2.0 ** power).float())
    assert ours.min_val == theirs.min_val and ours.max_val == theirs.max_val  # the observer is left as it was


def test_the_range_search_is_a_marked_step():
    """Inside convert it can take minutes on a large model: a listener (the CLI, bench/zoo.py) hears it."""
    from quantship.progress import END, START, listening

    heard = []
    ours = HistogramSearchObserver(dtype=torch.int8, qscheme=torch.per_tensor_affine, quant_min=-128, quant_max=127)
    ours(torch.randn(1000, generator=torch.Generator().manual_seed(0)))
    with listening(lambda event, step: heard.append((event, step.label))):
        ours.calculate_qparams()
    assert heard == [(START, "quantize: histogram range search"), (END, "quantize: histogram range search")]
