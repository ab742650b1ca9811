"""The pt2e backend: torch.export capture, quantship's annotator, calibration, conversion.

The converted graph is checked before it is returned: a conversion that left a float conv or
linear, or that produced no integer weight, is an error rather than a silent success.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection

import torch
from torch.fx import GraphModule

from quantship.errors import SpecRefused
from quantship.heap import forget_module_caches, give_back, large_blocks_mapped, module_bytes
from quantship.precision import ALGORITHMS_ATTRIBUTE, QuantSpec
from quantship.progress import step
from quantship.quantize import bias_correction as bias_correcting
from quantship.quantize import rounding
from quantship.quantize.annotator import WEIGHTED_OPS, AnnotationReport, QuantshipQuantizer
from quantship.quantize.calibration import run_batches
from quantship.quantize.capture import Capture, capture, carry_static_batch
from quantship.quantize.conv_bn_fold import fold_what_can_match
from quantship.quantize.distributed import merge_observers  # no-op outside a process group
from quantship.targets import Target

qd = torch.ops.quantized_decomposed
DEQUANT_WEIGHT_OPS = {qd.dequantize_per_channel.default, qd.dequantize_per_tensor.default}
QUANT_OPS = {qd.quantize_per_tensor.default, qd.quantize_per_channel.default,
             qd.quantize_per_tensor.tensor}
REPORT_ATTRIBUTE = "_quantship_annotation"  # where a converted model carries its AnnotationReport
MERGE_ATTRIBUTE = "_quantship_merge"  # ... and its observers' MergeReport, calibrated across ranks


def annotation_report(model: object) -> AnnotationReport | None:
    """What the annotator did to a pt2e model quantship produced (None for any other model)."""
    report = getattr(model, REPORT_ATTRIBUTE, None)
    return report if isinstance(report, AnnotationReport) else None


def module_names(model: torch.nn.Module) -> frozenset[str]:
    """The model's module names: a ``skip_activations`` or ``int16`` name that is none of them must name an op of
    the captured graph (``annotator.refuse_unknown_names``, at annotation)."""
    return frozenset(n for n, _ in model.named_modules() if n)


def quantize_pt2e(
    model: torch.nn.Module,
    spec: QuantSpec,
    batches: list[torch.Tensor],
    *,
    log: Callable[[str], None],
    verbose: bool = False,
    strict: bool = False,
    bias_correction: bool = False,
    seq_mse: bool = False,
    adaround_iterations: int = 0,
    target: Target | None = None,
) -> GraphModule:
    """Post-training static quantization of ``model`` (left untouched) with ``spec``.

    ``strict``: refuse a model with an op the annotator has no INT8 rule for (listed by module),
    instead of quantizing around it. ``bias_correction``: each conv / linear bias of the converted graph
    corrected against the calibrated float graph (``quantize.bias_correction``), recorded on the result.
    ``seq_mse`` / ``adaround_iterations`` (> 0): each conv / linear weight's scale searched / rounding learned
    against the same float graph (``quantize.rounding``), before bias correction; recorded the same way.
    ``target``: the preset's target; one that runs mixed graphs gives the annotator its placement knowledge
    (``QuantshipQuantizer``: its float rules, pairs only where integer kernels read them, functions of one
    tensor quantized at their output, a written-out hard swish as one ``aten.hardswish`` where faster).
    """
    from torchao.quantization.pt2e import allow_exported_model_train_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    log("pt2e: capturing the model with torch.export (symbolic batch dimension)")
    with step("quantize: capture (torch.export)"):
        captured = capture_untouched(model, batches[0], log=log)
    check_batch_sizes(captured, batches)
    quantizer = QuantshipQuantizer(spec, target=target, modules=module_names(model))
    with step("quantize: insert observers (prepare_pt2e)"):
        prepared = prepare_pt2e(captured.graph, quantizer)
    report_placement(quantizer, spec, log)
    if strict:
        refuse_float_ops(quantizer.report, type(model).__name__)
    n = sum(b.shape[0] for b in batches)
    log(f"pt2e: calibrating on {n} sample(s) in {len(batches)} batch(es) ({spec.act_observer} observer)")
    run_batches(prepared, batches, verbose=verbose)

    if (merged := merge_observers(prepared, n_samples=n)) is not None:
        log(f"pt2e: merged {merged.n_observers} observer(s) across ranks ({merged.n_floats} floats, {merged.seconds:.3f} s)")
    rounds = seq_mse or adaround_iterations > 0
    reference = bias_correcting.float_reference(prepared) if bias_correction or rounds else None
    log("pt2e: converting to a quantized graph")
    with large_blocks_mapped(module_bytes(model)):
        with step("quantize: convert (convert_pt2e)"), fold_what_can_match(prepared, qat=False):
            converted = convert_pt2e(prepared)
        carry_static_batch(captured.graph, converted)
        drop_unread_tensors(converted)
        weights_read_where_used(converted)
        unshare(converted, model)
        forget_module_caches()
    give_back()  # convert's float copies of the weights, freed: about the int8 model's size again at 2 GB of float
    check_converted(converted, {*quantizer.report.kept_float, *quantizer.report.skipped_nodes})
    algorithms: dict[str, dict] = {}
    if rounds:
        with step("quantize: weight rounding"):
            algorithms.update(rounding.round_weights(converted, reference, batches, seq_mse=seq_mse,
                                                     adaround_iterations=adaround_iterations))
        for name, record in algorithms.items():
            log(f"pt2e: {name}: {record['n_layers']} layer(s) on {record['samples']} sample(s), output error "
                f"x{record['error_ratio']:.3f} of nearest rounding, {len(record['skipped'])} skipped")
    if bias_correction:
        with step("quantize: bias correction"):
            corrected = bias_correcting.correct(converted, reference, batches)
        log(f"pt2e: bias correction: {corrected.n_corrected} layer(s) corrected ({corrected.n_added} bias(es) added) "
            f"in {corrected.n_passes} pass(es) on {corrected.samples} sample(s), largest shift {corrected.max_shift:.3g}")
        algorithms["bias_correction"] = corrected.as_dict()
    if algorithms:
        setattr(converted, ALGORITHMS_ATTRIBUTE, algorithms)
    # users call .eval() on what they get back; make that a supported no-op-like switch
    allow_exported_model_train_eval(converted)
    setattr(converted, REPORT_ATTRIBUTE, quantizer.report)
    if merged is not None:
        setattr(converted, MERGE_ATTRIBUTE, merged)
    return converted


def capture_untouched(model: torch.nn.Module, example: torch.Tensor, *, log: Callable[[str], None]) -> Capture:
    """Capture ``model`` in eval mode, leaving it as it was, without copying its weights.

    The capture runs on a copy of the modules and their Python state that shares the registered
    parameters and buffers (the weights are not duplicated), so neither ``.eval()`` nor a forward
    that changes a Python attribute reaches the caller's model. A forward that writes to one of its
    tensors in place (a counter buffer, a cache) would write the caller's tensors during
    calibration: such a model is captured again from a full deep copy.
    """
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    said: list[str] = []
    captured = capture(copy.deepcopy(model, memo=dict(shared)).eval(), example, log=said.append)
    if writes_its_state(captured.graph):
        del captured
        return capture(copy.deepcopy(model).eval(), example, log=log)
    for line in said:
        log(line)
    return captured


def writes_its_state(graph: GraphModule) -> bool:
    """Whether the captured forward writes in place to a tensor the module holds (a parameter, buffer or
    constant, possibly through a view of it)."""
    for node in graph.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        written = [a for a, arg in zip(node.args, schema.arguments) if arg.alias_info and arg.alias_info.is_write]
        if any(_viewed_base(a).op == "get_attr" for a in written if isinstance(a, torch.fx.Node)):
            return True
    return False


def _viewed_base(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor a chain of views (select, slice, view...) reads, so a write through a view is seen."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            break
        node = node.args[0]
    return node


def drop_unread_tensors(converted: GraphModule) -> None:
    """Delete the parameters and buffers no node of ``converted``'s graph reads. convert_pt2e writes each
    quantized weight as a new int8 constant and leaves the float one registered where it was: a 2 GB float
    encoder's quantized model held its 2 GB of float weights beside its 0.5 GB of int8 ones (and ``unshare``
    then copied them), bench/scale.py's PyTorch rows."""
    read = {n.target for n in converted.graph.nodes if n.op == "get_attr"}
    called = [f"{n.target}." for n in converted.graph.nodes if n.op == "call_module"]
    named = [*converted.named_parameters(remove_duplicate=False), *converted.named_buffers(remove_duplicate=False)]
    for name, _ in named:
        if name not in read and not name.startswith(tuple(called)):
            owner, _, leaf = name.rpartition(".")
            module = converted.get_submodule(owner) if owner else converted
            if hasattr(module, leaf):  # a tied alias may be gone already
                delattr(module, leaf)


