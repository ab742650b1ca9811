"""QuantizeCallback: QAT inside a fastai fit on the digits task (FX x86 and pt2e)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

pytest.importorskip("fastai", reason="QuantizeCallback needs the fastai extra")

from fastai.callback.core import Callback  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.torch_core import set_seed  # noqa: E402
from torch.nn import CrossEntropyLoss  # noqa: E402

from quantship import QuantizeCallback, Quantizer, quant_spec  # noqa: E402
from quantship.cli.common import format_accuracy  # noqa: E402
from quantship.examples import digits  # noqa: E402
from quantship.intervals import wilson_interval  # noqa: E402
from quantship.quantize.callback import loader_batch_sizes, qat_spec  # noqa: E402

BS = 60  # divides the 360 held-out images; the training loader drops its last batch
N_FINETUNE = 5 * BS


@pytest.fixture(scope="module")
def split():
    return digits.load_split()


def make_dls(split, bs: int = BS, n_train: int | None = None) -> DataLoaders:
    train = list(zip(split.x_train[:n_train], split.y_train[:n_train]))
    valid = list(zip(split.x_test, split.y_test))
    return DataLoaders.from_dsets(train, valid, bs=bs, device="cpu")


def make_learner(split, model, bs: int = BS, n_train: int | None = None) -> Learner:
    return Learner(make_dls(split, bs, n_train), model, loss_func=CrossEntropyLoss())


class StopHere(Exception):
    """Raised by a spy to end a fit right after before_fit (no training, no conversion)."""


class HyperSpy(Callback):
    """Records the optimizer's hypers and per-parameter flags at before_fit."""

    def __init__(self, order: int, stop: bool = False):
        super().__init__()
        self.order = order
        self.stop = stop
        self.hypers = None
        self.flags = None

    def before_fit(self):
        self.hypers = [dict(h) for h in self.learn.opt.hypers]
        self.flags = {id(p): dict(s) for p, s in self.learn.opt.state.items()}
        self.seen_opt = self.learn.opt
        self.opt_param_ids = {id(p) for group in self.learn.opt.param_lists for p in group}
        self.model_param_ids = {id(p) for p in self.learn.model.parameters()}
        if self.stop:
            raise StopHere("optimizer recorded")


