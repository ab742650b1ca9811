"""Q/DQ placement, granularity and symmetry, counted on exported ONNX files.

A one-block-per-stage torchvision ResNet at 32x32 and MobileNetV2 at 96x96, with two calibration
batches: the graph's shape does not depend on the resolution, so the counts are the ones a 224x224
export has. ResNet-18 itself (8 of 8 additions cleared) is checked by docs/walkthrough_resnet18.py.
"""

from __future__ import annotations

import collections
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from quantship import Quantizer, export_qdq
from quantship.inspect.read.stats import qdq_stats
from quantship.quantize.annotator import module_path


# -- file-side helpers ----------------------------------------------------------------------------
def export_file(qmodel: torch.nn.Module, sample: torch.Tensor, path) -> str:
    """Write the quantized model as a QDQ ONNX file."""
    export_qdq(qmodel, sample, str(path))
    return str(path)


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
    return values


def count_file(path: str) -> dict[str, int]:
    """Q/DQ counts read off the file with onnx alone (the test's own, independent reading)."""
    model = onnx.load(path)
    consts = _constants(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    ops = collections.Counter(n.op_type for n in model.graph.node)
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    n_per_channel = sum(1 for n in qdq if n.op_type == "DequantizeLinear" and consts[n.input[1]].size > 1)
    n_nonzero = sum(1 for n in qdq if len(n.input) > 2 and np.any(consts[n.input[2]] != 0))
    n_conv_add = sum(
        1 for n in model.graph.node if n.op_type == "Add"
        for i in n.input if i in producer and producer[i].op_type == "Conv"
    )
    return {"n_quantize": ops["QuantizeLinear"], "n_dequantize": ops["DequantizeLinear"],
            "n_per_channel": n_per_channel, "n_nonzero_zero_point": n_nonzero,
            "n_unquantized_conv_add": n_conv_add, "n_add": ops["Add"]}


def stats(path: str) -> dict[str, int]:
    """The test's counts, cross-checked against quantship.inspect.qdq_stats."""
    mine = count_file(path)
    theirs = qdq_stats(path).as_dict()
    for key in ("n_quantize", "n_dequantize", "n_per_channel", "n_nonzero_zero_point", "n_unquantized_conv_add"):
        assert theirs[key] == mine[key], (key, theirs, mine)
    return mine


def quantize(model, calib, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Quantizer(backend="pt2e", **kwargs).quantize(model, calib)


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_calib():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, 32, 32, generator=g) for _ in range(2)]


@pytest.fixture(scope="module")
def per_op(small_resnet, small_calib, tmp_path_factory):
    q = quantize(small_resnet, small_calib)
    path = export_file(q, small_calib[0], tmp_path_factory.mktemp("per_op") / "per_op.onnx")
    return q, path, stats(path)


# -- skip_conv_add ------------------------------------------------------------------------------
@pytest.mark.slow
def test_skip_conv_add_resnet(small_resnet, small_resnet_counts, small_calib, per_op, tmp_path, capsys):
    n_add = small_resnet_counts["add"]  # every residual addition is fed by a single-user convolution
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = Quantizer(qdq_placement="skip_conv_add", verbose=True).quantize(small_resnet, small_calib)
    assert f"cleared {n_add} of {n_add} addition(s)" in capsys.readouterr().out
    skip = stats(export_file(q, small_calib[0], tmp_path / "skip.onnx"))
    base = per_op[2]
    assert base["n_unquantized_conv_add"] == 0
    assert skip["n_unquantized_conv_add"] == n_add
    assert base["n_quantize"] - skip["n_quantize"] == n_add
    assert base["n_dequantize"] - skip["n_dequantize"] == n_add
    # every convolution + fc carries per-channel weights either way
    assert skip["n_per_channel"] == base["n_per_channel"] == small_resnet_counts["conv"] + small_resnet_counts["linear"]
    assert skip["n_nonzero_zero_point"] == base["n_nonzero_zero_point"] == 0