def weights_read_where_used(converted: GraphModule) -> None:
    """Reorder ``converted``'s graph so that each value computed from stored tensors only (a weight's
    DequantizeLinear and the constants it reads) comes right before the first node that reads it. convert_pt2e
    leaves them at the top of the graph, so a forward held every weight in float at once (0.75 GB more for a
    0.5 GB float encoder, bench/scale.py's PyTorch rows), and the exported file keeps that order."""
    graph = converted.graph
    constant: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr" or (node.op == "call_function" and node.all_input_nodes
                                     and all(a in constant for a in node.all_input_nodes)):
            constant.add(node)
    order: list[torch.fx.Node] = []
    placed: set[torch.fx.Node] = set()

    def place(node: torch.fx.Node) -> None:
        if node in placed:
            return
        for source in node.all_input_nodes:
            if source in constant:
                place(source)
        placed.add(node)
        order.append(node)

    nodes = list(graph.nodes)
    for node in nodes:
        if node not in constant:
            place(node)
    unread = [n for n in nodes if n not in placed]  # constants nothing reads: before the output, as they were
    order[-1:-1] = unread
    for before, node in zip(order, order[1:]):
        before.append(node)
    graph.lint()
    converted.recompile()


def unshare(converted: GraphModule, model: torch.nn.Module) -> None:
    """Give ``converted`` its own copy of every tensor it still shares with ``model`` (e.g. a Linear
    bias that no folding replaced), so later changes to either model never reach the other."""
    theirs = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel()}
    copies: dict[int, torch.Tensor] = {}  # one copy per shared tensor: tied names stay tied

    def own(module: torch.nn.Module, leaf: str, value: torch.Tensor) -> None:
        if id(value) not in copies:
            copied = value.detach().clone()
            if isinstance(value, torch.nn.Parameter):
                copied = torch.nn.Parameter(copied, requires_grad=value.requires_grad)
            copies[id(value)] = copied
        setattr(module, leaf, copies[id(value)])

    named = [*converted.named_parameters(remove_duplicate=False), *converted.named_buffers(remove_duplicate=False)]
    for name, value in named:
        if value.numel() and value.untyped_storage().data_ptr() in theirs:
            owner, _, leaf = name.rpartition(".")
            own(converted.get_submodule(owner) if owner else converted, leaf, value)
    for node in converted.graph.nodes:  # constants the graph reads as plain attributes
        if node.op == "get_attr":
            owner, _, leaf = node.target.rpartition(".")
            module = converted.get_submodule(owner) if owner else converted
            value = getattr(module, leaf, None)
            if isinstance(value, torch.Tensor) and value.numel() and value.untyped_storage().data_ptr() in theirs:
                own(module, leaf, value)


