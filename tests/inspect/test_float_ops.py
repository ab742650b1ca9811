"""The compute ops a file leaves in float, by the module path its node metadata records (issue 16).

One export of a small residual CNN with one block kept in float (``skip_activations=['block2']``),
written for onnxruntime-cpu at opset 17 so every export pass runs (metadata, opset lowering,
kernel_shape, the uint8 move): the two Convs of ``block2`` run in float (the first writes a float
result, the second reads it), named ``block2.conv1`` and ``block2.conv2`` from
``pkg.torch.onnx.name_scopes``. ONNX Runtime agrees: its optimized graph keeps exactly two float
Convs.
"""

from __future__ import annotations

import json

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from quantship.cli.main import main
from quantship.export.metadata import SOURCE_NODE_KEYS
from quantship.inspect.read.facts import read_file, read_model
from quantship.inspect.read.float_ops import (
    NAME_SCOPES_KEY,
    NAMED_BY_MODULE,
    NAMED_BY_NODE,
    UNRECORDED,
    WHY_INPUT,
    WHY_REQUESTED,
    WHY_RULE,
    WHY_WEIGHT,
    describe_float_ops,
    float_ops,
    module_path,
)
from quantship.inspect.read.graph import inspect_file
from quantship.inspect.read.stats import COMPUTE_OPS


def _node(scopes: str | None) -> onnx.NodeProto:
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="node_conv2d_1")
    if scopes is not None:
        node.metadata_props.add(key=NAME_SCOPES_KEY, value=scopes)
    return node


@pytest.mark.parametrize("scopes, expected", [
    ("['', 'block1', 'block1.conv1', 'conv2d_1']", "block1.conv1"),
    ("['', 'layer1', 'layer1.0', 'layer1.0.conv1', 'conv2d']", "layer1.0.conv1"),
    ("['', 'view']", ""),  # an op of the model's own forward
    (None, None), ("not a list", None), ("[1, 2]", None), ("[]", None), ("__import__('os')", None),
])
def test_module_path_from_name_scopes(scopes, expected):
    assert module_path(_node(scopes)) == expected


