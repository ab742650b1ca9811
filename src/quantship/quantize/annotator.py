"""quantship's INT8 annotator for torchao's pt2e flow.

torchao ships no public XNNPACK-style quantizer, so this module decides, node by node, which
tensors of a ``torch.export`` graph carry an observer (PTQ) or a fake-quantizer (QAT):

- weighted ops (conv, linear): input activation, weight (int8 in [-127, 127], per output channel
  on axis 0 or per tensor), output after the fused batch-norm / ReLU / ReLU6 that follows;
- add / mul (+ ReLU), cat (one shared scale for all inputs and the output);
- pooling, mean and shape-only ops (flatten, reshape, view, permute, dropout in eval...):
  max-pooling and shape-only ops share their input's scale; averaging ops get their own;
- standalone activations (ReLU, ReLU6, sigmoid, hardswish, SiLU, GELU...).

``qdq_placement='skip_conv_add'`` leaves the residual addend that comes from a single-user
convolution partition unquantized; ``skip_activations`` keeps the named modules in float: the activations
they produce, and the weights of their conv/linear layers (as the ONNX path keeps an excluded node: a weight
dequantized for a float input would be a DequantizeLinear run on every call, for no integer kernel); ``int16``
stores the activations the named modules read and write in 16 bits (``_widen``), weights int8. Either list may
also name one op of the captured graph (``quantship sensitivity`` lists them: ``matmul_1``, ``conv2d_3``), which
changes that op alone, with the activation fused into it (``fused_head``), not the rest of its module.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e import (
    FakeQuantize,
    FusedMovingAvgObsFakeQuantize,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
)

from quantship.errors import Int16Uncovered
from quantship.precision import QuantSpec, is_pattern, names_match, under_modules
from quantship.quantize import observers
from quantship.quantize.constants import store_constructed_constants
from quantship.quantize.decompose import (
    batch_norm_as_affine,
    decompose_attention,
    decompose_einsum,
    flatten_linear_inputs,
    hard_swish_as_one_op,
    layer_norm_as_one_op,
    linear_from_matmul,
    out_of_place_on_constants,
    scalars_as_constants,
    slices_within_rank,
)
from quantship.quantize.histogram_search import HistogramSearchObserver
from quantship.targets import FloatRule, Target

aten = torch.ops.aten
WEIGHT_BOUND = 127  # int8 weights in [-127, 127]: symmetric, zero-point 0
WEIGHT_BOUND_REDUCED = 63  # reduce_range: u8 x s8 pairs stay below 2**15 (no vpmaddubsw saturation)

# -- operator tables (the one place that says which aten op belongs to which role) -------------
WEIGHTED_OPS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.linear.default}
CONV_OPS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default}
# weight [in, out / groups, k...]: per output channel is axis 1. Annotated as weighted ops; the algorithms that
# read WEIGHTED_OPS' weights along axis 0 (bias correction, rounding) leave them alone
TRANSPOSED_CONV_OPS = {aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}
ANNOTATED_WEIGHT_OPS = WEIGHTED_OPS | TRANSPOSED_CONV_OPS
# what a following batch norm folds into (prepare_pt2e before annotation, prepare_qat_pt2e after it)
CONV_BN_PRODUCERS = CONV_OPS | TRANSPOSED_CONV_OPS
BATCH_NORM_OPS = {
    aten.batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_no_training.default,
    aten.cudnn_batch_norm.default,
}
FUSABLE_ACTIVATIONS = {aten.relu.default, aten.relu_.default, aten.hardtanh.default, aten.hardtanh_.default}
ADD_OPS = {aten.add.Tensor, aten.add_.Tensor}
BINARY_OPS = ADD_OPS | {aten.mul.Tensor, aten.mul_.Tensor, aten.sub.Tensor, aten.div.Tensor}
# the divisor stays float: a quantized one rounds every value under half a step to exactly 0 (F.normalize's
# eps clamp included: x / 0 is inf or NaN where the float model is finite), and no runtime has an integer Div
DIV_OPS = {aten.div.Tensor}
# piecewise-linear clamps: with BINARY_OPS, the ops an activation written out element by element is made of
# (a hard swish as x * clamp(x + 3, 0, 6) / 6, a hard sigmoid as clamp(x / 6 + 0.5, 0, 1))
CLAMP_OPS = {aten.clamp.default, aten.clamp.Tensor, aten.clip.default, aten.clamp_min.default,
             aten.clamp_max.default, aten.hardtanh.default, aten.relu.default}
ARITHMETIC_OPS = BINARY_OPS | CLAMP_OPS
# of those, the ones ONNX Runtime has no integer kernel for (it has QLinearAdd and QLinearMul, and folds a ReLU
# into the QuantizeLinear before it): an affine x * a + b keeps its pairs and runs as two integer kernels
FLOAT_ARITHMETIC_OPS = {aten.div.Tensor} | (CLAMP_OPS - {aten.relu.default})
# ONNX Runtime's integer kernels beyond conv/linear/matmul (QLinearAdd, QLinearMul, QLinearAveragePool,
# QLinearSigmoid): with every input and the output quantized they run on integers (``_pairs_where_integer_kernels_read``)
INTEGER_BINARY_OPS = ADD_OPS | {aten.mul.Tensor, aten.mul_.Tensor}
# why a conv/linear computed from constants only stays float: the runtime folds it once, at load
CONSTANT_INPUT = "computed from constants only: folded by the runtime at load, in float"
INTEGER_OWN_OPS = {aten.avg_pool1d.default, aten.avg_pool2d.default, aten.sigmoid.default, aten.sigmoid_.default}
# activation x activation products (attention scores, attention x values): both inputs per tensor
MATMUL_OPS = {aten.matmul.default, aten.bmm.default, aten.mm.default}
MATMUL_ADD_OPS = {aten.baddbmm.default}  # addend + product: addend, both factors and output quantized
EINSUM_OPS = {aten.einsum.default}  # every operand per tensor, output quantized (ORT runs Einsum in float)
CAT_OPS = {aten.cat.default, aten.concat.default, aten.stack.default}
# output keeps the input's scale (no arithmetic on values, or max-selection only)
SHARED_SCALE_OPS = {
    aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
    aten.flatten.using_ints, aten.reshape.default, aten.view.default, aten._unsafe_view.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.swapaxes.default, aten.swapdims.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.unsqueeze.default, aten.unflatten.int,
    aten.dropout.default, aten.dropout_.default, aten.feature_dropout.default, aten.feature_dropout_.default,
    aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.pixel_shuffle.default, aten.upsample_nearest2d.vec,
    # index and window ops of ViT / Swin: class-token select, window partition and reverse, shifts
    aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.index.Tensor, aten.roll.default,
    aten.expand.default, aten.repeat.default, aten.flip.default,
}
# zero padding keeps the scale: 0.0 is exactly a quantized value whatever the zero-point
ZERO_PAD_OPS = {aten.pad.default, aten.constant_pad_nd.default}
# several outputs (read through getitem), each keeping the input's scale
SPLIT_OPS = {aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default}
# table lookups: the table is a stored weight (per tensor), the rows read keep its scale
EMBEDDING_OPS = {aten.embedding.default}
# output gets its own scale; the input is quantized too (norms compute in float between the two)
# (a batch norm that follows a conv is part of the conv's partition and never reaches this role)
NORM_OPS = {aten.layer_norm.default, aten.group_norm.default, aten.batch_norm.default}
OWN_SCALE_OPS = NORM_OPS | {
    aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default, aten.avg_pool1d.default,
    aten.avg_pool2d.default, aten.mean.dim, aten.mean.default,
    aten.relu.default, aten.relu_.default, aten.hardtanh.default, aten.hardtanh_.default,
    aten.sigmoid.default, aten.sigmoid_.default, aten.hardsigmoid.default, aten.hardsigmoid_.default,
    aten.hardswish.default, aten.hardswish_.default, aten.silu.default, aten.silu_.default,
    aten.gelu.default, aten.tanh.default, aten.softmax.int, aten._softmax.default,
    aten.upsample_bilinear2d.vec,
}
# a clamp between two number bounds (a hard sigmoid written out, as a model converted from ONNX has it) gets its own
# scale: a float one in an integer-only runtime's plan is not read as the model means it (TiGrIS runs Clip(0, 6) only:
# PP-OCRv4's detector from PyTorch, its SE gates' Clip(0, 1) float, 82/91 lines in TiGrIS where ONNX Runtime read
# 89/91); quantized, the export writes it as a Relu6 between a Mul by 6 and a Mul by a sixth for such a target
# (``target_forms.clip_as_relu6``).
# A one-sided clamp stays float: F.normalize's eps floor is a divisor, which a rounding would make 0
BOUNDED_CLAMP_OPS = {aten.clamp.default, aten.clip.default}
# attention masking: selects -inf (or a constant) where masked; kept float on purpose, since a
# quantized -inf is a finite number. The softmax after it reads the float scores.
FLOAT_SELECT_OPS = {aten.where.ScalarOther, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor}
# fresh tensors whose first argument is only a template (dtype, device): constant values
NEW_TENSOR_OPS = {aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default}

# role name of every op with a rule, for reports and tests
ROLES: dict = {
    **{op: "weighted" for op in ANNOTATED_WEIGHT_OPS},
    **{op: "binary" for op in BINARY_OPS},
    **{op: "matmul" for op in MATMUL_OPS | MATMUL_ADD_OPS},
    **{op: "einsum" for op in EINSUM_OPS},
    **{op: "cat" for op in CAT_OPS},
    **{op: "embedding" for op in EMBEDDING_OPS},
    **{op: "shared_scale" for op in SHARED_SCALE_OPS | ZERO_PAD_OPS | SPLIT_OPS},
    **{op: "own_scale" for op in OWN_SCALE_OPS},
    **{op: "float_select" for op in FLOAT_SELECT_OPS},
    **{op: "bounded_clamp" for op in BOUNDED_CLAMP_OPS},
}


def _is_float_tensor(node: object) -> bool:
    if not isinstance(node, Node):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _one_value(node: object) -> bool:
    """A tensor of one element (0-d or broadcast from shape [1])."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(val, torch.Tensor) and val.numel() == 1


