"""pt2e with quantship's annotator on torch 2.14 / torchao 0.18."""

import pytest
import torch
import torch.nn as nn

from quantship import Quantizer, quant_spec
from tests.graph_counts import activation_zero_points, float_weighted_ops, op_counts, qd


def _assert_fully_int8(q, n_weighted):
    counts = op_counts(q)
    assert counts[qd.dequantize_per_channel.default] == n_weighted
    zps = activation_zero_points(q)
    assert zps and all(z == 0 for z in zps)
    assert float_weighted_ops(q) == []
    assert quant_spec(q).label == "W8A8"


@pytest.mark.slow
def test_resnet18_fully_quantized(resnet18_pt2e):
    # 20 convolutions + the fc layer, each with one weight scale per output channel
    _assert_fully_int8(resnet18_pt2e, 21)
    # every activation tensor between ops carries a pair (33 Q measured on torch 2.14)
    assert op_counts(resnet18_pt2e)[qd.quantize_per_tensor.default] == 33


@pytest.mark.slow
def test_resnet18_close_to_float(resnet18, resnet18_pt2e, resnet18_sample):
    with torch.no_grad():
        ref, out = resnet18(resnet18_sample), resnet18_pt2e(resnet18_sample)
    # untrained net: logits are tiny, so compare relative to their spread
    assert (out - ref).abs().max() < 0.2 * ref.abs().max() + 0.05


@pytest.mark.slow
def test_mobilenet_v2_fully_quantized(mobilenet_v2_pt2e):
    _assert_fully_int8(mobilenet_v2_pt2e, 53)  # 52 convolutions + the classifier


def test_small_residual_net(residual_net):
    calib = [torch.randn(4, 1, 8, 8) for _ in range(3)]
    before = {k: v.clone() for k, v in residual_net.state_dict().items()}
    q = Quantizer().quantize(residual_net, calib)
    _assert_fully_int8(q, 3)
    assert op_counts(q)[torch.ops.aten.add.Tensor] == 1
    # the input model is untouched: same class, same weights
    assert type(residual_net).__name__ == "ResidualNet"
    for k, v in residual_net.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert quant_spec(residual_net) is None


def test_input_model_keeps_its_mode_and_shares_no_tensor(residual_net):
    """Captured without a copy: the caller's train/eval flags come back, and no tensor stays shared."""
    residual_net.train()
    residual_net.head.eval()  # mixed flags are restored module by module
    with torch.no_grad():
        residual_net.stem[1].running_var.uniform_(0.5, 2.0)  # a BatchNorm that folding really changes
    before = {k: v.clone() for k, v in residual_net.state_dict().items()}
    q = Quantizer().quantize(residual_net, [torch.randn(4, 1, 8, 8) for _ in range(2)])
    assert residual_net.training and residual_net.stem.training and not residual_net.head.training
    for k, v in residual_net.state_dict().items():
        assert torch.equal(v, before[k]), k
    ours = {t.untyped_storage().data_ptr() for t in residual_net.state_dict().values()}
    theirs = [*q.state_dict().values(), *(v for v in vars(q).values() if isinstance(v, torch.Tensor))]
    assert theirs and not [t for t in theirs if t.numel() and t.untyped_storage().data_ptr() in ours]
    with torch.no_grad():  # training the float model afterwards leaves the quantized one as it was
        x = torch.randn(4, 1, 8, 8)
        out = q(x)
        residual_net.head.bias.add_(1.0)
        assert torch.equal(q(x), out)


class CountingNet(torch.nn.Module):
    """A forward that writes to a buffer: captured from a copy, so calibration cannot count."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.conv(x)


class ViewCountingNet(CountingNet):
    """The same write, through a view of the buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(2))

    def forward(self, x):
        self.calls[0].add_(1)
        return self.conv(x)


@pytest.mark.parametrize("net", [CountingNet, ViewCountingNet])
def test_a_forward_that_writes_buffers_leaves_the_input_untouched(net):
    model = net().eval()
    Quantizer().quantize(model, [torch.randn(2, 1, 8, 8) for _ in range(3)])
    assert model.calls.sum().item() == 0


def test_capture_reads_the_weights_in_place(residual_net):
    """No deep copy of the caller's weights: the captured graph reads the model's own tensors; a
    forward that writes a buffer is captured from a full copy (it shares nothing then)."""
    from quantship.quantize.pt2e import capture_untouched

    def storages(tensors):
        return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}

    captured = capture_untouched(residual_net, torch.randn(4, 1, 8, 8), log=lambda line: None)
    ours = storages([*residual_net.parameters(), *residual_net.buffers()])
    assert ours and ours <= storages(captured.graph.state_dict().values())
    counting = CountingNet().eval()
    copied = capture_untouched(counting, torch.randn(2, 1, 8, 8), log=lambda line: None)
    assert not storages(copied.graph.state_dict().values()) & storages(counting.state_dict().values())


