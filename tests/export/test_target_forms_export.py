"""The target's rewrites on the PyTorch path's file (``export.qdq.TargetFormsPass``, the ONNX path's
``target_forms`` reused): a hard sigmoid's Clip(0, 1) runs as TiGrIS's Relu6, PRelu is written out for
ONNX Runtime, each proven byte-identical on the sample."""

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from quantship import Quantizer, export_qdq
from quantship.export import target_forms
from quantship.inspect.judge.check import check_file
from quantship.targets import get as get_target


class GatedConv(torch.nn.Module):
    """Conv -> ReLU -> a squeeze-excite gate written as onnx2torch converts Paddle's HardSigmoid
    (``clamp(0.2 x + 0.5, 0, 1)``), then a second Conv."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.gate = torch.nn.Conv2d(8, 8, 1)
        self.conv2 = torch.nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        g = torch.clamp(0.2 * self.gate(y.mean((2, 3), keepdim=True)) + 0.5, 0.0, 1.0)
        return self.conv2(y * g)


class PReluNet(torch.nn.Module):
    """Conv -> PReLU on a tensor above ``PRELU_MIN_VALUES`` values per sample, as MTCNN's nets are."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.prelu = torch.nn.PReLU(16, init=0.25)
        self.conv2 = torch.nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.prelu(self.conv1(x)))


def _data(shape):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g) for _ in range(3)], torch.randn(*shape, generator=g)


def _clips(path) -> list[float]:
    model = onnx.load(str(path))
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return [float(init[n.input[2]].reshape(-1)[0]) for n in model.graph.node if n.op_type == "Clip"]


@pytest.mark.slow
def test_tigris_file_of_a_hard_sigmoid_model_is_written_and_accepted(tmp_path):
    torch.manual_seed(0)
    calib, sample = _data((2, 3, 16, 16))
    qmodel = Quantizer.for_target("tigris").quantize(GatedConv().eval(), calib)
    path = export_qdq(qmodel, sample, tmp_path / "tigris.onnx", target="tigris")  # refused before: Clip 0..1
    assert _clips(path) == [6.0]  # the gate's Clip(0, 1) now runs as Relu6
    report = check_file(path, "tigris")
    assert report.ok, [f.message for f in report.findings]
    assert path.readings.literal_lsb <= 3.0  # the file still reads as the torch model does


def test_tigris_reads_the_hard_sigmoid_as_onnx_runtime_reads_it(tmp_path):
    """The gate's Clip(0, 1) rewritten for TiGrIS's Relu6 keeps one scale per Q/DQ pair (a Mul by 6 into a pair at
    6x scale, a Mul by a sixth back): TiGrIS runs the file within 2 steps of its literal reading in ONNX Runtime.
    Read at 6x scale by the DequantizeLinear alone (a pair of two scales), TiGrIS took the QuantizeLinear's
    scale: 4 steps and 30.7 dB here on a steep gate, a gate 161 steps off in PP-OCRv4's detector."""
    from quantship.inspect.run.consumers import run_onnxruntime, run_tigris

    torch.manual_seed(0)
    calib, sample = _data((2, 3, 16, 16))
    net = GatedConv().eval()
    with torch.no_grad():
        net.gate.weight.mul_(8.0)  # a steep gate: most values clipped at 0 or 1
    path = export_qdq(Quantizer.for_target("tigris").quantize(net, calib), sample, tmp_path / "t.onnx", target="tigris")
    model = onnx.load(str(path))
    pairs = {n.input[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for q in (n for n in model.graph.node if n.op_type == "QuantizeLinear"):  # every pair: one scale
        if q.output[0] in pairs:
            assert np.array_equal(init[q.input[1]], init[pairs[q.output[0]].input[1]]), q.name
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)).numpy()
    feeds = [{model.graph.input[0].name: x[i:i + 1]} for i in range(8)]
    literal = np.concatenate([r[0] for r in run_onnxruntime(path, feeds, optimize=False)])
    tigris = np.concatenate([np.asarray(r[0]).reshape(literal[:1].shape) for r in run_tigris(path, feeds, model)])
    out_scale = init[next(n for n in model.graph.node if n.output[0] == model.graph.output[0].name).input[1]]
    assert np.abs(tigris - literal).max() <= 2.0 * out_scale * (1 + 1e-5)