def module_of(node: Node) -> str | None:
    """The dotted name of the innermost module a node was traced under (``nn_module_stack``); None when the
    capture recorded none."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else None


def module_path(node: Node) -> str:
    """``module_of``, '' at top level."""
    return module_of(node) or ""


def fused_head(node: Node) -> Node:
    """The op whose annotation covers ``node``: for a ReLU / ReLU6 fused into the conv, linear or binary op before
    it (through a batch norm), that op; else ``node``. Its name is the one ``skip_activations`` and ``int16`` take
    to change this output alone."""
    head = node.args[0] if node.op == "call_function" and node.target in FUSABLE_ACTIVATIONS and node.args else None
    while isinstance(head, Node) and head.op == "call_function" and head.target in (BATCH_NORM_OPS | {operator.getitem}):
        head = head.args[0]
    fused = isinstance(head, Node) and head.op == "call_function" and head.target in (ANNOTATED_WEIGHT_OPS | BINARY_OPS)
    return head if fused else node


def _node_args(node: Node) -> list[Node]:
    found: list[Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def op_name(target: object) -> str:
    """``aten.layer_norm.default`` style name of a call target."""
    return str(getattr(target, "__name__", target)) if not isinstance(target, torch._ops.OpOverload) else str(target)


def _pad_value(node: Node) -> object:
    """The fill value of a constant pad (None when the mode copies input values instead)."""
    if node.target is aten.constant_pad_nd.default:
        return node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    if mode != "constant":
        return None
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("value")


@dataclass(frozen=True)
class FloatOp:
    """An op the annotator has no INT8 rule for, where the model has it."""

    op: str
    module: str  # dotted module path ('' = the model's own forward)

    def __str__(self) -> str:
        return f"{self.op} in {self.module or '<top level>'}"


@dataclass
class AnnotationReport:
    """What the annotator did, for verbose output and for refusing what did not happen."""

    n_weighted: int = 0
    n_add: int = 0
    n_skipped_conv_add: int = 0
    n_float_select: int = 0
    skipped_nodes: list[str] = field(default_factory=list)
    float_ops: list[FloatOp] = field(default_factory=list)
    kept_float: dict[str, str] = field(default_factory=dict)  # weighted node -> the target's float rule (why)
    functions: dict[str, int] = field(default_factory=dict)  # last node of a function of one tensor -> its ops
    float_outputs: list[str] = field(default_factory=list)  # outputs only convs kept float read: no pair
    hard_swishes: int = 0  # hard swishes written out, made one aten.hardswish (decompose.hard_swish_as_one_op)
    batch_norms_as_affine: int = 0  # lone batch norms written as mul + add (decompose.batch_norm_as_affine)
    layer_norms: int = 0  # layer norms written out, made one aten.layer_norm (decompose.layer_norm_as_one_op)
    slices_lowered: int = 0  # slices of a rank above the target's, taken from a rank-3 view (decompose)
    int16_values: list[str] = field(default_factory=list)  # values stored in 16 bits (``int16``), graph order

    @property
    def unannotated_ops(self) -> dict[str, int]:
        """Op name -> how many of it stayed float for want of a rule."""
        counts: dict[str, int] = {}
        for f in self.float_ops:
            counts[f.op] = counts.get(f.op, 0) + 1
        return counts

    def float_ops_by_module(self) -> dict[str, list[str]]:
        """Module path -> the ops left float there (in graph order, repeated ops listed once)."""
        out: dict[str, list[str]] = {}
        for f in self.float_ops:
            ops = out.setdefault(f.module or "<top level>", [])
            if f.op not in ops:
                ops.append(f.op)
        return out

    def as_dict(self) -> dict:
        return {"n_weighted": self.n_weighted, "n_add": self.n_add, "n_skipped_conv_add": self.n_skipped_conv_add,
                "n_float_select": self.n_float_select, "float_ops": self.float_ops_by_module(),
                "kept_float": dict(self.kept_float), "functions_of_one_tensor": dict(self.functions),
                "float_outputs": list(self.float_outputs), "hard_swishes_as_one_op": self.hard_swishes,
                "batch_norms_as_affine": self.batch_norms_as_affine, "layer_norms_as_one_op": self.layer_norms,
                "slices_lowered": self.slices_lowered,
                "int16_values": list(self.int16_values)}


class QuantshipQuantizer(Quantizer):
    """A torchao pt2e ``Quantizer`` that applies one exportable ``QuantSpec`` (W8A8)."""

    def __init__(self, spec: QuantSpec, *, is_qat: bool = False, target: Target | None = None,
                 modules: frozenset[str] | None = None):
        """``modules``: the model's module names; a ``skip_activations`` or ``int16`` name that is none of them
        must then name an op of the captured graph (refused otherwise, at annotation)."""
        super().__init__()
        self.modules = modules
        # a target that runs float ops between integer ones (``Target.runs_mixed_graphs``) gets its placement
        # knowledge: pairs only where integer kernels read them (``_pairs_where_integer_kernels_read``), a function
        # of one tensor written out quantized at its output only (``_functions_of_one_tensor``), its float rules
        # (weighted ops its runtime runs faster in float), and a written-out hard swish as one op where it is faster
        self.mixed = target is not None and target.runs_mixed_graphs
        self._integer_ends: set = set()  # the last node of each integer conv/linear partition
        self.one_op_hard_swish = self.mixed and target.hard_swish_faster_as_one_op
        # a runtime that runs BatchNormalization only folded into a conv gets a lone one as a quantized mul + add
        self.affine_batch_norm = target is not None and not target.runs_lone_batch_norm
        # a layer norm written out as one op where its statistics cannot stay float (a fully quantized runtime) or the
        # runtime reads it only as one op
        self.one_op_layer_norm = target is not None and (not self.mixed or not target.runs_written_out_layer_norm)
        self.max_slice_rank = None if target is None else target.max_slice_rank
        self.float_rules: tuple[FloatRule, ...] = target.float_rules if self.mixed else ()
        if spec.backend != "pt2e":
            raise ValueError(f"QuantshipQuantizer applies pt2e specs, got backend={spec.backend!r}")
        self.spec = spec
        self.is_qat = is_qat
        self.report = AnnotationReport()
        self._act = self._activation_qspec()
        self._act16 = self._activation_qspec(bits=16)
        self._weight = self._weight_qspec()
        self._weight_transposed = self._weight_qspec(axis=1)
        self._const = self._weight_qspec(per_channel=False)
        self._constant_memo: dict[Node, bool] = {}

    # -- qspecs ----------------------------------------------------------------------------
    def _activation_qspec(self, bits: int = 8) -> QuantizationSpec:
        """8 bits: the spec's observer; 16 bits: the exact range seen (at 16 bits a rounding costs 256x less than at
        8, so clipping a tail no longer pays), as the ONNX path's ``int16``."""
        qscheme = torch.per_tensor_symmetric if self.spec.symmetric else torch.per_tensor_affine
        if self.is_qat:
            ctr = FakeQuantize.with_args(observer=MovingAverageMinMaxObserver)
        else:
            ctr = activation_observer(self.spec.act_observer or "histogram") if bits == 8 else MinMaxObserver
        dtype, low, high = (torch.int8, -128, 127) if bits == 8 else (torch.int16, -32768, 32767)
        return QuantizationSpec(dtype=dtype, quant_min=low, quant_max=high, qscheme=qscheme, observer_or_fake_quant_ctr=ctr)

    def _weight_qspec(self, per_channel: bool | None = None, axis: int = 0) -> QuantizationSpec:
        """Weights of conv/linear (per channel when the spec says so, along ``axis``: 1 for a transposed conv);
        ``per_channel=False`` gives the per-tensor form used for every other constant an op reads (embeddings,
        class token, biases added to activations): all of them are stored integer tensors, so all honour
        reduce_range."""
        if per_channel is None:
            per_channel = self.spec.qscheme == "per_channel"
        if per_channel:
            observer = MovingAveragePerChannelMinMaxObserver if self.is_qat else PerChannelMinMaxObserver
            qscheme = torch.per_channel_symmetric
        else:
            observer = MovingAverageMinMaxObserver if self.is_qat else MinMaxObserver
            qscheme, axis = torch.per_tensor_symmetric, None
        ctr = FusedMovingAvgObsFakeQuantize.with_args(observer=observer) if self.is_qat else observer
        bound = WEIGHT_BOUND_REDUCED if self.spec.reduce_range else WEIGHT_BOUND
        return QuantizationSpec(dtype=torch.int8, quant_min=-bound, quant_max=bound, qscheme=qscheme,
                                ch_axis=axis, observer_or_fake_quant_ctr=ctr)

    # -- graph facts -----------------------------------------------------------------------
    def _constant(self, node: object) -> bool:
        """True for a tensor computed from parameters, buffers and literals only (never from a model
        input): convert_pt2e folds its quantization into a stored integer tensor, i.e. a weight."""
        if not isinstance(node, Node):
            return True
        if node in self._constant_memo:
            return self._constant_memo[node]
        if node.op == "get_attr":
            result = True
        elif node.op != "call_function":
            result = False
        else:
            args = _node_args(node)
            if node.target in NEW_TENSOR_OPS:
                args = args[1:]
            result = all(self._constant(a) for a in args)
        self._constant_memo[node] = result
        return result

    def _skipped(self, node: Node) -> bool:
        return _named(node, self.spec.skip_activations or ())

    def _quantizable_input(self, arg: object) -> bool:
        """A float tensor not produced under a ``skip_activations`` module (those stay float even
        where a quantized op outside the module reads them)."""
        return _is_float_tensor(arg) and not (arg.op == "call_function" and self._skipped(arg))

    def _input_spec(self, arg: Node):
        """The qspec of an input edge: per-tensor weight form for constants, activation otherwise."""
        return self._const if self._constant(arg) else self._act

    @staticmethod
    def _mark(node: Node, inputs: dict | None = None, output=None) -> None:
        node.meta["quantization_annotation"] = QuantizationAnnotation(
            input_qspec_map=inputs or {}, output_qspec=output, _annotated=True
        )

    @staticmethod
    def _annotated(node: Node) -> bool:
        ann = node.meta.get("quantization_annotation")
        return ann is not None and ann._annotated

    def _single_user_next(self, node: Node, targets: set) -> Node | None:
        if len(node.users) != 1:
            return None
        (user,) = node.users
        if user.op == "call_function" and user.target in targets and user.args[0] is node:
            return user
        return None

    def _weighted_partition(self, node: Node) -> list[Node]:
        """conv/linear [-> batch-norm (QAT)] [-> ReLU/ReLU6], each link single-user."""
        chain = [node]
        bn = self._single_user_next(node, BATCH_NORM_OPS)
        if bn is not None:
            chain.append(bn)
            getitem = self._single_user_next(bn, {operator.getitem})
            if getitem is not None:
                chain.append(getitem)
        act = self._single_user_next(chain[-1], FUSABLE_ACTIVATIONS)
        if act is not None:
            chain.append(act)
        return chain

    # -- annotation ------------------------------------------------------------------------
    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        """Decompose fused attention and batched-matmul einsums so their products are matmul nodes the
        annotator quantizes, store the number operand of mul/add as a constant (affine specs), store the constants
        built from arange (RoPE tables, position ids), make products by a constant [in, out] weight (GPT-2's
        Conv1D) linears, and give N-D linears a 2-D view so that each exports as one Gemm reading its dequantized weight; make in-place ops on
        constants functional, so that convert_pt2e folds the whole constant subgraph; for a target that runs
        BatchNormalization only folded into a conv, write a lone batch norm as a per-channel mul and add; for one that
        cannot keep a written-out layer norm's statistics float, make it one layer_norm."""
        decompose_attention(model)
        decompose_einsum(model)
        if self.one_op_hard_swish:
            self.report.hard_swishes = hard_swish_as_one_op(model)
        if self.affine_batch_norm:
            self.report.batch_norms_as_affine = batch_norm_as_affine(model, CONV_BN_PRODUCERS)
        if self.one_op_layer_norm:
            self.report.layer_norms = layer_norm_as_one_op(model)
        if self.max_slice_rank is not None:
            self.report.slices_lowered = slices_within_rank(model, self.max_slice_rank)
        if not self.spec.symmetric:
            # uint8 files (ONNX Runtime, OpenVINO): the op becomes QLinearMul/QLinearAdd. Symmetric int8
            # keeps the literal: TiGrIS's runtime misreads a stored 0-d Mul/Add operand (107 LSB measured), and
            # a stored one-value one too (PP-OCRv4's learnable affine scale [1]: 67 LSB): ``_annotate_binary``
            # leaves those float as well
            scalars_as_constants(model)
        store_constructed_constants(model, self._constant)  # RoPE tables, position embeddings: stored int8
        linear_from_matmul(model, self._constant)  # GPT-2's Conv1D (addmm), x @ W: per-channel linears
        flatten_linear_inputs(model)
        out_of_place_on_constants(model, self._constant)
        self._constant_memo.clear()  # facts of the graph before the rewrites
        return model

    def _cleared_conv_outputs(self, model: GraphModule) -> set[Node]:
        """skip_conv_add: the conv partitions that feed an add directly keep a float output."""
        partition_end: dict[Node, Node] = {}  # last node of a conv partition -> its conv
        cleared: set[Node] = set()
        for node in model.graph.nodes:
            if node.op == "call_function" and node.target in CONV_OPS:
                chain = self._weighted_partition(node)
                partition_end[chain[-1]] = node
        for node in model.graph.nodes:
            if node.op != "call_function" or node.target not in ADD_OPS or self._skipped(node):
                continue
            for arg in node.args[:2]:
                if arg in partition_end and len(arg.users) == 1 and arg not in cleared:
                    cleared.add(arg)
                    break
        return cleared

    def _functions_of_one_tensor(self, model: GraphModule) -> dict[Node, list[Node]]:
        """Arithmetic ops (``ARITHMETIC_OPS``) that together compute a function of one tensor ``x`` and constants,
        at least two of them, one a clamp or a division (``FLOAT_ARITHMETIC_OPS``), whose inner results nothing
        else reads: the last op -> the ops, in graph order. A hard swish written out (``x * clamp(x + 3, 0, 6) /
        6``, as a model converted from ONNX has it) is one. Its inner results are not values the model hands on,
        so a target that runs float ops quantizes only what it computes: each inner pair would add a rounding
        and a QuantizeLinear/DequantizeLinear for the runtime to run around ops it runs in float anyway (ONNX
        Runtime's Clip and Div). Found by the graph's shape and the ops' kinds, never by a module's name."""
        def arithmetic(n: object) -> bool:
            return (isinstance(n, Node) and n.op == "call_function" and n.target in ARITHMETIC_OPS
                    and _is_float_tensor(n) and not self._constant(n) and not self._skipped(n))

        def tensors(n: Node) -> list[Node]:
            return [a for a in _node_args(n) if not self._constant(a)]

        roots: dict[Node, set[Node]] = {}  # the tensors (not inner arithmetic) each arithmetic op is computed from
        for n in model.graph.nodes:
            if arithmetic(n):
                roots[n] = set()
                for a in tensors(n):
                    inner = a in roots and all(arithmetic(u) for u in a.users)
                    roots[n] |= roots[a] if inner else {a}
        order = {n: k for k, n in enumerate(model.graph.nodes)}
        found: dict[Node, list[Node]] = {}
        taken: set[Node] = set()
        for last in sorted(roots, key=order.get, reverse=True):
            if last in taken or len(roots[last]) != 1:
                continue
            (x,) = roots[last]
            members, todo = {last}, [last]
            while todo:
                for a in tensors(todo.pop()):
                    if a is not x and a not in members and a in roots and roots[a] == {x}:
                        members.add(a)
                        todo.append(a)
            inner = members - {last}
            # (every member reads only x, constants and other members: its roots are {x})
            if inner and all(set(m.users) <= members for m in inner) and not members & taken \
                    and any(m.target in FLOAT_ARITHMETIC_OPS for m in members):
                found[last] = sorted(members, key=order.get)
                taken |= members
        return found

    def annotate(self, model: GraphModule) -> GraphModule:
        nodes = {n.name: n for n in model.graph.nodes}
        if self.modules is not None:
            for flag in ("skip_activations", "int16"):
                refuse_unknown_names(self.modules, getattr(self.spec, flag), flag, set(nodes))

        def heads(names: tuple[str, ...] | None) -> tuple[str, ...] | None:  # a fused ReLU named: its conv's op
            named = [node for n in names or () for k, node in nodes.items() if names_match(k, n)]
            return names and tuple(sorted({*names, *(fused_head(node).name for node in named)}))

        self.spec = dataclasses.replace(self.spec, skip_activations=heads(self.spec.skip_activations),
                                        int16=heads(self.spec.int16))
        cleared = self._cleared_conv_outputs(model) if self.spec.qdq_placement == "skip_conv_add" else set()
        if self.mixed:
            for last, ops in self._functions_of_one_tensor(model).items():
                for op in ops:
                    self._mark(op, {}, self._act if op is last else None)
                self.report.functions[last.name] = len(ops)
        for node in model.graph.nodes:
            if node.op != "call_function" or self._annotated(node):
                continue
            if self._constant(node):
                # folded by convert_pt2e; the op that reads it quantizes it as a weight. This holds for a
                # conv/linear on constants too (Swin V2's position-bias MLP on its coordinate table): an
                # annotated one would stay a Gemm run on every call, its input stored at activation range
                if node.target in ANNOTATED_WEIGHT_OPS:
                    self.report.kept_float[node.name] = CONSTANT_INPUT  # float by design, not a partial result
                continue
            if node.target in ANNOTATED_WEIGHT_OPS:
                self._annotate_weighted(node, cleared)
                continue
            if self._skipped(node):
                self.report.skipped_nodes.append(node.name)
                continue
            handler = self._HANDLERS.get(ROLES.get(node.target))
            if handler is not None:
                handler(self, node, cleared)
            elif node.target is not operator.getitem:
                self._no_rule(node)
        if self.mixed:
            self._pairs_where_integer_kernels_read(model)
        if self.spec.int16:
            self._widen(model)
        return model

    def _widen(self, model: GraphModule) -> None:
        """``int16``: every quantized activation a node under the named modules reads, and its own quantization
        point (past the activation its kernel fuses), stored in 16 bits, with every value tied to one of them
        (a shared scale: data movement, a concatenation), so no tie is split across two grids. A name that covers
        no quantized activation is refused (``Int16Uncovered``)."""
        anns = {n: n.meta["quantization_annotation"] for n in model.graph.nodes
                if n.op == "call_function" and self._annotated(n)}
        chosen: set[Node] = set()
        for name in self.spec.int16:
            found: set[Node] = set()
            for n in (n for n in anns if _named(n, (name,))):
                found |= {a for a, q in anns[n].input_qspec_map.items() if q is not None and not self._constant(a)}
                ends = {n, self._weighted_partition(n)[-1], self._single_user_next(n, FUSABLE_ACTIVATIONS)}
                found |= {e for e in ends if e in anns and anns[e].output_qspec is not None}
            if not found:
                raise Int16Uncovered(f"int16 names {name!r}, which reads and writes no quantized activation here "
                                     "(kept float, or not quantized for this target); name a quantized module or op "
                                     "(quantship sensitivity lists them)", name)
            chosen |= found
        root: dict[Node, Node] = {}

        def find(x: Node) -> Node:
            while root.get(x, x) is not x:
                x = root[x]
            return x

        def tie(x: Node, shared: SharedQuantizationSpec) -> None:
            other = shared.edge_or_node[0] if isinstance(shared.edge_or_node, tuple) else shared.edge_or_node
            root[find(x)] = find(other)

        for n, ann in anns.items():
            for a, q in ann.input_qspec_map.items():
                if isinstance(q, SharedQuantizationSpec):
                    tie(a, q)
            if isinstance(ann.output_qspec, SharedQuantizationSpec):
                tie(n, ann.output_qspec)
        groups = {find(x) for x in chosen}
        wide = {x for x in {*anns, *(a for ann in anns.values() for a in ann.input_qspec_map)} if find(x) in groups}
        for n, ann in anns.items():
            ann.input_qspec_map = {a: self._act16 if a in wide and q is self._act else q
                                   for a, q in ann.input_qspec_map.items()}
            if n in wide and ann.output_qspec is self._act:
                ann.output_qspec = self._act16
        self.report.int16_values = [n.name for n in model.graph.nodes if n in wide]

    def _pairs_where_integer_kernels_read(self, model: GraphModule) -> None:
        """Pairs only where an integer kernel reads or writes them (the ONNX path's ``integer`` placement, over
        the annotations): a conv/linear reads its input quantized and writes its output quantized (QLinearConv);
        data movement (``SHARED_SCALE_OPS``, concatenation) moves integers only when its output is read
        quantized, and then reads its input quantized; an Add, a Mul (``INTEGER_BINARY_OPS``), an average pool
        or a sigmoid (``INTEGER_OWN_OPS``) runs an integer kernel when its output is read quantized, its inputs
        then read quantized too (a pair on a float op's output, one pass over it, buys an integer op over the
        large tensor: PP-OCR's detector's learnable affine blocks, ``x * a + b`` after each hard swish, took the
        file from 1.27x to 1.50x FP32 at batch 8, REAL.md), unless such a pair would make another float
        reader of that value read it through a DequantizeLinear (a squeeze-excitation's Mul, whose input a mean
        also reads: PP-OCR's classifier ran 4-8% slower so at batch 8, two runs). Every other annotated op
        computes in float: its inputs lose their pairs, and its output keeps one only where an integer kernel
        reads it. A pair no integer kernel reads would only add a rounding and two passes over the tensor (a
        MaxPool between two float ops ran 13x slower as ONNX Runtime's uint8 pool than in float: PP-OCR's
        classifier, batch 8)."""
        anns = {n: n.meta["quantization_annotation"] for n in model.graph.nodes
                if n.op == "call_function" and self._annotated(n)}

        def point(n: Node) -> Node:  # where n's value is quantized: past the activation an integer kernel fuses
            after = self._single_user_next(n, FUSABLE_ACTIVATIONS)
            return after if after is not None and after in anns and n.target in BINARY_OPS else n

        def outputs(n: Node) -> list[Node]:  # a split's values are its getitem users
            return [u for u in n.users if u.target is operator.getitem] if n.target in SPLIT_OPS else [n]

        quantized = {n for n in self._integer_ends if n in anns and anns[n].output_qspec is not None}
        wanted: set[Node] = set()
        integer: set[Node] = set()
        for n, ann in anns.items():
            if n.target in ANNOTATED_WEIGHT_OPS | MATMUL_OPS | MATMUL_ADD_OPS | EMBEDDING_OPS and ann.input_qspec_map:
                integer.add(n)
                wanted |= {a for a, q in ann.input_qspec_map.items() if q is not None and not self._constant(a)}
                if n.target not in ANNOTATED_WEIGHT_OPS:
                    quantized.add(n)
        moves = SHARED_SCALE_OPS | ZERO_PAD_OPS | SPLIT_OPS | CAT_OPS
        may_read_integers = moves | INTEGER_BINARY_OPS | INTEGER_OWN_OPS | ANNOTATED_WEIGHT_OPS | MATMUL_OPS | MATMUL_ADD_OPS

        def available(a: Node, depth: int = 0) -> bool:
            """``a`` carries a pair, or will if the op that makes it runs on integers (data movement of an
            available value, or an Add/Mul, which runs on integers once its output is read quantized)."""
            if a in wanted or a in quantized:
                return True
            if depth > 64 or a.op != "call_function" or a not in anns:
                return False
            if a.target in INTEGER_BINARY_OPS | INTEGER_OWN_OPS:
                return True
            src = a.args[0] if a.target is operator.getitem else a
            return src in anns and src.target in moves and any(
                available(x, depth + 1) for x in anns[src].input_qspec_map if isinstance(x, Node))

        def pair_costs_a_reader(a: Node, n: Node) -> bool:
            """A pair on ``a`` (a float op's value) for ``n`` would make a float reader of ``a`` read it through a
            DequantizeLinear: one more pass over ``a`` and a rounding, for that reader's sake."""
            return not available(a) and any(u is not n and u.target not in may_read_integers for u in a.users)

        changed = True
        while changed:
            changed = False
            for n, ann in anns.items():
                if n in integer or not ann.input_qspec_map:
                    continue
                ins = [a for a in ann.input_qspec_map if not self._constant(a)]
                if n.target in SHARED_SCALE_OPS | ZERO_PAD_OPS | SPLIT_OPS | CAT_OPS:
                    joins = any(o in wanted for o in outputs(n))
                elif n.target in INTEGER_BINARY_OPS | INTEGER_OWN_OPS:
                    # its inputs from float ops get pairs (one pass each over them) for an integer op; ONNX Runtime
                    # fuses only when every input is quantized (a skipped module's value is not)
                    tensors = [a for a in _node_args(n) if not self._constant(a)]
                    joins = (point(n) in wanted and len(ins) == len(tensors)
                             and not any(pair_costs_a_reader(a, n) for a in ins))
                else:
                    continue
                if joins:
                    integer.add(n)
                    wanted |= set(ins)
                    quantized |= {point(n), *outputs(n)}
                    changed = True
        fused = {point(n) for n in integer if n.target in INTEGER_BINARY_OPS}
        kept = quantized | wanted
        for n, ann in anns.items():
            if n in integer or n in fused or n in self._integer_ends or n.target in ANNOTATED_WEIGHT_OPS:
                continue
            if n.target is operator.getitem and n.args[0] in integer:
                continue  # a split's value: the split moves integers
            ann.input_qspec_map = {}
            if ann.output_qspec is not None and n not in kept:
                ann.output_qspec = None
                self.report.float_outputs.append(n.name)

    def _float_rule(self, node: Node) -> FloatRule | None:
        """The target's float rule for a conv (the ONNX path's ``FloatRule`` read on the same facts: op
        type, group, weight shape), or None."""
        w = node.args[1] if len(node.args) > 1 else None
        shape = getattr(getattr(w, "meta", {}).get("val"), "shape", None)
        if not self.float_rules or node.target not in CONV_OPS | TRANSPOSED_CONV_OPS or shape is None:
            return None
        op_type = "ConvTranspose" if node.target in TRANSPOSED_CONV_OPS else "Conv"
        group = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)  # at 6 in both schemas
        return next((r for r in self.float_rules if r.applies(op_type, {"group": int(group)}, tuple(shape))), None)

    def _annotate_weighted(self, node: Node, cleared: set[Node]) -> None:
        chain = self._weighted_partition(node)
        rule = self._float_rule(node)
        if rule is not None:  # float as the ONNX path keeps it: weight and activations (a runtime fuses a conv whose
            self.report.kept_float[node.name] = rule.why  # weight and input are dequantized into an integer kernel)
            for later in chain:
                self._mark(later, {}, None)
            return
        if self._skipped(node):  # weight and activations float (the module docstring says why)
            self.report.skipped_nodes.append(node.name)
            for later in chain:
                self._mark(later, {}, None)
            return
        x, w = node.args[0], node.args[1]
        # Order matters: torchao's QAT conv-bn fusion re-keys this map by position
        # (first entry = activation, second = weight); a float activation is an explicit None.
        inputs = {x: self._act if self._quantizable_input(x) else None}
        if isinstance(w, Node):
            inputs[w] = self._weight_transposed if node.target in TRANSPOSED_CONV_OPS else self._weight
        out = None if chain[-1] in cleared else self._act
        self._integer_ends.add(chain[-1])
        self._mark(node, inputs, out if len(chain) == 1 else None)
        for later in chain[1:]:
            self._mark(later, {}, out if later is chain[-1] else None)
        self.report.n_weighted += 1

    def _annotate_binary(self, node: Node, cleared: set[Node]) -> None:
        if not _is_float_tensor(node):
            return  # e.g. BatchNorm's num_batches_tracked += 1 in a training capture
        act_after = self._single_user_next(node, FUSABLE_ACTIVATIONS)
        inputs = {}
        for arg in node.args[:1] if node.target in DIV_OPS else node.args[:2]:
            if self.spec.symmetric and self._constant(arg) and _one_value(arg):
                continue  # as a number literal stays one for symmetric specs (``transform_for_annotation``)
            if self._quantizable_input(arg) and arg not in cleared:
                inputs[arg] = self._input_spec(arg)
            elif arg in cleared:
                self.report.n_skipped_conv_add += 1
        self._mark(node, inputs, None if act_after else self._act)
        if act_after is not None:
            self._mark(act_after, {}, self._act)
        if node.target in ADD_OPS:
            self.report.n_add += 1

    def _annotate_matmul(self, node: Node, cleared: set[Node]) -> None:
        factors = node.args[1:3] if node.target in MATMUL_ADD_OPS else node.args[:2]
        inputs = {a: self._input_spec(a) for a in factors if self._quantizable_input(a)}
        if node.target in MATMUL_ADD_OPS and self._quantizable_input(node.args[0]):
            inputs[node.args[0]] = self._input_spec(node.args[0])
        self._mark(node, inputs, self._act)

    def _annotate_einsum(self, node: Node, cleared: set[Node]) -> None:
        operands = [t for t in node.args[1] if self._quantizable_input(t)]
        if _is_float_tensor(node):
            self._mark(node, {t: self._input_spec(t) for t in operands}, self._act)

    def _annotate_cat(self, node: Node, cleared: set[Node]) -> None:
        tensors = [t for t in node.args[0] if self._quantizable_input(t)]
        varying = [t for t in tensors if not self._constant(t)]
        if not varying:
            return
        anchor = varying[0]
        shared = SharedQuantizationSpec((anchor, node))
        # constants (a class token) get their own weight-form scale: a shared activation scale
        # would store them outside reduce_range's [-63, 63]
        inputs = {t: self._const if self._constant(t) else shared for t in tensors}
        inputs[anchor] = self._act
        self._mark(node, inputs, shared)

    def _annotate_shared(self, node: Node, cleared: set[Node]) -> None:
        x = node.args[0]
        if not self._quantizable_input(x):
            return  # float in, float out: a quantized consumer quantizes the result
        if node.target in ZERO_PAD_OPS and _pad_value(node) not in (None, 0, 0.0):
            # padding with a non-zero constant is not a value of every quantized grid
            self.report.float_ops.append(FloatOp(op_name(node.target), module_path(node)))
            return
        if node.target in SPLIT_OPS:
            self._mark(node, {x: self._input_spec(x)}, None)
            for user in node.users:
                if user.op == "call_function" and user.target is operator.getitem:
                    self._mark(user, {}, SharedQuantizationSpec((x, node)))
            return
        if not _is_float_tensor(node):
            return
        self._mark(node, {x: self._input_spec(x)}, SharedQuantizationSpec((x, node)))

    def _annotate_embedding(self, node: Node, cleared: set[Node]) -> None:
        table = node.args[0]
        if self._quantizable_input(table) and _is_float_tensor(node):
            self._mark(node, {table: self._input_spec(table)}, SharedQuantizationSpec((table, node)))

    def _annotate_own(self, node: Node, cleared: set[Node]) -> None:
        x = node.args[0]
        if not _is_float_tensor(x):
            return
        # a masked score tensor holds -inf: the softmax reads it in float
        from_select = x.op == "call_function" and x.target in FLOAT_SELECT_OPS
        quantize_input = self._quantizable_input(x) and not from_select
        self._mark(node, {x: self._input_spec(x)} if quantize_input else {}, self._act)

    def _annotate_bounded_clamp(self, node: Node, cleared: set[Node]) -> None:
        bounds = [*node.args[1:3], None, None]
        low, high = node.kwargs.get("min", bounds[0]), node.kwargs.get("max", bounds[1])
        if isinstance(low, (int, float)) and isinstance(high, (int, float)):
            self._annotate_own(node, cleared)
        else:
            self._no_rule(node)

    def _no_rule(self, node: Node) -> None:
        """A float op the annotator leaves float for want of an INT8 rule, reported as such."""
        if _is_float_tensor(node):
            self.report.float_ops.append(FloatOp(op_name(node.target), module_path(node)))

    def _annotate_float_select(self, node: Node, cleared: set[Node]) -> None:
        self.report.n_float_select += 1

    _HANDLERS = {
        "binary": _annotate_binary, "matmul": _annotate_matmul, "cat": _annotate_cat, "einsum": _annotate_einsum, "embedding": _annotate_embedding,
        "shared_scale": _annotate_shared, "own_scale": _annotate_own, "float_select": _annotate_float_select,
        "bounded_clamp": _annotate_bounded_clamp,
    }

    def validate(self, model: GraphModule) -> None:
        return None