@pytest.fixture(scope="module")
def fresh_process_lines():
    """One fresh interpreter (torch imported once for both tests below): first whether
    ``quantship.Quantizer`` pulled fastai in, then the error ``quantship.QuantizeCallback`` raises
    once fastai cannot be imported."""
    import subprocess

    code = (
        "import sys, quantship\n"
        "quantship.Quantizer\n"
        "print('fastai' in sys.modules)\n"
        "sys.modules['fastai'] = None; sys.modules['fastai.callback.core'] = None\n"
        "try:\n    quantship.QuantizeCallback\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()


def test_import_quantship_does_not_import_fastai(fresh_process_lines):
    assert fresh_process_lines[0] == "False"


def test_loader_batch_sizes(split):
    dls = make_dls(split, bs=64)
    assert loader_batch_sizes(dls.valid) == {64, 360 % 64}
    assert loader_batch_sizes(dls.train) == {64}  # fastai drops the last training batch
    dls.valid.drop_last = True
    assert loader_batch_sizes(dls.valid) == {64}


def test_qat_spec_from_quantizer():
    assert qat_spec(None, "x86").method == "qat"
    spec = qat_spec(Quantizer("pt2e", symmetric=True), "x86")
    assert (spec.backend, spec.method, spec.symmetric) == ("pt2e", "qat", True)
    with pytest.raises(ValueError, match="qat"):
        qat_spec(Quantizer("torchao", method="int8_dynamic"), "x86")
    with pytest.raises(ValueError, match="contradicts"):
        qat_spec(Quantizer("fbgemm"), "pt2e")


class FixedBatchDigits(torch.nn.Module):
    """The digits model with its batch size (64) baked into a reshape: torch.export must keep it static."""

    def __init__(self):
        super().__init__()
        self.net = digits.build_model()

    def forward(self, x):
        return self.net(x).reshape(64, 10)


def test_pt2e_refuses_uneven_batches_before_training_when_the_capture_is_static(split):
    seen = []

    class CountBatches(Callback):
        def before_batch(self):
            seen.append(1)

    learn = make_learner(split, FixedBatchDigits(), bs=64)  # 360 = 5 x 64 + 40
    with pytest.raises(ValueError) as info:
        with learn.no_logging():
            learn.fit(1, 1e-3, cbs=[QuantizeCallback(backend="pt2e"), CountBatches()])
    message = str(info.value)
    assert "static batch of 64" in message and "[40, 64]" in message and "drop_last" in message
    assert "test_callback.py:" in message and "reshape(64, 10)" in message  # the line that fixed the batch
    assert seen == []  # refused before the first batch


@pytest.mark.slow
def test_pt2e_qat_takes_a_shorter_last_batch_when_the_capture_is_symbolic(split):
    set_seed(0)
    learn = make_learner(split, digits.build_model(), bs=64, n_train=2 * 64)  # valid: 360 = 5 x 64 + 40
    assert loader_batch_sizes(learn.dls.valid) == {40, 64}
    with learn.no_logging():
        learn.fit(1, 1e-3, cbs=[QuantizeCallback(backend="pt2e")])
    model = learn.model
    assert quant_spec(model).method == "qat"
    for n in (1, 40, 64):
        assert model(split.x_test[:n]).shape == (n, 10)


@pytest.mark.parametrize("backend", ["x86", "pt2e"])
def test_optimizer_rebuild_keeps_lr_wd_and_flags(split, backend):
    torch.manual_seed(0)
    learn = make_learner(split, digits.build_model(), n_train=2 * BS)
    before, after = HyperSpy(order=-5), HyperSpy(order=5, stop=True)  # only the rebuild is under test
    with learn.no_logging(), pytest.raises(StopHere):
        learn.fit(1, lr=3e-3, wd=0.05, cbs=[before, QuantizeCallback(backend=backend), after])
    assert after.seen_opt is not before.seen_opt  # really rebuilt
    assert [h["lr"] for h in after.hypers] == [h["lr"] for h in before.hypers] == [3e-3]
    assert [h["wd"] for h in after.hypers] == [h["wd"] for h in before.hypers] == [0.05]
    assert after.hypers == before.hypers
    # the new optimizer holds exactly the prepared model's parameters
    assert after.opt_param_ids == after.model_param_ids
    # fastai's per-parameter flags (no weight decay on BatchNorm/bias) survive, parameter by parameter
    no_wd = {pid for pid, s in before.flags.items() if s.get("do_wd") is False}
    assert no_wd and no_wd == {pid for pid, s in after.flags.items() if s.get("do_wd") is False}


@pytest.mark.slow
def test_qat_fit_x86_and_pt2e_accuracy(split):
    base = digits.trained_model()
    results = {}
    for name, cbs in [("FP32", []), ("x86 QAT INT8", [QuantizeCallback(backend="x86")]),
                      ("pt2e QAT INT8", [QuantizeCallback(backend="pt2e")])]:
        set_seed(0)  # torch and Python's random (fastai's shuffling): seed-matched arms
        # fine-tune the trained model on 5 batches (a short fit keeps this test under a minute)
        learn = make_learner(split, copy.deepcopy(base), n_train=N_FINETUNE)
        with learn.no_logging():
            learn.fit(1, lr=1e-3, cbs=cbs)
        model = learn.model
        if cbs:
            spec = quant_spec(model)
            assert spec is not None and spec.method == "qat" and spec.backend == cbs[0].spec.backend
            assert spec.label == "W8A8"
            assert type(model).__name__ == "GraphModule"
            if spec.backend == "pt2e":
                # weights stored per channel (6 convs + head), activations per tensor: torchao's QAT
                # conv-bn fusion re-keys the annotation by position, so a swapped map shows up here
                targets = [str(n.target) for n in model.graph.nodes if n.op == "call_function"]
                assert sum("dequantize_per_channel" in t for t in targets) == 7
                assert not any(t.startswith("quantized_decomposed.quantize_per_channel") for t in targets)
        k, n = digits.evaluate(model, split.x_test, split.y_test, batch_size=BS)
        assert n == len(split.y_test)
        results[name] = (k, n)
        print(f"{name}: {format_accuracy(k, n)}")
    # a QAT model that lost the task would sit far below the float one: its interval must reach 0.9
    for name, (k, n) in results.items():
        assert wilson_interval(k, n)[1] > 0.9, name


def test_missing_fastai_names_the_extra(fresh_process_lines):
    assert "pip install 'quantship[fastai]'" in "\n".join(fresh_process_lines[1:])
