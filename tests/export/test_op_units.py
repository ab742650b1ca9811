"""The PyTorch path changes one op, not its whole module, where the module holds several (``LayerError.unit``,
``annotator.fused_head``): ``skip_activations`` and ``int16`` take an op of the captured graph by name beside
module names, the fidelity repair ranks and changes the smallest such unit, a float op that only magnifies a loss
made upstream (a log after a quantized filter bank) is charged to the op that made it, and the placement by
profile names an integer node by its op where its module holds other integer nodes.

``Pair``: one module holds two convolutions, a filter bank whose channels span 60 dB (its output, squared and
logged, collapses at 8 bits: the notes example's front-end, ``Collapsing``) and a plain one beside it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantship import Budget, Quantizer, export_qdq
from quantship.export import quantize_export_judged
from quantship.export.onnx_float import export_onnx
from quantship.export.placement import float_named_as
from quantship.inspect.read.facts import read_file
from quantship.inspect.read.float_ops import WHY_REQUESTED, float_ops
from quantship.quantize.accuracy import own_loss_order
from quantship.quantize.layer_error import layer_error
from quantship.targets import get
from tests.sixteen import INT16_KERNELS


class Block(nn.Module):
    def __init__(self, g: torch.Generator):
        super().__init__()
        self.bank = nn.Parameter(torch.randn(8, 3, 3, 3, generator=g) * torch.logspace(0, -3, 8).view(8, 1, 1, 1))
        self.plain = nn.Parameter(torch.zeros(8, 3, 3, 3))

    def forward(self, x):
        return F.conv2d(x, self.bank, padding=1), F.conv2d(x, self.plain, padding=1)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.block, self.head, self.side = Block(g), nn.Conv2d(8, 4, 1), nn.Conv2d(8, 4, 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(4, 8, 1, 1, generator=g))
            self.head.bias.copy_(torch.randn(4, generator=g) * 0.1)
            self.block.plain.copy_(torch.randn(8, 3, 3, 3, generator=g))
            self.side.weight.copy_(torch.randn(4, 8, 1, 1, generator=g))
            self.side.bias.zero_()

    def forward(self, x):
        y, z = self.block(x)
        return self.head(torch.log(y * y + 1e-12)).mean((2, 3)) + 0.01 * self.side(torch.relu(z)).mean((2, 3))


@pytest.fixture(scope="module")
def data():
    return torch.from_numpy(np.random.default_rng(0).standard_normal((40, 3, 16, 16)).astype(np.float32))


def _convs(model: nn.Module, data: torch.Tensor) -> tuple[str, str]:
    """The captured graph's names of the bank's and the plain convolution (graph order)."""
    rows = layer_error(model, Quantizer.for_target("onnxruntime-cpu").quantize(model, [data[:32]]), [data[:32]]).rows
    block = [r.unit for r in rows if r.module == "block" and r.op.startswith("conv")]
    return block[0], [r.unit for r in rows if r.module == "block"][-1]


def test_rows_are_named_by_op_inside_a_module_of_several_and_a_magnified_loss_by_its_maker(data):
    model = Pair().eval()
    rows = layer_error(model, Quantizer.for_target("onnxruntime-cpu").quantize(model, [data[:32]]), [data[:32]]).rows
    by_node = {r.node: r for r in rows}
    block = [r for r in rows if r.module == "block"]
    assert len(block) == 2 and len({r.unit for r in block}) == 2 and "block" not in {r.unit for r in block}
    assert all(r.unit == r.module for r in rows if r.module in ("head", "side"))  # one output each: the module
    log = by_node["log"]
    assert log.own_loss_db > 20 and log.unit == block[0].unit  # the log shows the bank's loss: the bank is charged
    assert block[1].node.startswith("relu") and block[1].unit != block[1].node  # a fused ReLU: its conv's name
    order = own_loss_order(model, Quantizer.for_target("onnxruntime-cpu").quantize(model, [data[:32]]), [data[:32]])
    assert order[0] == block[0].unit and order[-1] == "block"  # the ops first, then the modules holding them


def _repaired(model: nn.Module, data: torch.Tensor, path, target) -> object:
    """The repair of ``model`` held to 0.9 agreement (not argmax's default 0.96): the test is about which op the
    loop widens or keeps float, on class scores that are near-ties on random inputs."""
    return quantize_export_judged(model, [data[:32]], data[:1], path, target=target, overrides={}, held=[data[32:]],
                                  held_label="held", budget=Budget(min_agreement=0.9),
                                  make_quantizer=Quantizer.for_target, speed=False)


def test_the_repair_keeps_float_the_one_op_that_loses_the_signal_not_its_module(tmp_path, data):
    model = Pair().eval()
    bank, plain = _convs(model, data)
    judged = _repaired(model, data, tmp_path / "r.onnx", get("onnxruntime-cpu"))
    chosen = judged.repair.steps[judged.repair.chosen]
    assert judged.repair.steps[0].status == "missed" and chosen.status == "met"
    assert chosen.excluded == (bank,) and chosen.int16 == ()  # measured: -3.9 dB as asked
    assert [f.op for f in read_file(judged.path).float_compute] == [bank]  # the plain conv beside it stays integer


def test_the_repair_widens_the_one_op_that_loses_the_signal_not_its_module(tmp_path, data):
    model = Pair().eval()
    bank, plain = _convs(model, data)
    judged = _repaired(model, data, tmp_path / "r.onnx", INT16_KERNELS)  # a runtime with 16-bit kernels
    chosen = judged.repair.steps[judged.repair.chosen]
    assert chosen.int16 == (bank,) and chosen.excluded == () and chosen.status == "met"  # measured: 39.5 dB
    wide = set(judged.quantizer.report.int16_values)
    whole = Quantizer.for_target("onnxruntime-cpu", int16=["block"])
    whole.quantize(model, [data[:32]])
    plain_out = next(n for n in whole.report.int16_values if n.startswith("relu"))
    assert plain_out not in wide  # the plain conv's output stays 8 bits; the module named would widen it
    assert wide < set(whole.report.int16_values)


def test_an_op_named_in_skip_activations_is_float_alone_and_said_so(tmp_path, data):
    model = Pair().eval()
    bank, plain = _convs(model, data)
    q = Quantizer.for_target("onnxruntime-cpu", skip_activations=[bank])
    path = export_qdq(q.quantize(model, [data[:32]]), data[:2], tmp_path / "m.onnx", target="onnxruntime-cpu")
    facts = read_file(path)
    assert [f.op for f in facts.float_compute] == [bank]  # the plain conv beside it runs an integer kernel
    groups = float_ops(facts)["by_module"]
    assert [(g["module"], g["why"]) for g in groups] == [("block", WHY_REQUESTED)]
    with pytest.raises(ValueError, match=r"skip_activations names \['nosuch'\]: neither modules .* nor ops"):
        Quantizer.for_target("onnxruntime-cpu", skip_activations=["nosuch"]).quantize(model, [data[:32]])


def test_the_profile_names_an_integer_node_by_its_op_where_its_module_holds_others(tmp_path, data):
    model = Pair().eval()
    bank, plain = _convs(model, data)
    reference = onnx.load(str(export_onnx(model, data[:2], tmp_path / "float.onnx", optimize=False)))
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, [data[:32]])
    int8 = onnx.load(str(export_qdq(qmodel, data[:2], tmp_path / "int8.onnx", target="onnxruntime-cpu")))
    named = sorted(float_named_as(reference, int8).values())
    assert named == sorted([bank, plain, "head", "side"])  # each a name skip_activations takes for that node alone
