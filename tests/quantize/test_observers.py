"""Activation observers: each a real calibration method, each usable end to end."""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
from torchao.quantization.pt2e import MinMaxObserver

from quantship import Quantizer
from quantship.cli.common import format_accuracy
from quantship.quantize.observers import OBSERVERS, MSEObserver, PercentileObserver

QSCHEMES = [torch.per_tensor_symmetric, torch.per_tensor_affine]


def _observe(cls, x, qscheme, **kwargs):
    obs = cls(dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=qscheme, **kwargs)
    for part in x.chunk(4):  # several batches, as calibration does
        obs(part)
    return obs


def _fake_quant_mse(x, obs) -> float:
    scale, zero_point = obs.calculate_qparams()
    fq = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), -128, 127)
    return float(((fq - x) ** 2).mean())


@pytest.fixture(scope="module")
def heavy_tailed():
    # Student-t with 3 degrees of freedom: a bulk near 0 and rare values tens of times larger
    torch.manual_seed(0)
    return torch.distributions.StudentT(3.0).sample((50_000,))


@pytest.mark.parametrize("qscheme", QSCHEMES)
@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_outliers_give_smaller_scale_than_minmax(heavy_tailed, name, qscheme):
    minmax_scale = float(_observe(MinMaxObserver, heavy_tailed, qscheme).calculate_qparams()[0])
    scale = float(_observe(OBSERVERS[name], heavy_tailed, qscheme).calculate_qparams()[0])
    assert scale < 0.95 * minmax_scale


@pytest.mark.parametrize("qscheme", QSCHEMES)
def test_percentile_matches_numpy(heavy_tailed, qscheme):
    obs = _observe(PercentileObserver, heavy_tailed, qscheme)
    lo, hi = obs.clipping_range()
    values = heavy_tailed.numpy().astype(np.float64)
    bin_width = float(obs.max_val - obs.min_val) / obs.bins
    if qscheme == torch.per_tensor_symmetric:
        t = np.percentile(np.abs(values), 99.99)
        assert hi == pytest.approx(t, abs=2 * bin_width)
        assert lo == pytest.approx(-t, abs=2 * bin_width)
    else:
        assert lo == pytest.approx(np.percentile(values, 0.01), abs=2 * bin_width)
        assert hi == pytest.approx(np.percentile(values, 99.99), abs=2 * bin_width)


@pytest.mark.parametrize("qscheme", QSCHEMES)
def test_mse_lowers_quantization_error(heavy_tailed, qscheme):
    # the criterion it optimises, measured on the data itself rather than on its histogram
    minmax = _fake_quant_mse(heavy_tailed, _observe(MinMaxObserver, heavy_tailed, qscheme))
    mse = _fake_quant_mse(heavy_tailed, _observe(MSEObserver, heavy_tailed, qscheme))
    assert mse < 0.95 * minmax


@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_observer_copies_and_pickles(heavy_tailed, name):
    obs = _observe(OBSERVERS[name], heavy_tailed, torch.per_tensor_symmetric)
    expected = obs.calculate_qparams()
    for clone in (copy.deepcopy(obs), pickle.loads(pickle.dumps(obs))):
        got = clone.calculate_qparams()
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_relu_output_keeps_zero_point_range():
    # non-negative data (after a ReLU): affine puts the zero-point at quant_min, symmetric at 0
    torch.manual_seed(1)
    x = torch.randn(20_000).relu()
    for cls in OBSERVERS.values():
        assert int(_observe(cls, x, torch.per_tensor_affine).calculate_qparams()[1]) == -128
        assert int(_observe(cls, x, torch.per_tensor_symmetric).calculate_qparams()[1]) == 0


def test_bad_arguments_refused():
    with pytest.raises(ValueError, match="percentile=40"):
        PercentileObserver(dtype=torch.int8, qscheme=torch.per_tensor_symmetric, percentile=40)
    with pytest.raises(ValueError, match="n_candidates=1"):
        MSEObserver(dtype=torch.int8, qscheme=torch.per_tensor_symmetric, n_candidates=1)


# -- end to end on the reference task -----------------------------------------------------------
@pytest.fixture(scope="module")
def digits_runs():
    from quantship.examples import digits

    model, split = digits.trained_model(), digits.load_split()
    calib = [split.x_train[i:i + 32] for i in range(0, 128, 32)]
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("minmax", "histogram", "percentile", "mse"):
            q = Quantizer(backend="pt2e", act_observer=name).quantize(model, calib)
            runs[name] = (q, digits.evaluate(q, split.x_test, split.y_test, batch_size=32))
    return model, split, runs


def _activation_scales(q) -> list[float]:
    op = torch.ops.quantized_decomposed.quantize_per_tensor.default
    return [float(n.args[1]) for n in q.graph.nodes if n.op == "call_function" and n.target == op]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["histogram", "percentile", "mse"])
def test_observer_end_to_end_on_digits(digits_runs, name, capsys):
    from quantship.examples import digits

    model, split, runs = digits_runs
    fp_k, n = digits.evaluate(model, split.x_test, split.y_test, batch_size=32)
    q, (k, n_q) = runs[name]
    assert n_q == n
    with capsys.disabled():
        print(f"\n  digits FP32 {format_accuracy(fp_k, n)} | INT8 act_observer={name!r} {format_accuracy(k, n)}")
    assert k >= fp_k - 0.03 * n  # int8 within 3 points of float on 352 held-out images
    # the observer was really used: it never widens the observed range and narrows some of them
    minmax = _activation_scales(runs["minmax"][0])
    scales = _activation_scales(q)
    assert len(scales) == len(minmax)
    assert all(s <= m * (1 + 1e-4) for s, m in zip(scales, minmax))
    assert any(s < 0.99 * m for s, m in zip(scales, minmax))
