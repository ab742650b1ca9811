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
convolution partition unquantized; ``skip_activations`` keeps the activations produced under the
named modules in float (their weights stay quantized).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e import (
    FakeQuantize,
    FusedMovingAvgObsFakeQuantize,
    HistogramObserver,
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

from quantship.precision import QuantSpec

aten = torch.ops.aten
WEIGHT_BOUND = 127  # int8 weights in [-127, 127]: symmetric, zero-point 0
WEIGHT_BOUND_REDUCED = 63  # reduce_range: u8 x s8 pairs stay below 2**15 (no vpmaddubsw saturation)

# -- operator tables (the one place that says which aten op belongs to which role) -------------
WEIGHTED_OPS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.linear.default}
CONV_OPS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default}
BATCH_NORM_OPS = {
    aten.batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_no_training.default,
    aten.cudnn_batch_norm.default,
}
FUSABLE_ACTIVATIONS = {aten.relu.default, aten.relu_.default, aten.hardtanh.default, aten.hardtanh_.default}
ADD_OPS = {aten.add.Tensor, aten.add_.Tensor}
BINARY_OPS = ADD_OPS | {aten.mul.Tensor, aten.mul_.Tensor}
CAT_OPS = {aten.cat.default, aten.concat.default}
# output keeps the input's scale (no arithmetic on values, or max-selection only)
SHARED_SCALE_OPS = {
    aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
    aten.flatten.using_ints, aten.reshape.default, aten.view.default, aten._unsafe_view.default,
    aten.permute.default, aten.transpose.int, aten.squeeze.dim, aten.squeeze.dims,
    aten.unsqueeze.default, aten.dropout.default, aten.clone.default, aten.contiguous.default,
    aten.pixel_shuffle.default, aten.upsample_nearest2d.vec, aten.chunk.default,
}
# output gets its own scale
OWN_SCALE_OPS = {
    aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default, aten.avg_pool1d.default,
    aten.avg_pool2d.default, aten.mean.dim, aten.mean.default,
    aten.relu.default, aten.relu_.default, aten.hardtanh.default, aten.hardtanh_.default,
    aten.sigmoid.default, aten.sigmoid_.default, aten.hardsigmoid.default, aten.hardsigmoid_.default,
    aten.hardswish.default, aten.hardswish_.default, aten.silu.default, aten.silu_.default,
    aten.gelu.default, aten.tanh.default, aten.softmax.int, aten._softmax.default,
    aten.upsample_bilinear2d.vec,
}


