"""The pt2e backend: torch.export capture, quantship's annotator, calibration, conversion.

The converted graph is checked before it is returned: a conversion that left a float conv or
linear, or that produced no integer weight, is an error rather than a silent success.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.fx import GraphModule

from quantship.precision import QuantSpec
from quantship.quantize.annotator import WEIGHTED_OPS, QuantshipQuantizer
from quantship.quantize.calibration import run_batches

qd = torch.ops.quantized_decomposed
DEQUANT_WEIGHT_OPS = {qd.dequantize_per_channel.default, qd.dequantize_per_tensor.default}
QUANT_OPS = {qd.quantize_per_tensor.default, qd.quantize_per_channel.default,
             qd.quantize_per_tensor.tensor}


def capture(model: torch.nn.Module, example: torch.Tensor) -> GraphModule:
    """``torch.export`` the model at the example's batch size; name the failure if it cannot."""
    return _export(model, example).module()


def _export(model: torch.nn.Module, example: torch.Tensor) -> torch.export.ExportedProgram:
    try:
        return torch.export.export(model, (example,), strict=False)
    except Exception as exc:  # torch.export raises many types; all mean "cannot capture"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"pt2e could not capture {type(model).__name__} with torch.export "
            f"({type(exc).__name__}: {first}). pt2e needs a model torch.export can trace: remove "
            f"data-dependent Python control flow, or use an FX backend (backend='x86')."
        ) from exc


def check_module_names(model: torch.nn.Module, names: tuple[str, ...] | None) -> None:
    """Refuse ``skip_activations`` names that are not modules of the model."""
    if not names:
        return
    known = {n for n, _ in model.named_modules() if n}
    unknown = [n for n in names if n not in known]
    if unknown:
        sample = sorted(n for n in known if "." not in n)[:12]
        raise ValueError(
            f"skip_activations names {unknown} that are not modules of {type(model).__name__}; "
            f"use names from model.named_modules(), e.g. {sample}"
        )


def quantize_pt2e(
    model: torch.nn.Module,
    spec: QuantSpec,
    batches: list[torch.Tensor],
    *,
    log: Callable[[str], None],
    verbose: bool = False,
) -> GraphModule:
    """Post-training static quantization of ``model`` (left untouched) with ``spec``."""
    from torchao.quantization.pt2e import allow_exported_model_train_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    check_module_names(model, spec.skip_activations)
    log(f"pt2e: capturing the model with torch.export at batch size {batches[0].shape[0]}")
    graph = _capture_in_eval(model, batches[0])
    quantizer = QuantshipQuantizer(spec)
    prepared = prepare_pt2e(graph, quantizer)
    report_placement(quantizer, spec, log)
    n = sum(b.shape[0] for b in batches)
    log(f"pt2e: calibrating on {n} sample(s) in {len(batches)} batch(es) ({spec.act_observer} observer)")
    run_batches(prepared, batches, verbose=verbose)
    log("pt2e: converting to a quantized graph")
    converted = convert_pt2e(prepared)
    _unshare(converted, model)
    check_converted(converted)
    # users call .eval() on what they get back; make that a supported no-op-like switch
    allow_exported_model_train_eval(converted)
    return converted


def _capture_in_eval(model: torch.nn.Module, example: torch.Tensor) -> GraphModule:
    """Capture ``model`` in eval mode without copying it first; its train/eval flags are restored.

    The captured graph reads the model's own tensors (no copy of the weights is held). A model whose
    forward writes to its buffers is captured from a deep copy instead, so calibration cannot
    change the caller's model.
    """
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        exported = _export(model, example)
        if _writes_its_state(exported):
            exported = _export(copy.deepcopy(model), example)
    finally:
        for module, training in modes.items():
            module.training = training
    return exported.module()


def _writes_its_state(exported: torch.export.ExportedProgram) -> bool:
    """Whether the captured forward writes to one of the model's parameters or buffers."""
    signature = exported.graph_signature
    if signature.buffers_to_mutate:
        return True
    state = {*signature.inputs_to_parameters, *signature.inputs_to_buffers}
    for node in exported.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.is_mutable:
            written = [a for a, arg in zip(node.args, schema.arguments) if arg.alias_info and arg.alias_info.is_write]
            if any(_viewed_base(a).name in state for a in written if isinstance(a, torch.fx.Node)):
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


def _unshare(converted: GraphModule, model: torch.nn.Module) -> None:
    """Give ``converted`` its own copy of every tensor it still shares with ``model`` (e.g. a Linear
    bias that no folding replaced), so later changes to either model never reach the other."""
    theirs = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel()}
    for name, value in [*converted.named_parameters(), *converted.named_buffers()]:
        if value.numel() and value.untyped_storage().data_ptr() in theirs:
            owner, _, leaf = name.rpartition(".")
            module = converted.get_submodule(owner) if owner else converted
            copied = value.detach().clone()
            if isinstance(value, torch.nn.Parameter):
                copied = torch.nn.Parameter(copied, requires_grad=value.requires_grad)
            setattr(module, leaf, copied)
    for node in converted.graph.nodes:  # constants the graph reads as plain attributes
        if node.op == "get_attr":
            owner, _, leaf = node.target.rpartition(".")
            module = converted.get_submodule(owner) if owner else converted
            value = getattr(module, leaf, None)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.numel() \
                    and value.untyped_storage().data_ptr() in theirs:
                setattr(module, leaf, value.detach().clone())


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
        log(f"pt2e: activations of {len(report.skipped_nodes)} node(s) under "
            f"{list(spec.skip_activations)} stay float")
    if report.unannotated_ops:
        log(f"pt2e: left in float (no INT8 rule): {report.unannotated_ops}")


def check_converted(graph: GraphModule) -> dict[str, int]:
    """Count quantized weights; refuse a graph in which a conv/linear still reads a float weight."""
    n_quantized, float_ops = 0, []
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target in WEIGHTED_OPS:
            w = node.args[1]
            if getattr(w, "op", None) == "call_function" and w.target in DEQUANT_WEIGHT_OPS:
                n_quantized += 1
            else:
                float_ops.append(node.name)
    if n_quantized == 0:
        raise ValueError(
            "pt2e conversion produced no integer weight: the model has no conv or linear layer the "
            "annotator quantizes, so the result would be a float model under a W8A8 label"
        )
    if float_ops:
        raise ValueError(f"pt2e conversion left float conv/linear node(s) {float_ops}; refusing a partial result")
    return {"n_quantized_weights": n_quantized}


def quantize(model, spec, batches, *, log, verbose=False):
    """Backend entry point used by ``Quantizer`` (static PTQ)."""
    return quantize_pt2e(model, spec, batches, log=log, verbose=verbose)
