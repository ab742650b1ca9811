"""trace_divergence: the file's arithmetic, quantized tensor by quantized tensor, against the pt2e model.

The module below holds, at toy size, the patterns issue 12 suspected behind inception_v3's and
regnet_x_32gf's 10 and 6 LSB: branches joined by cat (one shared scale), average pooling with
count_include_pad and ceil_mode, max pooling with ceil_mode, a grouped convolution, a residual add,
a global pool and a Linear head. Read literally, the file must reproduce every quantized tensor of
the torch model from the same quantized inputs.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from quantship import Quantizer, export_qdq
from quantship.inspect.run.divergence import trace_divergence


class InceptionLike(nn.Module):
    def __init__(self, c: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.b1 = nn.Conv2d(c, 8, 1)
        self.b3 = nn.Sequential(nn.Conv2d(c, 16, 3, padding=1, groups=4), nn.ReLU())  # regnet-style groups
        self.bp = nn.Conv2d(c, 8, 1)
        self.mix = nn.Conv2d(32, 32, 3, padding=1, groups=8)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        y = self.stem(x)
        pooled = F.avg_pool2d(y, 3, stride=1, padding=1)  # count_include_pad=True, as in Inception
        y = torch.cat([F.relu(self.b1(y)), self.b3(y), F.relu(self.bp(pooled))], 1)
        y = F.max_pool2d(y, 3, stride=2, ceil_mode=True)
        y = F.relu(self.mix(y) + y)
        y = F.avg_pool2d(y, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = InceptionLike().eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(4, 3, 15, 15, generator=g) for _ in range(2)]
    sample = torch.randn(4, 3, 15, 15, generator=g)
    quantized = Quantizer.for_target("onnxruntime-cpu", act_observer="minmax").quantize(model, calib)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = export_qdq(quantized, sample, tmp_path_factory.mktemp("div") / "m.onnx", target="onnxruntime-cpu")
    return quantized, path, sample


def test_every_quantized_tensor_is_reproduced_by_the_file(exported):
    quantized, path, sample = exported
    report = trace_divergence(quantized, path, sample)
    n_q = sum(n.op_type == "QuantizeLinear" for n in onnx.load(str(path)).graph.node)
    assert len(report.rows) == n_q >= 10
    sources = {r.source for r in report.rows}
    assert any("cat" in s for s in sources) and any("avg_pool" in s for s in sources)
    # same arithmetic: at most a one-step flip on a rare float32 near-midpoint, never a pattern
    assert report.max_local <= 1
    assert report.n_local <= 2, report.table()
    assert max(r.propagated_max for r in report.rows) <= 2, report.table()


def _tampered(path, tmp_path, edit) -> tuple:
    model = onnx.load(str(path))
    node = edit(model)
    out = tmp_path / "tampered.onnx"
    onnx.save(model, str(out))
    return out, node


def test_a_wrong_pooling_mode_is_located_at_its_layer(exported, tmp_path):
    """count_include_pad flipped on the first AveragePool: the local error appears exactly where it is read."""
    quantized, path, sample = exported

    def flip_pad_mode(model):
        pool = next(n for n in model.graph.node if n.op_type == "AveragePool")
        attr = next((a for a in pool.attribute if a.name == "count_include_pad"), None)
        if attr is None:
            pool.attribute.append(onnx.helper.make_attribute("count_include_pad", 0))
        else:
            attr.i = 1 - attr.i
        return pool

    broken, pool = _tampered(path, tmp_path, flip_pad_mode)
    report = trace_divergence(quantized, broken, sample)
    first = report.first_local
    assert first is not None and first.source == pool.output[0]
    assert first.local_max > 1 and first.local_count > 10
    assert report.first_propagated.order == first.order


def test_a_file_from_another_model_is_refused(exported, tmp_path):
    quantized, path, sample = exported

    def rescale(model):
        q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear")
        init = next(t for t in model.graph.initializer if t.name == q.input[1])
        init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) * np.float32(2), init.name))
        return q

    other, _ = _tampered(path, tmp_path, rescale)
    with pytest.raises(ValueError, match="not exported from this model"):
        trace_divergence(quantized, other, sample)
    with pytest.raises(ValueError, match="GraphModule"):
        trace_divergence(torch.nn.Linear(2, 2), path, sample)