def _float_conv_file(with_scopes: bool) -> onnx.ModelProto:
    """A Conv reading the graph input directly (no DequantizeLinear), next to a quantized one."""
    conv = helper.make_node("Conv", ["x", "w"], ["y"], name="conv_a")
    q = helper.make_node("QuantizeLinear", ["y", "s", "z"], ["yq"], name="q")
    dq = helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["yd"], name="dq")
    dq_w = helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd"], name="dq_w")
    conv_b = helper.make_node("Conv", ["yd", "wd"], ["z_b"], name="conv_b")
    q_b = helper.make_node("QuantizeLinear", ["z_b", "s", "z"], ["zq"], name="q_b")
    dq_b = helper.make_node("DequantizeLinear", ["zq", "s", "z"], ["out"], name="dq_b")
    if with_scopes:
        conv.metadata_props.add(key=NAME_SCOPES_KEY, value="['', 'features', 'features.0', 'conv2d']")
    graph = helper.make_graph(
        [conv, q, dq, dq_w, conv_b, q_b, dq_b], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 1, 1], [1.0]),
         helper.make_tensor("wq", TensorProto.INT8, [1, 1, 1, 1], [10]),
         helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
         helper.make_tensor("z", TensorProto.INT8, [], [0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_file_without_module_metadata_is_named_by_node_and_says_so():
    report = float_ops(read_model(_float_conv_file(with_scopes=False)))
    assert report["named_by"] == NAMED_BY_NODE and report["n_float_compute_in_file"] == 1
    assert report["by_module"] == [{"module": "conv_a", "ops": ["Conv"], "nodes": ["conv_a"], "why": WHY_INPUT + UNRECORDED}]
    assert describe_float_ops(report).startswith("1 compute op(s): by node name (the file records no module names)")
    named = float_ops(read_model(_float_conv_file(with_scopes=True)), no_rule_modules=[])
    assert named["named_by"] == NAMED_BY_MODULE
    assert named["by_module"][0]["module"] == "features.0" and named["by_module"][0]["why"] == WHY_INPUT


def _float_weight_file(op_type: str, target: str | None) -> onnx.ModelProto:
    """A weighted op between a DequantizeLinear and a QuantizeLinear whose weight is a stored float tensor (what
    a float rule leaves), in a file that names ``target`` in its metadata (or no target)."""
    dq = helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq")
    op = helper.make_node(op_type, ["xd", "w"], ["y"], name="up")
    q = helper.make_node("QuantizeLinear", ["y", "s", "z"], ["out"], name="q")
    graph = helper.make_graph(
        [dq, op, q], "g", [helper.make_tensor_value_info("xq", TensorProto.INT8, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("out", TensorProto.INT8, None)],
        [helper.make_tensor("w", TensorProto.FLOAT, [2, 2, 1, 1], [1.0, 0.5, -0.5, 1.0]),
         helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]), helper.make_tensor("z", TensorProto.INT8, [], [0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    if target is not None:
        model.metadata_props.add(key="quantship.target", value=target)
    return model


def test_a_weighted_op_reading_a_float_weight_is_float_and_the_targets_rule_says_why():
    """Its activations are quantized, yet a runtime runs it with float weights: a float kernel. The report said
    'nothing (every compute op reads and writes INT8)' for ONNX Runtime's ConvTranspose kept float by its rule."""
    plain = float_ops(read_model(_float_weight_file("Conv", None)))
    assert plain["n_float_compute_in_file"] == 1 and plain["by_module"][0]["why"] == WHY_WEIGHT + UNRECORDED
    ruled = float_ops(read_model(_float_weight_file("ConvTranspose", "onnxruntime-cpu")))
    assert ruled["by_module"][0]["why"].startswith(WHY_RULE + ": ONNX Runtime 1.32's CPU QDQ fusion leaves")
    other = float_ops(read_model(_float_weight_file("ConvTranspose", "tigris")))  # TiGrIS has no such rule
    assert other["by_module"][0]["why"] == WHY_WEIGHT + UNRECORDED


class _Block(torch.nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1)
        self.relu = torch.nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv2(self.relu(self.conv1(x))) + x)


class _Net(torch.nn.Module):
    def __init__(self, c: int = 4):
        super().__init__()
        self.stem = torch.nn.Conv2d(1, c, 3, padding=1)
        self.block1, self.block2 = _Block(c), _Block(c)
        self.head = torch.nn.Linear(c, 3)

    def forward(self, x):
        y = self.block2(self.block1(torch.relu(self.stem(x))))
        return self.head(y.mean((2, 3)))


@pytest.fixture(scope="module")
def kept_float_run(tmp_path_factory):
    """The file, and the steps the run marked for a progress display (``quantship.progress``)."""
    from quantship import Quantizer
    from quantship.export import export_qdq
    from quantship.progress import END, listening

    torch.manual_seed(0)
    model = _Net().eval()
    batches = [torch.randn(4, 1, 8, 8) for _ in range(2)]
    path = tmp_path_factory.mktemp("floatops") / "m.onnx"
    ended: list[str] = []
    with listening(lambda event, step: ended.append(step.label) if event == END else None):
        qmodel = Quantizer.for_target("onnxruntime-cpu", skip_activations=["block2"]).quantize(model, batches)
        export_qdq(qmodel, batches[0], path, target="onnxruntime-cpu", opset_version=17)
    return path, ended, qmodel, batches[0]


@pytest.fixture(scope="module")
def kept_float_file(kept_float_run):
    return kept_float_run[0]


@pytest.mark.slow
def test_every_export_pass_keeps_the_module_scopes(kept_float_run):
    """The pass list run one pass at a time on the exporter's graph: after each, every compute node
    still carries its name_scopes (a pass that rebuilds a node must carry them over)."""
    import onnx_ir as ir

    from quantship import quant_spec
    from quantship.export import capture, qdq
    from quantship.export.checks import run_passes
    from quantship.precision import preset

    _, _, qmodel, sample = kept_float_run
    produced = qdq.produce(qmodel, sample, opset_version=17, dynamic_batch=True, input_names=None, output_names=None)
    ctx = qdq.ExportContext(spec=quant_spec(qmodel), opset_version=17, activation_dtype="uint8",
                            target=preset("onnxruntime-cpu"), inputs=capture.as_arrays(sample), produced=produced)
    model = ir.from_proto(produced)
    for make in qdq.PASSES:
        run_passes([make(ctx)], model)
        compute = [n for n in model.graph.all_nodes() if n.op_type in COMPUTE_OPS]
        assert len(compute) == 6, make.__name__
        missing = [n.name for n in compute if NAME_SCOPES_KEY not in n.metadata_props]
        assert not missing, f"{make.__name__} dropped the module scopes of {missing}"


@pytest.mark.slow
def test_quantize_and_export_mark_every_step(kept_float_run):
    """Each step that can take seconds is marked, in order; each export check is its own step."""
    ended = kept_float_run[1]
    assert ended == [
        "quantize: capture (torch.export)", "quantize: insert observers (prepare_pt2e)", "quantize: calibrating",
        "quantize: calibrating: histograms on the observed ranges",  # histogram observers: a second pass
        "quantize: convert (convert_pt2e)", "export: torch.onnx.export (dynamo)",
        "export check: lowering to opset 17", "export check: moving activations to uint8", "export: writing the file",
        "export check: the file holds the spec", "export check: onnxruntime-cpu rules",
        "export check: runs with ORT optimizations on", "export check: ORT readings vs torch",
    ]


@pytest.mark.slow
def test_export_keeps_module_scopes_and_drops_source_text(kept_float_file):
    """After every pass, each compute node still names its module; no node carries the exporting
    machine's stack trace or FX text."""
    model = onnx.load(str(kept_float_file))
    assert model.opset_import[0].version == 17 and any(n.op_type == "QuantizeLinear" for n in model.graph.node)
    compute = [n for n in model.graph.node if n.op_type in COMPUTE_OPS]
    assert len(compute) == 6  # stem, 2 x 2 block convs, head
    for node in compute:
        assert module_path(node) not in (None, ""), node.name
    for node in model.graph.node:
        assert not {p.key for p in node.metadata_props} & set(SOURCE_NODE_KEYS), node.name
    assert b"stack_trace" not in kept_float_file.read_bytes()


@pytest.mark.slow
def test_inspect_lists_the_float_op_by_module_as_quantize_does(kept_float_file, capsys):
    from quantship.export.torch_file import left_float as _left_float

    facts = read_file(kept_float_file)
    # block2.conv1 writes a float result (the ReLU after it is block2's), block2.conv2 reads it
    expected = [{"module": f"block2.conv{i + 1}", "ops": ["Conv"], "nodes": [facts.float_compute[i].node],
                 "why": WHY_REQUESTED} for i in range(2)]
    report = inspect_file(facts).float_ops
    assert report["by_module"] == expected and report["n_float_compute_in_file"] == facts.stats.n_float_compute == 2
    # quantize builds its list from the same read of the file it wrote: the same entries and keys
    quantized = _left_float(type("Q", (), {"report": None})(), facts)
    assert quantized["by_module"] == expected and quantized["requested_but_int8"] == []
    assert main(["inspect", str(kept_float_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["float_ops"]["by_module"] == expected
    assert main(["inspect", str(kept_float_file)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "left in float" in out and "block2.conv1: Conv (kept float on request); block2.conv2: Conv" in out
    assert describe_float_ops(quantized) in out
    from quantship.inspect.run.consumers import ort_optimized_ops

    ran = ort_optimized_ops(kept_float_file)
    assert ran["QLinearConv"] == 3 and ran.get("Conv", 0) + ran.get("FusedConv", 0) == 2