def check_batch_sizes(captured: Capture, batches: list[torch.Tensor]) -> None:
    """A graph captured at a static batch runs that batch only: refuse calibration batches of other sizes."""
    if captured.symbolic:
        return
    sizes = sorted({int(b.shape[0]) for b in batches}, reverse=True)
    if len(sizes) > 1:
        raise ValueError(
            f"calibration batches have sizes {', '.join(map(str, sizes))}, but the graph was captured at a static "
            f"batch of {captured.static_batch} ({captured.reason}). Make the model's batch symbolic, or drop "
            "the batches of other sizes (DataLoader(drop_last=True))."
        )


def describe_float_ops(report: AnnotationReport) -> str:
    """``module: op, op; module: op`` for the ops left float (module paths, never node names)."""
    return "; ".join(f"{module}: {', '.join(ops)}" for module, ops in report.float_ops_by_module().items())


def refuse_float_ops(report: AnnotationReport, model_name: str) -> None:
    """strict=True: an op without an INT8 rule is an error, named with its module."""
    if report.float_ops:
        raise ValueError(
            f"strict=True: {model_name} has {len(report.float_ops)} op(s) the INT8 annotator has no rule for, "
            f"which would stay float: {describe_float_ops(report)}. Use strict=False to quantize around them "
            "(Quantizer.report names them), or replace those modules"
        )