class Stack(nn.Module):
    """Four Linear layers of 256 x 256 (1 MB of float weights, 256 KB each)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


def test_the_quantized_model_holds_no_float_weight_and_reads_each_where_it_is_used():
    """convert_pt2e writes each int8 weight as a new constant and left the float one registered (a 2 GB encoder's
    quantized model held 2 GB of float weights beside 0.5 GB of int8 ones), and it put every weight's
    dequantize at the top of the graph (a forward held every weight in float at once): the quantized model
    keeps only what its graph reads, and each dequantized weight is made right before the node that reads it."""
    model = Stack().eval()
    qmodel = Quantizer().quantize(model, [torch.randn(4, 256) for _ in range(3)])
    stored = [*qmodel.parameters(), *qmodel.buffers()]
    float_bytes = sum(t.numel() * t.element_size() for t in stored if t.dtype == torch.float32)
    int8_bytes = sum(t.numel() for t in stored if t.dtype == torch.int8)
    assert int8_bytes == 4 * 256 * 256 and float_bytes < 4 * 256 * 256  # biases and scales only: not 1 MB
    nodes = list(qmodel.graph.nodes)
    weights = [n for n in nodes if n.op == "call_function" and "dequantize_per_channel" in str(n.target)]
    assert len(weights) == 4
    for weight in weights:  # its reader follows it, with at most the stored tensors it reads between them
        reader = min(weight.users, key=nodes.index)
        assert all(n.op == "get_attr" for n in nodes[nodes.index(weight) + 1:nodes.index(reader)])
    x = torch.randn(2, 256)
    with torch.no_grad():
        assert torch.allclose(qmodel(x), model(x), atol=0.1)  # still the model


class PythonStateNet(torch.nn.Module):
    """A forward that changes Python attributes (a call count, a list of seen batch sizes)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.n_calls = 0
        self.seen = []

    def forward(self, x):
        self.n_calls += 1
        self.seen.append(x.shape[0])
        return self.conv(x)


def test_a_forward_that_changes_python_state_leaves_the_input_untouched():
    model = PythonStateNet().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = Quantizer().quantize(model, [torch.randn(2, 1, 8, 8) for _ in range(3)])
    assert model.n_calls == 0 and model.seen == [] and model.training and model.conv.training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert q(torch.randn(2, 1, 8, 8)).shape == (2, 2, 6, 6)


def test_per_tensor_has_no_per_channel(residual_net):
    q = Quantizer(qscheme="per_tensor").quantize(residual_net, [torch.randn(4, 1, 8, 8)])
    counts = op_counts(q)
    assert counts[qd.dequantize_per_channel.default] == 0
    assert float_weighted_ops(q) == []


def test_affine_has_nonzero_zero_points(residual_net):
    with pytest.warns(UserWarning, match="non-zero zero-points"):
        quantizer = Quantizer(symmetric=False)
    q = quantizer.quantize(residual_net, [torch.randn(4, 1, 8, 8) + 1.0])
    assert any(z != 0 for z in activation_zero_points(q))


def test_mixed_batch_sizes_accepted(residual_net):
    q = Quantizer().quantize(residual_net, [torch.randn(8, 1, 8, 8), torch.randn(6, 1, 8, 8)])
    assert q(torch.randn(6, 1, 8, 8)).shape == (6, 10)


def test_calibration_inputs_accepted(residual_net):
    from torch.utils.data import DataLoader, TensorDataset

    x, y = torch.randn(12, 1, 8, 8), torch.randint(0, 10, (12,))
    as_tuples = [(x[:4], y[:4]), (x[4:8], y[4:8])]
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    for data in (x[:4], as_tuples, loader):
        q = Quantizer().quantize(residual_net, data)
        assert quant_spec(q).label == "W8A8"


def test_max_calibration_samples_caps(monkeypatch, residual_net):
    from quantship.quantize.calibration import collect_batches

    batches = collect_batches([torch.randn(4, 1, 8, 8) for _ in range(10)], 9)
    assert len(batches) == 2
    with pytest.raises(ValueError, match="max_calibration_samples=2"):
        collect_batches([torch.randn(4, 1, 8, 8)], 2)


def test_calibration_refusals(residual_net):
    with pytest.raises(ValueError, match="calibration_dl is required"):
        Quantizer().quantize(residual_net)
    with pytest.raises(TypeError, match="calibration batch must be a tensor"):
        Quantizer().quantize(residual_net, ["not a tensor"])
    with pytest.raises(ValueError, match="yielded no batch"):
        Quantizer().quantize(residual_net, [])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        Quantizer().quantize("model.pt", [torch.randn(1)])


def test_qat_method_points_to_callback(residual_net):
    with pytest.raises(ValueError, match="QuantizeCallback"):
        Quantizer(method="qat").quantize(residual_net, [torch.randn(4, 1, 8, 8)])


def test_capture_failure_named():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent Python control flow: torch.export cannot trace it
                return self.fc(x)
            return -self.fc(x)

    with pytest.raises(ValueError, match="could not capture DataDependent with torch.export"):
        Quantizer().quantize(DataDependent().eval(), [torch.randn(2, 4)])


def test_no_weighted_layer_is_an_error():
    model = nn.Sequential(nn.ReLU(), nn.Flatten()).eval()
    with pytest.raises(ValueError, match="no integer weight"):
        Quantizer().quantize(model, [torch.randn(2, 4)])


def test_verbose_reports(residual_net, capsys):
    Quantizer(verbose=True).quantize(residual_net, [torch.randn(4, 1, 8, 8)])
    out = capsys.readouterr().out
    assert "capturing the model with torch.export (symbolic batch dimension)" in out
    assert "calibrating on 4 sample(s)" in out


def test_reduce_range_keeps_weights_within_63(residual_net):
    q = Quantizer(reduce_range=True).quantize(residual_net, [torch.randn(4, 1, 8, 8)])
    for node in q.graph.nodes:
        if node.op == "call_function" and node.target == qd.dequantize_per_channel.default:
            w = getattr(q, node.args[0].target)
            assert w.abs().max() <= 63 and node.args[4:6] == (-63, 63)
    assert quant_spec(q).reduce_range is True
