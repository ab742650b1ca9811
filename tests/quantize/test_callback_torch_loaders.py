"""QuantizeCallback with fastai DataLoaders built from plain torch DataLoaders (issue 16).

fastai's Learner accepts ``DataLoaders(torch_dl, torch_dl)``; such a loader has no ``one_batch``,
which the callback used to call. The test trains for a few steps and checks the result is a real
INT8 model that still predicts the digits.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastai", reason="QuantizeCallback needs the fastai extra")

from fastai.data.core import DataLoaders  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from torch.nn import CrossEntropyLoss  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from quantship import QuantizeCallback, quant_spec  # noqa: E402
from quantship.examples import digits  # noqa: E402

BS = 60


@pytest.mark.parametrize("backend", ["x86", "pt2e"])
def test_qat_on_plain_torch_loaders(backend):
    split = digits.load_split()
    torch.manual_seed(0)
    train = DataLoader(TensorDataset(split.x_train[:4 * BS], split.y_train[:4 * BS]), batch_size=BS,
                       shuffle=True, drop_last=True)
    valid = DataLoader(TensorDataset(split.x_test, split.y_test), batch_size=BS)
    learn = Learner(DataLoaders(train, valid), digits.trained_model(), loss_func=CrossEntropyLoss())
    with learn.no_logging():
        learn.fit(1, lr=1e-4, cbs=[QuantizeCallback(backend=backend)])
    spec = quant_spec(learn.model)
    assert spec is not None and spec.method == "qat" and spec.backend == backend
    correct, n = digits.evaluate(learn.model, split.x_test, split.y_test, batch_size=BS)
    assert n == 360 and correct / n > 0.9  # the trained reference scores ~0.99; a broken convert does not