@pytest.mark.slow
def test_onnxruntime_file_writes_prelu_out_as_the_onnx_path_does(tmp_path):
    torch.manual_seed(0)
    calib, sample = _data((2, 3, 24, 24))  # 16 x 24 x 24 = 9,216 values per sample: above the threshold
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(PReluNet().eval(), calib)
    path = export_qdq(qmodel, sample, tmp_path / "ort.onnx", target="onnxruntime-cpu")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "PRelu" not in ops and ops.count("Max") == 1  # slopes <= 1: Max(x, x * slope), two kernels
    assert path.readings.literal_lsb <= 3.0


def test_tigris_file_writes_a_spatial_mean_as_a_global_pool_and_tigris_runs_it(tmp_path):
    """The squeeze-excitation gate's ``mean((2, 3), keepdim=True)``: exported as ReduceMean, written for TiGrIS as
    GlobalAveragePool (the PP-OCR classifier's file compiles only so), proven byte-identical in ONNX Runtime by
    the pass; TiGrIS's own runtime runs the file (``check --run``)."""
    torch.manual_seed(0)
    calib, sample = _data((2, 3, 16, 16))
    qmodel = Quantizer.for_target("tigris").quantize(GatedConv().eval(), calib)
    path = export_qdq(qmodel, sample, tmp_path / "tigris.onnx", target="tigris")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "ReduceMean" not in ops and ops.count("GlobalAveragePool") == 1
    inputs = torch.randn(8, 1, 3, 16, 16, generator=torch.Generator().manual_seed(1)).numpy()
    report = check_file(path, "tigris", run=True, inputs=list(inputs))  # eight batches of one (a static plan)
    assert report.verdict == "accepted", report.summary()


class ResidualBatchNorm(torch.nn.Module):
    """A batch norm after a residual Add (no conv to fold into), as PP-OCRv4's detector has one."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv3 = torch.nn.Conv2d(8, 4, 3, padding=1)
        with torch.no_grad():  # statistics far from the identity, so a dropped or misread norm shows
            self.bn.running_mean.copy_(torch.randn(8, generator=g))
            self.bn.running_var.copy_(torch.rand(8, generator=g) + 0.5)
            self.bn.weight.copy_(torch.randn(8, generator=g))
            self.bn.bias.copy_(torch.randn(8, generator=g))

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        return self.conv3(torch.relu(self.bn(y + self.conv2(y))))


def test_lone_batch_norm_is_a_quantized_mul_and_add_for_tigris_and_tigris_runs_it(tmp_path):
    """TiGrIS runs BatchNormalization only folded into a conv (``Target.runs_lone_batch_norm``): the annotator writes
    the lone one as a per-channel mul and add (``decompose.batch_norm_as_affine``), quantized like any other, as the
    ONNX path's float pass does; the file was refused before ('BatchNormalization has no kernel in the runtime').
    ONNX Runtime's file keeps the op."""
    torch.manual_seed(0)
    calib, sample = _data((2, 3, 16, 16))
    model = ResidualBatchNorm().eval()
    with torch.no_grad():
        reference = model(sample)
    quantizer = Quantizer.for_target("tigris")
    qmodel = quantizer.quantize(model, calib)
    assert quantizer.report.batch_norms_as_affine == 1
    with torch.no_grad():  # still the model: the rewrite is the same arithmetic, then 8-bit rounding
        error = (qmodel(sample) - reference).pow(2).mean() / reference.pow(2).mean()
    assert error < 1e-3
    path = export_qdq(qmodel, sample, tmp_path / "tigris.onnx", target="tigris")
    graph = onnx.load(str(path)).graph
    ops = [n.op_type for n in graph.node]
    assert "BatchNormalization" not in ops and ops.count("Mul") == 1
    produced = {o: n for n in graph.node for o in n.output}
    for op in ("Mul", "Add"):  # the activation and the per-channel constant, each through its DequantizeLinear
        node = next(n for n in graph.node if n.op_type == op and n.input[1] in produced
                    and produced[n.input[1]].input[0] not in produced)  # a stored operand
        assert all(produced[i].op_type == "DequantizeLinear" for i in node.input)
    inputs = torch.randn(4, 1, 3, 16, 16, generator=torch.Generator().manual_seed(1)).numpy()
    report = check_file(path, "tigris", run=True, inputs=list(inputs))
    assert report.verdict == "accepted", report.summary()
    ort = export_qdq(Quantizer.for_target("onnxruntime-cpu").quantize(model, calib), sample,
                     tmp_path / "ort.onnx", target="onnxruntime-cpu")
    assert "BatchNormalization" in [n.op_type for n in onnx.load(str(ort)).graph.node]


