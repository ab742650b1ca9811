"""The precision grammar: resolution, the support matrix, and the refusals (pinned by message)."""

import re

import pytest

from quantship import Quantizer, QuantSpec, precision_table, quant_spec
from quantship.precision import BACKENDS, SUPPORT_MATRIX, resolve_spec, tag_model


def test_explicit_default_equals_default():
    explicit = Quantizer(backend="pt2e", weight_bits=8, act_bits=8, qscheme="per_channel", symmetric=True).spec
    default = Quantizer(backend="pt2e").spec
    assert explicit == default
    assert hash(explicit) == hash(default)
    assert default.label == "W8A8"
    assert default.exports is True
    assert default.qdq_placement == "per_op"
    assert default.act_observer == "histogram"


def test_as_dict_key_order_and_round_trip():
    spec = Quantizer(backend="pt2e").spec
    assert list(spec.as_dict())[:11] == [
        "backend", "method", "weight_bits", "act_bits", "qscheme", "symmetric", "group_size",
        "layer_bits", "qdq_placement", "skip_activations", "engine",
    ]
    assert QuantSpec.from_dict(spec.as_dict()) == spec
    fx = resolve_spec("x86", weight_bits={"fc": 16, "conv1": 8})
    assert fx.as_dict()["layer_bits"] == {"conv1": 8, "fc": 16}
    assert QuantSpec.from_json(fx.to_json()) == fx


def test_spec_is_frozen():
    spec = Quantizer().spec
    with pytest.raises(AttributeError):
        spec.backend = "x86"  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, label, exports",
    [
        (dict(backend="torchao", method="int8_weight_only"), "W8A16", True),
        (dict(backend="torchao", weight_bits=4, act_bits=16), "W4A16", True),
        (dict(backend="torchao", method="int4_weight_only"), "W4A16", True),
        (dict(backend="torchao", weight_bits=8, act_bits=8), "W8A8", False),
        (dict(backend="x86"), "W8A8", False),
        (dict(backend="qnnpack", method="dynamic"), "W8A8", False),
        (dict(backend="pt2e", qscheme="per_tensor", symmetric=False), "W8A8", True),
    ],
)
def test_labels_and_exports(kwargs, label, exports):
    spec = resolve_spec(**kwargs)
    assert spec.label == label
    assert spec.exports is exports


def test_widths_select_method_and_method_selects_widths():
    assert resolve_spec("torchao", weight_bits=4, act_bits=16).method == "int4_weight_only"
    assert resolve_spec("torchao", weight_bits=8, act_bits=8).method == "int8_dynamic"
    spec = resolve_spec("torchao", method="int4_weight_only")
    assert (spec.weight_bits, spec.act_bits, spec.qscheme, spec.group_size) == (4, 16, "per_group", 128)
    assert resolve_spec("torchao", method="int8_weight_only", qscheme="per_group", group_size=32).group_size == 32


def test_fx_engine_recorded_and_symmetric_false():
    for backend in ("x86", "fbgemm", "onednn", "qnnpack"):
        spec = resolve_spec(backend)
        assert spec.engine == backend
        assert spec.symmetric is False


def test_affine_pt2e_warns():
    with pytest.warns(UserWarning, match="non-zero zero-points"):
        Quantizer(backend="pt2e", symmetric=False)


def test_matrix_is_the_table():
    table = precision_table()
    lines = table.splitlines()
    assert len(lines) == 2 + len(SUPPORT_MATRIX)
    for backend in BACKENDS:
        assert f"`{backend}`" in table


def test_quant_spec_untagged_is_none_and_tagged_round_trips():
    class Thing:
        pass

    assert quant_spec(Thing()) is None
    spec = Quantizer().spec
    assert quant_spec(tag_model(Thing(), spec)) is spec


