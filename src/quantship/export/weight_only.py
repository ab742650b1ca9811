"""Weight-only INT8 / INT4 (torchao W8A16, W4A16) to ONNX, in a standard and an ONNX Runtime form.

The float twin of the quantized model (each quantized Linear given exactly the weight torchao
multiplies by) is exported by the dynamo exporter; each such weight initializer, found by its
bytes, is then replaced by torchao's own integer data and scales:

- standard form (default): an int8 / int4 initializer and a ``DequantizeLinear`` (per axis, or
  block-wise with ``block_size`` for grouped scales; opset 21) feeding the float MatMul/Gemm. The
  rewrite is exact: ONNX Runtime returns the float twin's outputs byte for byte.
- ``target='onnxruntime-cpu'``: each MatMul/Gemm becomes a ``com.microsoft.MatMulNBits`` node
  holding the same codes and scales, which ONNX Runtime runs with its low-bit kernels. Checked
  against the standard form and the torch model.

A quantized token embedding (``quantize_embedding``) is a table a Gather reads: ``export.embedding``
points its Gather (and a tied LM head) at one stored copy, in either form.

Both are checked against the torch weight-only model (``WEIGHT_ONLY_RTOL``) and written atomically.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from quantship import targets
from quantship.export import artifact, capture, embedding
from quantship.export.checks import ExportRefused, check_model, check_runs_optimized
from quantship.export.ir_edit import MS_DOMAIN
from quantship.export.metadata import strip_source_metadata, write_metadata
from quantship.export.named_outputs import check_outputs_line_up, graph_output_names, reference_outputs
from quantship.inspect.run.consumers import session_of
from quantship.inspect.run.weight_only import WEIGHT_ONLY_RTOL, relative_error  # the one tolerance, the one measure
from quantship.precision import QuantSpec
from quantship.targets import Target

WEIGHT_ONLY_METHODS = ("int8_weight_only", "int4_weight_only")
WEIGHT_ONLY_OPSET = 21  # block-wise DequantizeLinear and int4 tensors
NBITS_FORM = "MatMulNBits"  # a Target's weight_only_form this exporter writes (com.microsoft)
FORMAT_KEY = "quantship.weight_format"
_MIN_NBITS_BLOCK = 16  # MatMulNBits: block_size a power of two, at least 16
FAST_ACCURACY_LEVEL = 4  # MatMulNBits' accuracy_level with int8 activations (quantized per block inside the kernel)
FLOAT_REFERENCE = "float_reference.onnx"  # the float export, saved beside the staged file for ``before_commit``


def is_weight_only(spec: QuantSpec | None) -> bool:
    return spec is not None and spec.backend == "torchao" and spec.method in WEIGHT_ONLY_METHODS


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized Linear weight as torchao holds it, in numpy: codes, scales, zero-points."""

    layer: str
    codes: np.ndarray  # int8 [N, K]; int4 values lie in [-8, 7]
    scale: np.ndarray  # float32 [N, K // group]
    zero_point: np.ndarray | None  # int8 [N, K // group], None when every zero-point is 0
    bits: int
    group: int  # K for one scale per output channel
    dequantized: np.ndarray  # float32 [N, K]: torchao's dequantize(), what torch multiplies by
    embedding: bool = False  # a token embedding's table [vocab, hidden] (read by a Gather), not a Linear weight

    @property
    def per_channel(self) -> bool:
        return self.group == self.codes.shape[1]

    @functools.cached_property
    def digests(self) -> tuple[str, str]:
        """The dequantized tensor's digest as stored and transposed: how ``locate`` finds it in the exported graph
        and ``check_written`` finds a float copy of it (computed once for both)."""
        return _digest(self.dequantized), _digest(self.dequantized.T)