class Upsampler(torch.nn.Module):
    """A text detector's neck: a transposed conv doubling the map, its output channels fewer than its inputs."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.up = torch.nn.ConvTranspose2d(8, 6, 2, stride=2)
        self.head = torch.nn.Conv2d(6, 4, 3, padding=1)

    def forward(self, x):
        return self.head(self.up(torch.relu(self.conv(x))))


@pytest.mark.parametrize("target", ["tigris", "openvino"])
def test_transposed_conv_weight_is_per_output_channel_and_the_runtime_runs_it(tmp_path, target):
    """The annotator had no rule for a transposed conv: its weight stayed float, which TiGrIS refuses to run in an
    int8 plan ('operator contract is not executable', PP-OCRv4's detector). Its weight [in, out, k, k] is now
    quantized per output channel, axis 1 (axis 0 would give the input channels the scales)."""
    torch.manual_seed(0)
    calib, sample = _data((2, 3, 8, 8))
    qmodel = Quantizer.for_target(target).quantize(Upsampler().eval(), calib)
    path = export_qdq(qmodel, sample, tmp_path / f"{target}.onnx", target=target)
    graph = onnx.load(str(path)).graph
    produced = {o: n for n in graph.node for o in n.output}
    (up,) = [n for n in graph.node if n.op_type == "ConvTranspose"]
    weight = produced[up.input[1]]
    assert weight.op_type == "DequantizeLinear"
    assert [a.i for a in weight.attribute if a.name == "axis"] == [1]
    scales = numpy_helper.to_array(next(t for t in graph.initializer if t.name == weight.input[1]))
    assert scales.shape == (6,)
    inputs = torch.randn(4, 1, 3, 8, 8, generator=torch.Generator().manual_seed(1)).numpy()
    report = check_file(path, target, run=True, inputs=list(inputs))
    assert report.verdict == "accepted", report.summary()


def test_exported_forms_follow_the_target_fields():
    names = {t: [p.name for p in target_forms.exported_forms(get_target(t))]
             for t in ("onnxruntime-cpu", "tigris", "openvino", "tensorrt")}
    assert names == {"onnxruntime-cpu": ["prelu_written_out", "spatial_mean_as_global_pool"],
                     "tigris": ["clip_as_relu6", "spatial_mean_as_global_pool"], "openvino": [], "tensorrt": []}
    assert all(p.proof == "exact" for t in names for p in target_forms.exported_forms(get_target(t)))


class DepthwiseNet(torch.nn.Module):
    """Conv 3x3 -> ReLU -> depthwise 5x5 -> ReLU -> Conv 1x1: ONNX Runtime's float rule keeps the 5x5 float
    (its weight too: with a dequantized weight between quantized neighbours ONNX Runtime would fuse it)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(16, 16, 5, padding=2, groups=16)
        self.conv2 = torch.nn.Conv2d(16, 8, 1)

    def forward(self, x):
        return self.conv2(torch.relu(self.depthwise(torch.relu(self.conv1(x)))))


@pytest.mark.slow
def test_onnxruntime_placement_keeps_the_same_weighted_op_float_on_both_paths(tmp_path):
    from quantship import export_onnx
    from quantship.inspect.run.consumers import ort_optimized_ops
    from quantship.quantize_onnx.quantizer import quantize_onnx_file

    torch.manual_seed(0)
    calib, sample = _data((2, 3, 16, 16))
    model = DepthwiseNet().eval()
    float_path = export_onnx(model, sample, tmp_path / "float.onnx", dynamic_batch=True)
    onnx_path = quantize_onnx_file(float_path, tmp_path / "onnx_path.onnx", [c.numpy() for c in calib],
                                   target="onnxruntime-cpu")
    assert list(onnx_path.plan["kept_float"].values()) == [
        next(r.why for r in get_target("onnxruntime-cpu").float_rules if r.id == "depthwise_over_3x3")]
    quantizer = Quantizer.for_target("onnxruntime-cpu")
    qmodel = quantizer.quantize(model, calib)
    assert list(quantizer.report.kept_float.values()) == list(onnx_path.plan["kept_float"].values())
    torch_path = export_qdq(qmodel, sample, tmp_path / "torch_path.onnx", target="onnxruntime-cpu")
    for path in (onnx_path.path, torch_path):
        graph = onnx.load(str(path)).graph
        stored = {t.name: t.data_type for t in graph.initializer}
        depthwise = [n for n in graph.node if n.op_type == "Conv" and any(a.name == "group" and a.i == 16 for a in n.attribute)]
        others = [n for n in graph.node if n.op_type == "Conv" and n not in depthwise]
        assert len(depthwise) == 1 and stored.get(depthwise[0].input[1]) == onnx.TensorProto.FLOAT, path.name
        assert all(n.input[1] not in stored for n in others), path.name  # the 3x3 and the 1x1 read int8 weights
    assert ort_optimized_ops(onnx_path.path) == ort_optimized_ops(torch_path)  # ONNX Runtime runs the same kernels


class WrittenOutHardSwish(torch.nn.Module):
    """Conv -> ``x * clamp(x + 3, 0, 6) / 6`` (a hard swish as Paddle exports it and onnx2torch converts it) -> Conv."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv1(x)
        return self.conv2(y * torch.clamp(y + 3.0, 0.0, 6.0) / 6.0)


@pytest.mark.slow
def test_onnxruntime_file_writes_a_hard_swish_as_one_op_as_the_onnx_path_does(tmp_path):
    torch.manual_seed(0)
    calib, sample = _data((2, 3, 16, 16))
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(WrittenOutHardSwish().eval(), calib)
    path = export_qdq(qmodel, sample, tmp_path / "ort.onnx", target="onnxruntime-cpu", place_as_onnx=True)
    graph = onnx.load(str(path)).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("HardSwish") == 1 and not {"Clip", "Div", "Mul", "Add"} & set(ops), ops
    swish = next(n for n in graph.node if n.op_type == "HardSwish")
    producers = {o: n.op_type for n in graph.node for o in n.output}
    readers = [n.op_type for n in graph.node if swish.output[0] in n.input]
    assert producers[swish.input[0]] == "DequantizeLinear" and readers == ["QuantizeLinear"]  # between two pairs
    # two roundings fewer than the torch model: a step apart at most where a value sat on a rounding edge
    assert path.readings.literal_lsb <= 3.0


class SwishDepthwiseNet(torch.nn.Module):
    """Conv -> hard swish (written out) -> depthwise 5x5 -> hard swish -> Conv 1x1, a PP-OCR block's shape."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(16, 16, 5, padding=2, groups=16)
        self.conv2 = torch.nn.Conv2d(16, 8, 1)

    @staticmethod
    def swish(y):
        return y * torch.clamp(y + 3.0, 0.0, 6.0) / 6.0

    def forward(self, x):
        return self.conv2(self.swish(self.depthwise(self.swish(self.conv1(x)))))


def _neighbours(path, op_type="Conv", group=16) -> tuple[str, list[str]]:
    """What writes the input of the Conv of ``group`` and what reads its output."""
    graph = onnx.load(str(path)).graph
    conv = next(n for n in graph.node if n.op_type == op_type and any(a.name == "group" and a.i == group
                                                                       for a in n.attribute))
    producer = next(n.op_type for n in graph.node if conv.input[0] in n.output)
    return producer, [n.op_type for n in graph.node if conv.output[0] in n.input]


@pytest.mark.slow
def test_onnxruntime_pairs_between_float_ops_are_dropped_as_the_onnx_path_never_places_them(tmp_path):
    from quantship import export_onnx
    from quantship.quantize_onnx.quantizer import quantize_onnx_file

    torch.manual_seed(0)
    calib, sample = _data((2, 3, 16, 16))
    model = SwishDepthwiseNet().eval()
    float_path = export_onnx(model, sample, tmp_path / "float.onnx", dynamic_batch=True)
    onnx_path = quantize_onnx_file(float_path, tmp_path / "onnx_path.onnx", [c.numpy() for c in calib],
                                   target="onnxruntime-cpu").path
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, calib)
    torch_path = export_qdq(qmodel, sample, tmp_path / "torch_path.onnx", target="onnxruntime-cpu", place_as_onnx=True)
    # the float depthwise Conv reads the HardSwish and feeds the next one directly, on both paths
    assert _neighbours(onnx_path) == _neighbours(torch_path) == ("HardSwish", ["HardSwish"])
    assert torch_path.readings.literal_lsb <= 3.0