def report_placement(quantizer: QuantshipQuantizer, spec: QuantSpec, log: Callable[[str], None]) -> None:
    """Say what the placement did, and refuse a placement that did nothing."""
    report = quantizer.report
    if spec.qdq_placement == "skip_conv_add":
        if report.n_skipped_conv_add == 0:
            raise ValueError(
                "qdq_placement='skip_conv_add' found no addition fed by a single-user convolution "
                f"in this model ({report.n_add} addition(s) seen); use qdq_placement='per_op'"
            )
        log(f"pt2e: qdq_placement='skip_conv_add' cleared {report.n_skipped_conv_add} of "
            f"{report.n_add} addition(s): their convolution addend stays at accumulator precision")
    if spec.skip_activations:
        log(f"pt2e: {len(report.skipped_nodes)} node(s) under {list(spec.skip_activations)} stay float "
            "(weighted ops: their weights too)")
    if report.n_float_select:
        log(f"pt2e: {report.n_float_select} attention mask selection(s) stay float by design (a quantized -inf "
            "is finite); the softmax after each reads float scores")
    if report.float_ops:
        log(f"pt2e: left in float (no INT8 rule), by module: {describe_float_ops(report)}")


def check_converted(graph: GraphModule, kept_float: Collection[str] = ()) -> dict[str, int]:
    """Count quantized weights; refuse a graph in which a conv/linear still reads a float weight, other than
    those the target's float rules or ``skip_activations`` keep float (``kept_float``: node names)."""
    n_quantized, float_ops = 0, []
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target in WEIGHTED_OPS and node.name not in kept_float:
            w = node.args[1]
            if getattr(w, "op", None) == "call_function" and w.target in DEQUANT_WEIGHT_OPS:
                n_quantized += 1
            else:
                float_ops.append(node.name)
    if n_quantized == 0:
        raise SpecRefused(
            "pt2e conversion produced no integer weight: the model has no conv or linear layer the "
            "annotator quantizes (or every one is kept float), so the result would be a float model under a W8A8 label"
        )
    if float_ops:
        raise ValueError(f"pt2e conversion left float conv/linear node(s) {float_ops}; refusing a partial result")
    return {"n_quantized_weights": n_quantized}


def quantize(model, spec, batches, *, log, verbose=False, strict=False, bias_correction=False, seq_mse=False,
             adaround_iterations=0, target=None):
    """Backend entry point used by ``Quantizer`` (static PTQ)."""
    return quantize_pt2e(model, spec, batches, log=log, verbose=verbose, strict=strict,
                         bias_correction=bias_correction, seq_mse=seq_mse, adaround_iterations=adaround_iterations,
                         target=target)