def read_weights(model: Any) -> list[QuantizedWeight]:
    """Every torchao-quantized Linear weight and token embedding table of ``model``; refuses layouts this module
    cannot write."""
    import torch
    import torch.nn as nn
    from torchao.utils import TorchAOBaseTensor

    out = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, (nn.Linear, nn.Embedding)) or not isinstance(weight, TorchAOBaseTensor):
            continue
        codes, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
        block = tuple(getattr(weight, "block_size", ()) or ())
        if codes is None or scale is None or codes.dtype != torch.int8 or len(block) != 2 or block[0] != 1:
            raise ValueError(f"export_qdq: layer {name!r} holds a {type(weight).__name__} whose layout "
                             "(qdata/scale/block_size) is not the int8-unpacked one this exporter reads")
        n, k = codes.shape
        group = int(block[1])
        scale = scale.detach().float().reshape(n, k // group).numpy()
        zp = getattr(weight, "zero_point", None)
        zp = None if zp is None else zp.detach().to(torch.int8).reshape(n, k // group).numpy()
        if zp is not None and not zp.any():
            zp = None
        bits = 4 if getattr(weight, "target_dtype", None) == torch.int4 else 8
        codes_np = codes.detach().numpy()
        deq = weight.dequantize().detach().float().numpy()
        ours = _dequantize(codes_np, scale, zp, group)
        if ours.tobytes() != deq.tobytes():
            raise ExportRefused(f"export_qdq: layer {name!r}: (codes - zero_point) * scale does not reproduce "
                                f"torchao's dequantized weight exactly ({np.abs(ours - deq).max():.3g} off)")
        if isinstance(module, nn.Embedding) and zp is not None:
            raise ExportRefused(f"export_qdq: the token embedding {name!r} carries zero-points; tables are written "
                                "symmetric only (quantize_embedding=False keeps it float)")
        out.append(QuantizedWeight(name, codes_np, scale, zp, bits, group, deq, isinstance(module, nn.Embedding)))
    if not out:
        raise ValueError(f"export_qdq: {type(model).__name__} holds no torchao-quantized Linear weight; quantize "
                         "it with quantship.Quantizer(backend='torchao', method='int8_weight_only') first")
    return out


def _dequantize(codes: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, group: int) -> np.ndarray:
    shifted = codes.astype(np.float32)
    if zp is not None:
        shifted = shifted - np.repeat(zp.astype(np.float32), group, axis=1)
    return shifted * np.repeat(scale, group, axis=1)


def float_twin(model: Any, weights: list[QuantizedWeight]) -> Any:
    """A copy of ``model`` whose quantized weights are plain float tensors of the same values; layers holding one
    tensor (a token embedding and its tied LM head) share one, so the export stores it once."""
    import torch

    twin = copy.deepcopy(model)
    shared: dict[int, torch.nn.Parameter] = {}
    for w in weights:
        key = id(model.get_submodule(w.layer).weight)
        if key not in shared:
            shared[key] = torch.nn.Parameter(torch.from_numpy(w.dequantized.copy()), requires_grad=False)
        twin.get_submodule(w.layer).weight = shared[key]
    return twin.eval()


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest() + str(array.shape)


def locate(model: ir.Model, weights: list[QuantizedWeight]) -> list[tuple[QuantizedWeight, ir.Value, bool]]:
    """(weight, initializer, transposed) for every initializer holding a quantized weight, found by its bytes.

    The exporter may keep a weight as [N, K] (Gemm with transB) or fold its transpose into a [K, N]
    initializer (MatMul); both orientations are looked up. Layers holding one tensor (a tied token embedding and
    LM head) are found in one initializer, reported once. A layer found nowhere is refused.
    """
    wanted: dict[str, tuple[QuantizedWeight, bool]] = {}
    for w in weights:
        wanted.setdefault(w.digests[0], (w, False))
        wanted.setdefault(w.digests[1], (w, True))
    found, seen = [], set()
    for value in list(model.graph.initializers.values()):
        tensor = value.const_value
        if tensor is None or tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2:
            continue
        digest = _digest(tensor.numpy())
        hit = wanted.get(digest)
        if hit is not None:
            found.append((hit[0], value, hit[1]))
            seen.add(digest)
    missing = [w.layer for w in weights if not seen & set(w.digests)]
    if missing:
        raise ExportRefused(f"export_qdq: the weights of {missing} are not initializers of the exported graph "
                            "(the exporter transformed them), so they cannot be stored as integers")
    return found


def _initializer(model: ir.Model, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.Tensor(array, name=name))
    model.graph.register_initializer(value)
    return value


def _replace_initializer(model: ir.Model, old: ir.Value, node: ir.Node) -> None:
    """Feed ``old``'s consumers from ``node``'s output instead, and drop ``old``."""
    ir.convenience.replace_all_uses_with(old, node.outputs[0])
    model.graph.initializers.pop(old.name)
    model.graph.insert_before(model.graph[0], node)


def to_dequantize_linear(model: ir.Model, found: list[tuple[QuantizedWeight, ir.Value, bool]]) -> int:
    """Standard form: each weight initializer becomes int codes + scales -> DequantizeLinear (a table read by a
    Gather: ``embedding.dequantize_table``)."""
    for i, (w, value, transposed) in enumerate(embedding.one_copy(model, found)):
        base = value.name
        codes = w.codes.astype(ml_dtypes.int4) if w.bits == 4 else w.codes
        if embedding.is_table(value):
            if transposed or w.zero_point is not None:
                raise ExportRefused(f"export_qdq: the table {value.name!r} ({w.layer}) is stored transposed or with "
                                    "zero-points; a Gather reads it as [rows, width], symmetric")
            embedding.dequantize_table(model, value, _initializer(model, f"{base}_q{w.bits}", codes),
                                       _initializer(model, f"{base}_scale", w.scale), w.group, i)
            continue
        scale, zp = (w.scale[:, 0], w.zero_point) if w.per_channel else (w.scale, w.zero_point)
        if w.per_channel and zp is not None:
            zp = zp[:, 0]
        if zp is not None and w.bits == 4:
            zp = zp.astype(ml_dtypes.int4)
        if transposed:
            codes, scale = codes.T.copy(), scale.T.copy()
            zp = None if zp is None else zp.T.copy()
        attrs: dict[str, Any] = {"axis": (1 if transposed else 0) if w.per_channel else (0 if transposed else 1)}
        if not w.per_channel:
            attrs["block_size"] = w.group
        inputs = [_initializer(model, f"{base}_q{w.bits}", codes), _initializer(model, f"{base}_scale", scale)]
        if zp is not None:
            inputs.append(_initializer(model, f"{base}_zero_point", zp))
        node = ir.node("DequantizeLinear", inputs, attributes=attrs, name=f"weight_dequantize_{i}")
        node.outputs[0].name = f"{base}_dequantized"
        _replace_initializer(model, value, node)
    model.opset_imports[""] = max(model.opset_imports.get("", 0), WEIGHT_ONLY_OPSET)
    return len(found)


def nbits_block(w: QuantizedWeight) -> int:
    """MatMulNBits block size: the group, or for one scale per channel a power of two the scale repeats over."""
    if not w.per_channel:
        if w.group < _MIN_NBITS_BLOCK:
            raise ValueError(f"export_qdq(target='onnxruntime-cpu'): layer {w.layer!r} has groups of {w.group}; "
                             f"MatMulNBits needs blocks of at least {_MIN_NBITS_BLOCK}. Quantize with "
                             "group_size >= 16, or export the standard form (no target)")
        return w.group
    k = w.codes.shape[1]
    return max(_MIN_NBITS_BLOCK, min(128, 1 << (k - 1).bit_length()))


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes packed low nibble first along the last axis (4 bits), or as they are (8 bits)."""
    u = codes.astype(np.uint8)
    if bits == 8:
        return u
    if u.shape[-1] % 2:
        u = np.concatenate([u, np.zeros(u.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (u[..., 0::2] & 0x0F) | (u[..., 1::2] << 4)


def nbits_tensors(w: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """(B [N, blocks, blob], scales [N, blocks], packed zero-points or None, block) in MatMulNBits layout."""
    n, k = w.codes.shape
    block = nbits_block(w)
    blocks = -(-k // block)
    offset = 1 << (w.bits - 1)  # MatMulNBits codes are unsigned; its default zero-point is 2**(bits-1)
    if w.per_channel:
        scale = np.repeat(w.scale, blocks, axis=1)
        zp = None if w.zero_point is None else np.repeat(w.zero_point, blocks, axis=1)
    else:
        scale, zp = w.scale, w.zero_point
    codes = w.codes.astype(np.int16) + offset
    pad = blocks * block - k
    if pad:  # padded codes sit at the zero-point: they dequantize to 0 (and ORT ignores them)
        fill = offset if zp is None else int(zp[0, -1]) + offset
        codes = np.concatenate([codes, np.full((n, pad), fill, np.int16)], axis=1)
    b = _pack(codes.reshape(n, blocks, block), w.bits)
    packed_zp = None if zp is None else _pack((zp.astype(np.int16) + offset), w.bits).reshape(-1)
    return b, np.ascontiguousarray(scale, np.float32), packed_zp, block


def _gemm_is_plain(node: ir.Node) -> bool:
    attr = {k: v.value for k, v in node.attributes.items()}
    return attr.get("transA", 0) == 0 and attr.get("transB", 0) == 1 and attr.get("alpha", 1.0) == 1.0 \
        and attr.get("beta", 1.0) == 1.0


def to_matmul_nbits(model: ir.Model, found: list[tuple[QuantizedWeight, ir.Value, bool]]) -> int:
    """ONNX Runtime form: each MatMul/Gemm reading a quantized weight becomes one MatMulNBits node; a Gather of a
    table's rows becomes GatherBlockQuantized (``embedding.gather_block_quantized``), over the same stored codes
    and scales as a tied head's MatMulNBits. Returns the number of MatMulNBits nodes."""
    n_nodes = 0
    for i, (w, value, transposed) in enumerate(embedding.one_copy(model, found)):
        n, k = w.codes.shape
        b, scale, zp, block = nbits_tensors(w)
        stored: dict[str, ir.Value] = {}  # B, scales, zero-points: written once, read by every node of this weight
        tables = embedding.table_reads(value)
        for user, index in list(value.uses()):
            if user in tables:
                continue
            if transposed and user.op_type == "MatMul" and index == 1:
                a, bias, out = user.inputs[0], None, user.outputs[0]
                drop = [user]
            elif not transposed and user.op_type == "Gemm" and index == 1 and _gemm_is_plain(user):
                a, bias, out = user.inputs[0], (user.inputs[2] if len(user.inputs) > 2 else None), user.outputs[0]
                drop = [user]
            elif not transposed and user.op_type == "Transpose" and len(user.outputs[0].uses()) == 1 \
                    and next(iter(user.outputs[0].uses()))[0].op_type == "MatMul":
                mm = next(iter(user.outputs[0].uses()))[0]
                a, bias, out = mm.inputs[0], None, mm.outputs[0]
                drop = [mm, user]
            else:
                raise ExportRefused(f"export_qdq(target='onnxruntime-cpu'): layer {w.layer!r} is read by a "
                                    f"{user.op_type} node that MatMulNBits cannot replace; export the standard form")
            if not stored:
                base = f"{value.name}_{n_nodes}"
                stored["b"] = _initializer(model, f"{base}_q{w.bits}_packed", b)
                stored["scale"] = _initializer(model, f"{base}_scale", scale)
                if zp is not None:
                    stored["zero_point"] = _initializer(model, f"{base}_zero_point", zp)
            inputs = [a, stored["b"], stored["scale"], stored.get("zero_point")]
            if bias is not None:
                inputs += [None, bias]
            while inputs and inputs[-1] is None:
                inputs.pop()
            node = ir.node("MatMulNBits", inputs, domain=MS_DOMAIN, name=f"matmul_nbits_{i}_{n_nodes}",
                           attributes={"K": k, "N": n, "bits": w.bits, "block_size": block})
            node.outputs[0].type, node.outputs[0].shape = out.type, out.shape
            node.metadata_props.update(drop[0].metadata_props)  # the module it came from (name_scopes)
            ir.convenience.replace_all_uses_with(out, node.outputs[0], replace_graph_outputs=True)
            name = out.name
            model.graph.insert_before(drop[0], node)
            for old in drop:
                model.graph.remove(old, safe=True)
            node.outputs[0].name = name
            n_nodes += 1
        if tables:
            if transposed or zp is not None:
                raise ExportRefused(f"export_qdq(target='onnxruntime-cpu'): the table {value.name!r} ({w.layer}) is "
                                    "stored transposed or with zero-points; GatherBlockQuantized reads it as [rows, "
                                    "width], symmetric")
            if stored:  # a tied head's MatMulNBits holds the codes: the table reads its B
                data, table_scale = stored["b"], stored["scale"]
            else:
                data = _initializer(model, f"{value.name}_q{w.bits}_rows", _pack(w.codes.astype(np.int16)
                                                                                 + (1 << (w.bits - 1)), w.bits))
                table_scale = _initializer(model, f"{value.name}_scale", scale)
            for j, gather in enumerate(tables):
                embedding.gather_block_quantized(model, gather, data, table_scale, bits=w.bits, block=block, width=k,
                                                 name=f"gather_block_quantized_{i}_{j}")
        model.graph.initializers.pop(value.name)
    model.opset_imports[MS_DOMAIN] = 1
    return n_nodes


def set_accuracy_level(model: ir.Model, level: int) -> int:
    """Set MatMulNBits' ``accuracy_level`` (0 float activations ... 4 int8 activations) on every such node (the
    decoder files' writer uses it too)."""
    nodes = [n for n in model.graph if n.op_type == "MatMulNBits"]
    for node in nodes:
        node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", level)
    return len(nodes)


def run_literal(model: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """ORT with no graph optimization and no weight prepacking: a MatMul multiplies the same way whether
    its weight is an initializer or a DequantizeLinear output (prepacked GEMMs accumulate in another order)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry("session.disable_prepacking", "1")
    session = session_of(model, options)
    return session.run(None, dict(zip([i.name for i in session.get_inputs()], inputs)))


def _check_exact(model: onnx.ModelProto, reference: list[np.ndarray], inputs: list[np.ndarray], what: str) -> None:
    try:
        outputs = run_literal(model, inputs)
    except Exception as exc:  # ORT raises its own exception types; all mean "does not run"
        raise ExportRefused(f"{what}: ONNX Runtime cannot run the rewritten graph ({type(exc).__name__}: {exc})") from exc
    for i, (got, ref) in enumerate(zip(outputs, reference)):
        if got.shape != ref.shape or got.tobytes() != ref.tobytes():
            raise ExportRefused(f"{what}: output {i} is not byte-identical to the float export "
                                f"(max abs difference {relative_error(got, ref) * np.abs(ref).max():.3g}); refused")


def check_close(outputs: list[np.ndarray], reference: list[np.ndarray], what: str, against: str,
                names: list[str] | None = None) -> float:
    """Each output within ``WEIGHT_ONLY_RTOL`` of ``reference`` (relative to its largest value), else refused
    naming the output (``names``, default its index); the worst error."""
    worst = 0.0
    for i, (got, ref) in enumerate(zip(outputs, reference)):
        name = names[i] if names is not None else i
        if got.shape != ref.shape:
            raise ExportRefused(f"{what}: output {name} has shape {got.shape}, {against} {ref.shape}")
        error = relative_error(got, ref)
        if not error <= WEIGHT_ONLY_RTOL:  # a NaN error is refused too
            raise ExportRefused(f"{what}: output {name} differs from {against} by {error:.2e} (relative to its largest "
                                f"value), above the {WEIGHT_ONLY_RTOL:g} the exporter guarantees; nothing was written")
        worst = max(worst, error)
    return worst


def check_targets(target: Target | None) -> None:
    """None writes the standard DequantizeLinear form; a target must have a weight-only form of its own."""
    if target is not None and target.weight_only_form != NBITS_FORM:
        valid = " or ".join(repr(t.name) for t in targets.ALL if t.weight_only_form == NBITS_FORM)
        raise ValueError(f"export_qdq: target={target.name!r} for a weight-only model; valid: None (standard "
                         f"DequantizeLinear form) or {valid} (com.microsoft {NBITS_FORM})")


def export_weight_only(
    model: Any,
    sample: Any,
    path: str | Path,
    spec: QuantSpec,
    *,
    opset_version: int = WEIGHT_ONLY_OPSET,
    target: Target | None = None,
    dynamic_batch: bool = False,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    accuracy_level: int | None = None,
    before_commit: Callable[[Path, Path], None] | None = None,
) -> Path:
    """Write a torchao weight-only model at ``path``: the standard form, or MatMulNBits for ONNX Runtime CPU.

    The standard form declares opset ``max(opset_version, 21)`` (block-wise and int4 DequantizeLinear
    need 21). ``accuracy_level`` (MatMulNBits only; None: the attribute unset, i.e. 0) is written on every
    MatMulNBits node after the file is checked at level 0 (the codes and scales, within ``WEIGHT_ONLY_RTOL``
    of torch). ``before_commit(staged, float_file)``: called on the checked file before it is moved into
    place, with the float export (the same graph, float weights) saved beside it; what it raises aborts
    the write. Refusals raise ``ValueError`` and leave nothing at ``path``.
    """
    artifact.refuse_unsafe_destination(path)
    check_targets(target)
    nbits_form = target is not None  # check_targets let through a target whose form is MatMulNBits only
    if accuracy_level is not None and (not nbits_form or accuracy_level not in range(5)):
        raise ValueError(f"export_qdq: accuracy_level={accuracy_level!r} is MatMulNBits' attribute, 0 to 4: give "
                         "target='onnxruntime-cpu' (the MatMulNBits form) and a level from 0 to 4, or None")
    weights = read_weights(model)
    if nbits_form:
        for w in weights:
            nbits_block(w)  # refuse groups MatMulNBits cannot hold before any work
    inputs = capture.as_arrays(sample)
    # every output of the forward (a tensor, a tuple, a dict, a transformers ModelOutput), named as the static path
    # names them
    names, torch_out = reference_outputs(model, [sample], sample)
    output_names = graph_output_names(names, torch_out, output_names)
    with artifact.atomic_destination(path) as staged:
        try:
            produced = capture.dynamo_export(float_twin(model, weights), sample, opset_version=capture.EXPORTER_OPSET,
                                             dynamic_batch=dynamic_batch, input_names=input_names,
                                             output_names=output_names)
        except Exception as exc:  # the exporter raises many types; name the step and keep the cause
            raise ExportRefused(f"the dynamo ONNX exporter failed on {type(model).__name__}: "
                                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}") from exc
        check_outputs_line_up(produced, torch_out)
        reference = run_literal(produced, inputs)
        check_close(reference, torch_out, "the float export", "the torch weight-only model")

        standard = ir.from_proto(produced)
        to_dequantize_linear(standard, locate(standard, weights))
        standard.opset_imports[""] = max(standard.opset_imports[""], opset_version)
        standard_proto = ir.to_proto(standard)
        check_model(standard_proto, "storing the weights as integers with DequantizeLinear")
        _check_exact(standard_proto, reference, inputs, "storing the weights as integers with DequantizeLinear")
        if nbits_form:
            nbits = ir.from_proto(produced)
            to_matmul_nbits(nbits, locate(nbits, weights))
            final_ir, fmt = nbits, "MatMulNBits"
            final_proto = ir.to_proto(nbits)
            check_model(final_proto, "replacing MatMul/Gemm by MatMulNBits")
            got = run_literal(final_proto, inputs)
            check_close(got, reference, "the MatMulNBits form", "the standard form")
        else:
            final_ir, fmt, got = standard, "DequantizeLinear", reference
        check_close(got, torch_out, f"the {fmt} form", "the torch weight-only model")
        if accuracy_level is not None:
            set_accuracy_level(final_ir, accuracy_level)
        strip_source_metadata(final_ir)  # the exporter's stack traces (local paths); module scopes stay
        write_metadata(final_ir, spec, activation_dtype="float32", target=target.target if nbits_form else None)
        final_ir.metadata_props[FORMAT_KEY] = fmt
        artifact.save_model(ir.to_proto(final_ir), staged)
        check_written(staged, weights, fmt)
        check_runs_optimized(staged, inputs, "the written file")
        if before_commit is not None:
            reference_path = staged.parent / FLOAT_REFERENCE
            artifact.save_model(produced, reference_path)
            before_commit(staged, reference_path)
    return Path(path).expanduser().resolve()


def default_accuracy_level(bits: int) -> int:
    """MatMulNBits' accuracy_level a weight-only file is written at unless asked: 4 (int8 activations) for 8-bit
    weights, whose level-0 kernel runs slower than FP32 in ONNX Runtime; 0 (float activations, the stored
    arithmetic, within ``WEIGHT_ONLY_RTOL`` of torch) for 4-bit weights, whose level-0 kernel is not slower
    than FP32 on a full forward while level 4 moves the outputs about 1e-2. Measured: docs/weight-only.md
    ("Speed and accuracy_level"), bench/lm_decode_results.md. The decoder files' writer follows the same rule."""
    return FAST_ACCURACY_LEVEL if bits == 8 else 0


def speed_hint(level: int | None) -> Callable[[list[str]], str]:
    """What would help a weight-only file slower than FP32 (``export.speed_gate``'s ``hint``): the fast kernels'
    level, or, at level 4 already, the regime where weight-only pays."""
    def hint(_: list[str]) -> str:
        if not level or level < FAST_ACCURACY_LEVEL:
            return (f"write accuracy_level {FAST_ACCURACY_LEVEL} (--accuracy-level {FAST_ACCURACY_LEVEL}: int8 "
                    "activations in ONNX Runtime's MatMulNBits kernels, about 1e-2 from the exact outputs)")
        return ("ONNX Runtime's MatMulNBits kernels save little at this size on this CPU (weight-only pays where "
                "reading the weights dominates: large layers, few tokens per call); keep the float file")
    return hint


def check_written(path: Path, weights: list[QuantizedWeight], fmt: str) -> None:
    """Read the file back: every quantized layer is stored as integers in the form announced (a table read by
    GatherBlockQuantized or a DequantizeLinear of its rows), and no float initializer holds a quantized weight's
    values (no float copy beside the integers)."""
    model = onnx.load(str(path), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    names = [n.name for n in model.graph.node if n.op_type == "DequantizeLinear"]
    if fmt == "MatMulNBits":
        counts = {"Linear": ops.count("MatMulNBits"), "table": ops.count(embedding.GATHER_BLOCK_QUANTIZED)}
    else:
        counts = {"Linear": sum(n.startswith("weight_") for n in names),
                  "table": sum(n.startswith(embedding.TABLE_DEQUANTIZE) for n in names)}
    for kind, expected in (("Linear", sum(not w.embedding for w in weights)), ("table", sum(w.embedding for w in weights))):
        if counts[kind] < expected:
            raise ExportRefused(f"the written file holds {counts[kind]} {fmt} {kind} weight(s) for {expected} "
                                f"quantized {kind} weight(s)")
    quantized = {d for w in weights for d in w.digests}
    for tensor in model.graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT and len(tensor.dims) == 2 and not tensor.external_data \
                and _digest(onnx.numpy_helper.to_array(tensor)) in quantized:
            raise ExportRefused(f"the written file keeps {tensor.name!r}, a float copy of a quantized weight")