def _quantized_mean(op: str, scale_in: float, scale_out: float) -> onnx.ModelProto:
    """x -> Q/DQ (int8) -> a mean over H and W (ReduceMean, or GlobalAveragePool) -> Q/DQ, as an exported file has it."""
    from onnx import TensorProto, helper

    init = [helper.make_tensor("s", TensorProto.FLOAT, [], [scale_in]),
            helper.make_tensor("so", TensorProto.FLOAT, [], [scale_out]),
            helper.make_tensor("z", TensorProto.INT8, [], [0]), helper.make_tensor("ax", TensorProto.INT64, [2], [2, 3])]
    mean = (helper.make_node("ReduceMean", ["d", "ax"], ["m"], keepdims=1) if op == "ReduceMean"
            else helper.make_node("GlobalAveragePool", ["d"], ["m"]))
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]), mean,
             helper.make_node("QuantizeLinear", ["m", "so", "z"], ["mq"]),
             helper.make_node("DequantizeLinear", ["mq", "so", "z"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 7, 7])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 1, 1])], init)
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_a_mean_whose_global_pool_rounds_one_step_differently_is_still_written_as_a_global_pool(monkeypatch):
    """ONNX Runtime's GlobalAveragePool and ReduceMean sum in another order: on this input 3 of 64 quantized means
    differ by one step, read literally. The form is kept: the op it wrote, run alone on the values the produced
    graph gives it, quantizes within one step of the produced one (``checks.same_op_steps``), and the graph with it
    is the reference of the later passes; a mean both read alike is rewritten by the byte proof alone. (The form
    was left out before, the file keeping its ReduceMean: TiGrIS cannot compile that one after some producers,
    and ONNX Runtime ran the PP-OCRv4 detector's ten of them for 8 ms of 100 ms.) The graph a form's own byte
    proof read is not run again by the pass's check."""
    import numpy as np
    import onnx_ir as ir

    from quantship.export import checks, qdq
    from quantship.export.checks import run_passes, run_unoptimized
    from quantship.precision import resolve_spec

    identity_runs, real = [], checks.check_identical
    for module in (checks, qdq):
        monkeypatch.setattr(module, "check_identical", lambda *a: (identity_runs.append(1), real(*a))[1])

    x = (np.random.default_rng(0).standard_normal((1, 64, 7, 7)) * 2).astype(np.float32)
    produced = _quantized_mean("ReduceMean", 0.03, 0.03 / 49 * 2)
    pooled = run_unoptimized(_quantized_mean("GlobalAveragePool", 0.03, 0.03 / 49 * 2), [x])[0]
    assert (pooled != run_unoptimized(produced, [x])[0]).sum() == 3  # the premise, measured here
    for (scale_out, moved) in ((0.03 / 49 * 2, True), (0.1, False)):
        produced = _quantized_mean("ReduceMean", 0.03, scale_out)
        ctx = qdq.ExportContext(spec=resolve_spec("pt2e", symmetric=True), opset_version=18,
                                activation_dtype="int8", target=get_target("tigris"), inputs=[x], produced=produced)
        form_pass = qdq.TargetFormsPass(ctx)
        identity_runs.clear()
        model = run_passes([form_pass], ir.from_proto(produced)).model
        assert len(identity_runs) == 1  # the form's own proof (moved: refused; else: the whole graph's, once)
        assert [n.op_type for n in model.graph if "Mean" in n.op_type or "Pool" in n.op_type] == ["GlobalAveragePool"]
        assert not form_pass.dropped and ("spatial_mean_as_global_pool" in form_pass.moved) == moved
        rewritten = run_unoptimized(ir.to_proto(model), [x])[0]
        assert np.array_equal(ctx.reference[0], rewritten)  # the later passes are proven against the graph with it
        assert np.abs(rewritten - run_unoptimized(produced, [x])[0]).max() <= scale_out * 1.0001  # one step at most