REFUSALS = [
    # (kwargs, regex the message must match)
    (dict(backend="x86", symmetric=True), r"backend='x86'.*symmetric=True.*'pt2e', 'torchao'"),
    (dict(backend="fbgemm", symmetric=True), r"backend='fbgemm'.*symmetric=True.*'pt2e'"),
    (dict(backend="onednn", symmetric=True), r"backend='onednn'.*affine"),
    (dict(backend="qnnpack", symmetric=True), r"backend='qnnpack'.*symmetric=True"),
    (dict(backend="nope"), r"backend='nope'.*valid backends: \['pt2e', 'x86'"),
    (dict(backend="XNNPACK"), r"backend='XNNPACK' is not a quantship backend"),
    (dict(weight_bits=4, act_bits=8), r"no backend runs W4A8"),
    (dict(backend="x86", weight_bits=4, act_bits=8), r"no backend runs W4A8"),
    (dict(weight_bits=2, act_bits=2), r"no backend runs W2A2"),
    (dict(weight_bits=16, act_bits=16), r"no backend runs W16A16"),
    (dict(backend="qnnpack", qscheme="per_channel"), r"backend='qnnpack'.*qscheme='per_channel'.*'x86'"),
    (dict(backend="pt2e", qscheme="per_group"), r"backend='pt2e'.*qscheme='per_group'.*'torchao' at W8A16"),
    (dict(backend="pt2e", qscheme="per_row"), r"qscheme='per_row' is unknown"),
    (dict(backend="pt2e", method="dynamic"), r"method='dynamic'.*backend='pt2e'.*'x86'"),
    (dict(backend="pt2e", method="int8_weight_only"), r"method='int8_weight_only'.*'torchao'"),
    (dict(backend="torchao", method="static"), r"method='static'.*backend='torchao'.*Valid methods"),
    (dict(backend="x86", method="int4_weight_only"), r"method='int4_weight_only'.*'torchao'"),
    (dict(backend="pt2e", method="magic"), r"method='magic'.*No backend can honour it"),
    (dict(backend="pt2e", weight_bits={"fc": 8}), r"per-layer weight_bits dict.*'x86'"),
    (dict(backend="torchao", method="int4_weight_only", weight_bits={"fc": 4}), r"values are 8"),
    (dict(backend="x86", weight_bits={"fc": 4}), r"weight_bits dict entries \{'fc': 4\}"),
    (dict(backend="x86", weight_bits={}), r"weight_bits=\{\} is empty"),
    (dict(backend="torchao", symmetric=False), r"backend='torchao' W8A16.*symmetric=False.*'pt2e' at W8A8"),
    (dict(backend="torchao", method="int8_dynamic", symmetric=False), r"W8A8.*symmetric=False.*'pt2e', 'x86'"),
    (dict(backend="torchao", method="int4_weight_only", qscheme="per_channel"), r"No W4A16 backend.*'torchao' at W8A16"),
    (dict(backend="torchao", method="int8_dynamic", qscheme="per_tensor"), r"qscheme='per_tensor'.*'pt2e'"),
    (dict(backend="torchao", method="int4_weight_only", group_size=48), r"group_size=48.*power of two"),
    (dict(backend="torchao", method="int4_weight_only", group_size=0), r"group_size=0"),
    (dict(backend="pt2e", group_size=32), r"group_size=32 only applies to qscheme='per_group'.*'torchao'"),
    (dict(backend="x86", qdq_placement="skip_conv_add"), r"qdq_placement='skip_conv_add'.*'pt2e'"),
    (dict(backend="pt2e", qdq_placement="everywhere"), r"qdq_placement='everywhere' is unknown"),
    (dict(backend="x86", skip_activations=["fc"]), r"skip_activations=\['fc'\].*'pt2e'"),
    (dict(backend="pt2e", act_observer="kl"), r"act_observer='kl' is unknown"),
    (dict(backend="x86", act_observer="minmax"), r"act_observer='minmax'.*default observers.*'pt2e'"),
    (dict(backend="pt2e", weight_bits=8, act_bits=16), r"backend='pt2e' cannot run W8A16.*'torchao'"),
    (dict(backend="qnnpack", weight_bits=4, act_bits=16), r"backend='qnnpack' cannot run W4A16.*'torchao'"),
    (dict(backend="x86", reduce_range=True), r"backend='x86'.*reduce_range=True.*'pt2e'"),
    (dict(backend="torchao", method="int4_weight_only", reduce_range=True), r"reduce_range=True.*'pt2e' at W8A8"),
]