@pytest.mark.slow
def test_skip_conv_add_mobilenet_v2(tmp_path, capsys):
    from torchvision.models import mobilenet_v2

    torch.manual_seed(0)
    model = mobilenet_v2(weights=None).eval()
    calib = [torch.randn(2, 3, 96, 96) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = Quantizer(qdq_placement="skip_conv_add", verbose=True).quantize(model, calib)
    # MobileNetV2 has 10 inverted-residual blocks with a skip connection (stride 1, same width)
    n_residual = sum(1 for m in model.modules() if getattr(m, "use_res_connect", False))
    assert n_residual == 10
    assert f"cleared {n_residual} of {n_residual} addition(s)" in capsys.readouterr().out
    counts = stats(export_file(q, calib[0], tmp_path / "mbv2_skip.onnx"))
    assert counts["n_add"] == n_residual
    assert counts["n_unquantized_conv_add"] == n_residual


def test_skip_conv_add_refused_without_residual_add():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 3)).eval()
    with pytest.raises(ValueError, match="qdq_placement='skip_conv_add'.*per_op"):
        quantize(model, [torch.randn(2, 1, 8, 8)], qdq_placement="skip_conv_add")


# -- skip_activations ---------------------------------------------------------------------------
def _quantized_producers(qmodel) -> dict[str, str]:
    """Converted graph: node name -> module path of every tensor a quantize op reads.

    The ONNX exporter renames tensors, so "which module" is read on the graph that was exported;
    the file then has to show the same number of pairs gone.
    """
    quantize_ops = {torch.ops.quantized_decomposed.quantize_per_tensor.default}
    return {n.args[0].name: module_path(n.args[0]) for n in qmodel.graph.nodes
            if n.op == "call_function" and n.target in quantize_ops}


def _is_under(path: str, name: str) -> bool:
    return path == name or path.startswith(name + ".")


@pytest.mark.slow
def test_skip_activations_layer4_only(small_resnet, small_resnet_counts, small_calib, per_op, tmp_path):
    q = quantize(small_resnet, small_calib, skip_activations=["layer4"])
    counts = stats(export_file(q, small_calib[0], tmp_path / "skip_layer4.onnx"))
    base_q, _, base = per_op
    before, after = _quantized_producers(base_q), _quantized_producers(q)

    removed = set(before) - set(after)
    assert removed and all(_is_under(before[n], "layer4") for n in removed), {n: before[n] for n in removed}
    assert set(after) <= set(before)  # nothing new quantized elsewhere
    # no tensor produced under layer4 is quantized, not even where the pooling outside reads it
    assert not [n for n, path in after.items() if _is_under(path, "layer4")]
    # the file shows exactly those pairs gone; layer4 weights stay per-channel int8
    assert base["n_quantize"] - counts["n_quantize"] == len(removed)
    assert base["n_dequantize"] - counts["n_dequantize"] == len(removed)
    assert counts["n_per_channel"] == base["n_per_channel"] == small_resnet_counts["conv"] + small_resnet_counts["linear"]


def test_skip_activations_bogus_name_refused(residual_net):
    with pytest.raises(ValueError, match="skip_activations.*'layer9'.*named_modules"):
        quantize(residual_net, [torch.randn(2, 1, 8, 8)], skip_activations=["layer9"])


# -- granularity and symmetry -------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits():
    from quantship.examples import digits

    return digits.trained_model(), digits.load_split()


def test_per_tensor_has_no_per_channel_in_file(digits, tmp_path):
    model, split = digits
    calib = [split.x_train[i:i + 32] for i in range(0, 128, 32)]
    q = quantize(model, calib, qscheme="per_tensor")
    counts = stats(export_file(q, calib[0], tmp_path / "per_tensor.onnx"))
    assert counts["n_per_channel"] == 0
    assert counts["n_dequantize"] > 0


def test_affine_zero_points_and_ort_parity(digits, tmp_path):
    import onnxruntime as ort

    from quantship.inspect.read.lsb import lsb_error, output_scales

    model, split = digits
    calib = [split.x_train[i:i + 32] for i in range(0, 128, 32)]
    with pytest.warns(UserWarning, match="symmetric=False"):
        quantizer = Quantizer(symmetric=False)
    q = quantizer.quantize(model, calib)
    path = export_file(q, calib[0], tmp_path / "affine.onnx")
    counts = stats(path)
    assert counts["n_nonzero_zero_point"] > 0

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    (scale,) = output_scales(path).values()
    assert scale is not None
    worst = 0.0
    for start in range(0, 128, 32):
        x = split.x_test[start:start + 32]
        with torch.no_grad():
            ref = q(x).numpy()
        worst = max(worst, lsb_error(ref, session.run(None, {name: x.numpy()})[0], scale).max_lsb)
    assert worst <= 2.0 + 1e-6