def test_same_op_steps_reads_each_rewritten_op_alone_and_tells_another_op_apart():
    """``checks.same_op_steps``: the mean written as GlobalAveragePool moves a rounding by at most one step; an op
    that computes something else in its place (a max, not a mean) is many steps away, so such a form would be left
    out; a new node no QuantizeLinear reads alone gives nothing to compare (None)."""
    import numpy as np
    from onnx import helper

    from quantship.export.checks import same_op_steps

    x = (np.random.default_rng(0).standard_normal((1, 64, 7, 7)) * 2).astype(np.float32)
    produced = _quantized_mean("ReduceMean", 0.03, 0.03 / 49 * 2)

    def replaced(op: str, reader: str = "QuantizeLinear") -> onnx.ModelProto:
        model = onnx.ModelProto()
        model.CopyFrom(produced)
        nodes = list(model.graph.node)
        at = next(k for k, n in enumerate(nodes) if n.op_type == "ReduceMean")
        nodes[at] = helper.make_node(op, ["d"], ["m2"], name="written")
        for n in nodes[at + 1:]:
            n.input[:] = ["m2" if i == "m" else i for i in n.input]
        if reader != "QuantizeLinear":  # a float op between the new node and its QuantizeLinear
            nodes[at + 1:at + 1] = [helper.make_node(reader, ["m2"], ["m3"], name="between")]
            nodes[at + 2].input[0] = "m3"
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        return model

    assert same_op_steps(produced, replaced("GlobalAveragePool"), [x]) == 1
    assert same_op_steps(produced, replaced("GlobalMaxPool"), [x]) > 1
    assert same_op_steps(produced, replaced("GlobalAveragePool", reader="Relu"), [x]) is None