@pytest.mark.parametrize("kwargs, pattern", REFUSALS, ids=[str(k) for k, _ in REFUSALS])
def test_refusals(kwargs, pattern):
    with pytest.raises(ValueError) as info:
        Quantizer(**kwargs)
    assert re.search(pattern, str(info.value)), str(info.value)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(weight_bits="8"), r"weight_bits='8' must be an int"),
        (dict(act_bits=8.0), r"act_bits=8.0 must be an int"),
        (dict(symmetric="yes"), r"symmetric='yes' must be True or False"),
        (dict(skip_activations="layer4"), r"must be a list of module names"),
        (dict(reduce_range=1), r"reduce_range=1 must be True or False"),
    ],
)
def test_type_refusals(kwargs, pattern):
    with pytest.raises(TypeError, match=pattern):
        Quantizer(**kwargs)


def test_at_least_thirty_refusals_pinned():
    assert len(REFUSALS) >= 30


def test_quantizer_signature_lists_every_precision_keyword():
    """Quantizer forwards its precision keywords to resolve_spec; its visible signature still names them all."""
    import inspect

    from quantship import Quantizer, resolve_spec

    shown = inspect.signature(Quantizer).parameters
    for name in inspect.signature(resolve_spec).parameters:
        assert name in shown, name
    assert {"max_accuracy_drop", "verbose", "strict"} <= set(shown)
    with pytest.raises(TypeError, match="weight_bitz"):
        Quantizer(weight_bitz=8)


def test_one_algorithm_request_serves_every_entry_point(tmp_path):
    """``Algorithms`` is validated once, taken as ``algorithms=`` by both front-ends (the same file as the separate
    keywords), refused where a keyword says the same thing twice or the front-end cannot run a field."""
    import numpy as np
    import onnx

    from quantship import Algorithms, Quantizer, SpecRefused
    from quantship.quantize_onnx import quantize_onnx_file
    from tests.quantize_onnx import graphs

    for bad in ({"smooth_quant": 1.5}, {"adaround": 0}, {"observer": "nope"}, {"equalize": "yes"},
                {"exclude": "conv0"}):
        with pytest.raises(SpecRefused):
            Algorithms(**bad)
    asked = Algorithms(bias_correction=True, observer="minmax", exclude=["relu0"])
    assert asked.exclude == ("relu0",) and asked.asked() == {"bias_correction": True, "observer": "minmax",
                                                              "exclude": ("relu0",)}
    path = graphs.save(graphs.model(
        [onnx.helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
         onnx.helper.make_node("Relu", ["c0"], ["y"], name="relu0")],
        [graphs.value("x", ["n", 4, 8, 8])], [graphs.value("y", ["n", 8, 8, 8])], [graphs.weight(8, 4, 3, 3, name="w0")]),
        tmp_path / "f.onnx")
    x = np.random.default_rng(0).random((8, 4, 8, 8)).astype(np.float32)
    one = quantize_onnx_file(path, tmp_path / "a.onnx", x, target="onnxruntime-cpu", algorithms=asked, run_check=False)
    two = quantize_onnx_file(path, tmp_path / "b.onnx", x, target="onnxruntime-cpu", bias_correction=True,
                             observer="minmax", exclude=["relu0"], run_check=False)
    assert onnx.load(str(one.path)).graph == onnx.load(str(two.path)).graph
    untimed = [{k: v for k, v in r.algorithms["bias_correction"].items() if k != "seconds"} for r in (one, two)]
    assert untimed[0] == untimed[1] and one.excluded == two.excluded == ["relu0"]
    with pytest.raises(SpecRefused, match="given both"):
        quantize_onnx_file(path, tmp_path / "c.onnx", x, target="onnxruntime-cpu", algorithms=asked, observer="mse")
    assert Quantizer(algorithms=Algorithms(int16=("conv0",))).spec.int16 == ("conv0",)  # both front-ends run 16 bits
    q = Quantizer(algorithms=Algorithms(equalize=True, observer="minmax", exclude=("fc",)))
    assert q.spec.act_observer == "minmax" and list(q.spec.skip_activations) == ["fc"]
    preset = Quantizer.for_target("onnxruntime-cpu", algorithms=Algorithms(observer="percentile"))
    assert preset.spec.act_observer == "percentile" and preset.target == "onnxruntime-cpu"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx", "b.onnx", "f.onnx"]