def _named(node: Node, names: tuple[str, ...]) -> bool:
    """Whether ``names`` covers ``node``: its module or one above it, or its op (``fused_head``) by name."""
    head = fused_head(node).name
    return bool(names) and (under_modules(module_path(node), names) or any(names_match(head, n) for n in names))


def refuse_unknown_names(modules: frozenset[str], names: tuple[str, ...] | None, flag: str, ops: set[str]) -> None:
    """Refuse ``flag``'s names (``skip_activations``, ``int16``) that are neither a module (``modules``) nor an op
    of the captured graph (``ops``), and glob patterns that match none of them."""
    unknown = [n for n in names or () if n not in modules and n not in ops
               and not (is_pattern(n) and any(names_match(m, n) for m in (*modules, *ops)))]
    if unknown:
        sample = sorted(n for n in modules if "." not in n)[:12]
        raise ValueError(f"{flag} names {unknown}: neither modules of the model nor ops of its captured graph (a "
                         "glob pattern must match one); use "
                         f"names from model.named_modules(), e.g. {sample}, or the ops quantship sensitivity lists")


def activation_observer(name: str):
    """The observer constructor for an ``act_observer`` name (see ``precision.ACT_OBSERVERS``)."""
    if name == "histogram":
        return HistogramSearchObserver  # torchao's HistogramObserver, the same scales found in ms, not seconds
    if name == "minmax":
        return MinMaxObserver

    return observers.OBSERVERS[name]