class WrittenNorm(torch.nn.Module):
    """Linear -> a layer norm written out as onnx2torch converts Paddle's (mean, sub, pow by a stored 2, mean, add a
    stored eps, sqrt, div, times the scale, plus the bias) -> Linear, on [n, tokens, width]."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.register_buffer("two", torch.tensor(2.0))
        self.register_buffer("eps", torch.tensor(1e-5))
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.bias = torch.nn.Parameter(torch.full((16,), 0.1))

    def forward(self, x):
        h = self.fc1(x)
        d = h - h.mean(-1, keepdim=True)
        normalised = d / torch.sqrt(d.pow(self.two).mean(-1, keepdim=True) + self.eps)
        return self.fc2(normalised * self.scale + self.bias)


@pytest.mark.parametrize("target", ["tensorrt", "tigris"])
def test_a_written_out_layer_norm_is_one_op_where_its_statistics_cannot_stay_float(target, tmp_path):
    """A fully quantized runtime cannot keep the norm's statistics float and int8 kills its variance: the annotator
    writes the norm as one aten.layer_norm (``decompose.layer_norm_as_one_op``), one LayerNormalization in the file.
    The tensorrt file was refused before (its five Sqrt values float outside any pair, on the PP-OCRv4 recognizer).
    ONNX Runtime, which keeps them float, gets the norm as written."""
    torch.manual_seed(0)
    calib = [torch.randn(8, 6, 8) for _ in range(2)]
    sample = calib[0][:1]
    model = WrittenNorm().eval()
    quantizer = Quantizer.for_target(target)
    qmodel = quantizer.quantize(model, calib)
    assert quantizer.report.layer_norms == 1
    path = export_qdq(qmodel, sample, tmp_path / f"{target}.onnx", target=target)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("LayerNormalization") == 1 and not {"Sqrt", "Pow", "ReduceMean"} & set(ops)
    inputs = torch.randn(3, 1, 6, 8, generator=torch.Generator().manual_seed(1)).numpy()
    report = check_file(path, target, run=True, inputs=list(inputs))
    assert report.verdict in ("accepted", "not run"), report.summary()
    mixed = Quantizer.for_target("onnxruntime-cpu")
    mixed.quantize(model, calib)
    assert mixed.report.layer_norms == 0


class SplitAttention(torch.nn.Module):
    """One q/k/v projection reshaped to [n, tokens, 3, heads, width], permuted to [3, n, heads, tokens, width] and
    sliced on its first axis (slices of a rank-5 tensor, as onnx2torch converts the PP-OCRv4 recognizer's)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        t = self.qkv(x).reshape(x.shape[0], 6, 3, 2, 4).permute(2, 0, 3, 1, 4)
        q, k, v = (t[i:i + 1].squeeze(0) for i in range(3))
        attention = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        return self.out(attention.permute(0, 2, 1, 3).reshape(x.shape[0], 6, 8))


def test_slices_of_a_rank_5_tensor_are_taken_from_a_rank_3_view_for_tigris_and_tigris_runs_the_file(tmp_path):
    """TiGrIS's Slice reads rank 4 at most (``Target.max_slice_rank``): the annotator takes each slice from a rank-3
    reshape of its input (``decompose.slices_within_rank``), the same elements; the file was refused before ('Slice of
    a rank-5 input'). ONNX Runtime's file keeps its rank-5 slices."""
    torch.manual_seed(0)
    calib = [torch.randn(1, 6, 8) for _ in range(8)]
    model = SplitAttention().eval()
    quantizer = Quantizer.for_target("tigris")
    qmodel = quantizer.quantize(model, calib)
    assert quantizer.report.slices_lowered == 3
    path = export_qdq(qmodel, calib[0], tmp_path / "tigris.onnx", target="tigris")
    inputs = torch.randn(3, 1, 6, 8, generator=torch.Generator().manual_seed(1)).numpy()
    report = check_file(path, "tigris", run=True, inputs=list(inputs))
    assert report.verdict in ("accepted", "not run"), report.summary()
    mixed = Quantizer.for_target("onnxruntime-cpu")
    mixed.quantize(model, calib)
    assert mixed.report.slices_lowered == 0