def _is_float_tensor(node: object) -> bool:
    if not isinstance(node, Node):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def module_path(node: Node) -> str:
    """The dotted name of the innermost module a node was traced under ('' at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _under(path: str, names: tuple[str, ...]) -> bool:
    return any(path == n or path.startswith(n + ".") for n in names)


@dataclass
class AnnotationReport:
    """What the annotator did, for verbose output and for refusing what did not happen."""

    n_weighted: int = 0
    n_add: int = 0
    n_skipped_conv_add: int = 0
    skipped_nodes: list[str] = field(default_factory=list)
    unannotated_ops: dict[str, int] = field(default_factory=dict)


class QuantshipQuantizer(Quantizer):
    """A torchao pt2e ``Quantizer`` that applies one exportable ``QuantSpec`` (W8A8)."""

    def __init__(self, spec: QuantSpec, *, is_qat: bool = False):
        super().__init__()
        if spec.backend != "pt2e":
            raise ValueError(f"QuantshipQuantizer applies pt2e specs, got backend={spec.backend!r}")
        self.spec = spec
        self.is_qat = is_qat
        self.report = AnnotationReport()
        self._act = self._activation_qspec()
        self._weight = self._weight_qspec()

    # -- qspecs ----------------------------------------------------------------------------
    def _activation_qspec(self) -> QuantizationSpec:
        qscheme = torch.per_tensor_symmetric if self.spec.symmetric else torch.per_tensor_affine
        if self.is_qat:
            ctr = FakeQuantize.with_args(observer=MovingAverageMinMaxObserver)
        else:
            ctr = activation_observer(self.spec.act_observer or "histogram")
        return QuantizationSpec(dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=qscheme,
                                observer_or_fake_quant_ctr=ctr)

    def _weight_qspec(self) -> QuantizationSpec:
        per_channel = self.spec.qscheme == "per_channel"
        if per_channel:
            observer = MovingAveragePerChannelMinMaxObserver if self.is_qat else PerChannelMinMaxObserver
            qscheme, axis = torch.per_channel_symmetric, 0
        else:
            observer = MovingAverageMinMaxObserver if self.is_qat else MinMaxObserver
            qscheme, axis = torch.per_tensor_symmetric, None
        ctr = FusedMovingAvgObsFakeQuantize.with_args(observer=observer) if self.is_qat else observer
        bound = WEIGHT_BOUND_REDUCED if self.spec.reduce_range else WEIGHT_BOUND
        return QuantizationSpec(dtype=torch.int8, quant_min=-bound, quant_max=bound, qscheme=qscheme,
                                ch_axis=axis, observer_or_fake_quant_ctr=ctr)

    # -- annotation ------------------------------------------------------------------------
    def _skipped(self, node: Node) -> bool:
        names = self.spec.skip_activations or ()
        return bool(names) and _under(module_path(node), names)

    def _quantizable_input(self, arg: object) -> bool:
        """A float tensor not produced under a ``skip_activations`` module (those stay float even
        where a quantized op outside the module reads them)."""
        return _is_float_tensor(arg) and not (arg.op == "call_function" and self._skipped(arg))

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

    def annotate(self, model: GraphModule) -> GraphModule:
        skip_conv_add = self.spec.qdq_placement == "skip_conv_add"
        partition_end: dict[Node, Node] = {}  # last node of a conv partition -> its conv
        cleared_conv_outputs: set[Node] = set()

        if skip_conv_add:
            # decide first which conv partitions feed an add directly, so their output stays float
            for node in model.graph.nodes:
                if node.op == "call_function" and node.target in CONV_OPS:
                    chain = self._weighted_partition(node)
                    partition_end[chain[-1]] = node
            for node in model.graph.nodes:
                if node.op != "call_function" or node.target not in ADD_OPS or self._skipped(node):
                    continue
                for arg in node.args[:2]:
                    if arg in partition_end and len(arg.users) == 1 and arg not in cleared_conv_outputs:
                        cleared_conv_outputs.add(arg)
                        break

        act, weight = self._act, self._weight
        for node in model.graph.nodes:
            if node.op != "call_function" or self._annotated(node):
                continue
            target = node.target
            skipped = self._skipped(node)
            if target in WEIGHTED_OPS:
                chain = self._weighted_partition(node)
                x, w = node.args[0], node.args[1]
                # Order matters: torchao's QAT conv-bn fusion re-keys this map by position
                # (first entry = activation, second = weight); a float activation is an explicit None.
                inputs = {x: act if not skipped and self._quantizable_input(x) else None}
                if isinstance(w, Node):
                    inputs[w] = weight
                out = None if (skipped or chain[-1] in cleared_conv_outputs) else act
                self._mark(node, inputs, out if len(chain) == 1 else None)
                for later in chain[1:]:
                    self._mark(later, {}, out if later is chain[-1] else None)
                self.report.n_weighted += 1
                if skipped:
                    self.report.skipped_nodes.append(node.name)
                continue
            if skipped:
                self.report.skipped_nodes.append(node.name)
                continue
            if target in BINARY_OPS:
                if not _is_float_tensor(node):
                    continue  # e.g. BatchNorm's num_batches_tracked += 1 in a training capture
                act_after = self._single_user_next(node, FUSABLE_ACTIVATIONS)
                inputs = {}
                for arg in node.args[:2]:
                    if self._quantizable_input(arg) and arg not in cleared_conv_outputs:
                        inputs[arg] = act
                    elif arg in cleared_conv_outputs:
                        self.report.n_skipped_conv_add += 1
                self._mark(node, inputs, None if act_after else act)
                if act_after is not None:
                    self._mark(act_after, {}, act)
                if target in ADD_OPS:
                    self.report.n_add += 1
            elif target in CAT_OPS:
                tensors = [t for t in node.args[0] if _is_float_tensor(t)]
                if not tensors:
                    continue
                first = tensors[0]
                inputs = {first: act}
                inputs.update({t: SharedQuantizationSpec((first, node)) for t in tensors[1:]})
                self._mark(node, inputs, SharedQuantizationSpec((first, node)))
            elif target in SHARED_SCALE_OPS:
                x = node.args[0]
                if not self._quantizable_input(x) or not _is_float_tensor(node):
                    continue  # float in, float out: a quantized consumer quantizes the result
                self._mark(node, {x: act}, SharedQuantizationSpec((x, node)))
            elif target in OWN_SCALE_OPS:
                x = node.args[0]
                if not _is_float_tensor(x):
                    continue
                self._mark(node, {x: act} if self._quantizable_input(x) else {}, act)
            elif target is not operator.getitem and _is_float_tensor(node):
                name = str(target)
                self.report.unannotated_ops[name] = self.report.unannotated_ops.get(name, 0) + 1
        return model

    def validate(self, model: GraphModule) -> None:
        return None


def activation_observer(name: str):
    """The observer constructor for an ``act_observer`` name (see ``precision.ACT_OBSERVERS``)."""
    if name == "histogram":
        return HistogramObserver
    if name == "minmax":
        return MinMaxObserver
    from quantship.quantize import observers

    return observers.OBSERVERS[name]
