"""Deployability rules as data: one table of rules; each target says which apply.

A rule reads ``QuantFacts`` and returns the offending nodes/tensors (empty when the file passes).
A target's ``FileRules`` (``quantship.targets``) list the rules that make it refuse a file ("error")
and those that only deserve a remark ("warning"), plus its opset range and the integer types it
accepts. Nothing else in quantship restates these facts (SPEC §5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quantship import targets
from quantship.inspect.read.quantization import QuantFacts
from quantship.targets import FileRules, Target

PER_CHANNEL_MIN_OPSET = 13  # `axis` on Q/DQ arrived in opset 13


@dataclass(frozen=True)
class Rule:
    """One requirement: what it checks, how it fails, and the fix a user can apply."""

    id: str
    requirement: str
    message: str  # format fields: {consumer}, {n}, {what}
    fix: str
    offenders: Callable[[QuantFacts, Target], list[str]]
    # a weight-only file breaks it by design, not by a quantizer's miss: what to say and do then ("": as above)
    weight_only_message: str = ""
    weight_only_fix: str = ""

    def words_for(self, facts: QuantFacts) -> tuple[str, str]:
        """(message, fix) for this file."""
        if facts.format == "weight-only" and self.weight_only_message:
            return self.weight_only_message, self.weight_only_fix
        return self.message, self.fix


def _opset_offenders(facts: QuantFacts, target: Target) -> list[str]:
    if facts.opset is None:
        return []
    low, high = target.file_rules.opset
    found = [f"opset {facts.opset}"] if not low <= facts.opset <= high else []
    if facts.opset < PER_CHANNEL_MIN_OPSET:
        found += [q.node for q in facts.qdq if q.per_channel]
    return found


def _dtype_offenders(role: str, allowed_of: Callable[[FileRules], tuple[str, ...]]):
    def offenders(facts: QuantFacts, target: Target) -> list[str]:
        return [f"{q.node} ({q.dtype})" for q in facts.of_role(role) if q.dtype not in allowed_of(target.file_rules)]
    return offenders


def _domain_offenders(facts: QuantFacts, target: Target) -> list[str]:
    runs = tuple(f"({op})" for op in target.file_rules.operators)  # foreign_operators' labels end "(domain::Op)"
    return [node for node, domain, local in facts.foreign_operators
            if domain not in target.file_rules.domains and not (local and target.file_rules.local_functions)
            and not node.endswith(runs)]


def _float_activation_offenders(facts: QuantFacts, target: Target) -> list[str]:
    """Float activations of a file that quantizes some: a weight-only file keeps every activation float by
    design, which matters only to a target that refuses float activations (not to one that runs them)."""
    if facts.format in ("QDQ", "mixed") or (facts.format == "weight-only"
                                             and "fully_quantized" in target.file_rules.errors):
        return list(facts.float_tensors)
    return []


RULES: dict[str, Rule] = {r.id: r for r in (
    Rule("valid_parameters", "finite, positive, normal scales; zero-points of the stored type; axes in range; "
         "positive dimensions",
         "{n} broken quantization parameter(s) or dimension(s) ({what}); {consumer} would reject the file "
         "or compute garbage with it",
         "re-quantize from finite calibration data (a NaN/Inf input gives such scales), or re-export the file; "
         "a hand edit must keep each scale > 0 and the zero-point in the stored integer type",
         lambda f, t: list(f.parameter_problems)),
    Rule("op_domains", "operators in domains the target runs",
         "{n} operator(s) outside the domains {consumer} runs ({what})",
         "replace custom operators with standard ONNX ones, or define them in the file as model-local "
         "functions (ONNX Runtime and OpenVINO inline those)",
         _domain_offenders),
    Rule("opset_declared", "the file declares a default-domain opset",
         "the file declares no opset for the default ONNX domain; {consumer} cannot tell which operator "
         "versions it holds", "re-export the model (every ONNX exporter declares one)",
         lambda f, t: ["opset_import"] if f.opset is None else []),
    Rule("opset_range", "opset inside the target's range (per-channel Q/DQ needs opset >= 13)",
         "{consumer} loads opsets {low}-{high} and per-channel Q/DQ needs opset >= 13: {what}",
         "re-export at a supported opset, or convert with onnx.version_converter.convert_version",
         _opset_offenders),
    Rule("quantized", "the file is quantized at all",
         "the file holds no quantization (no Q/DQ pairs): {consumer} would run it in float, not INT8",
         "quantize it: quantship quantize, or ONNX Runtime quantize_static(..., quant_format=QuantFormat.QDQ)",
         lambda f, t: ["graph"] if f.format == "float" else []),
    Rule("qdq_format", "QDQ format (no QLinear*/QGemm/ConvInteger/MatMulInteger operators)",
         "{n} operator(s) in QOperator/integer form ({what}): {consumer} needs QDQ format with static "
         "scales (QuantizeLinear/DequantizeLinear around float operators)",
         "re-quantize statically in QDQ format: quantize_static(..., quant_format=QuantFormat.QDQ), "
         "or quantship export_qdq",
         lambda f, t: list(f.qoperator_nodes)),
    Rule("static_scales", "static scales: every scale and zero-point is a constant in the file",
         "{n} node(s) compute quantization scales at run time ({what}): dynamic quantization; "
         "{consumer} needs QDQ format with static scales stored in the file",
         "quantize statically with calibration data: quantize_static(..., quant_format=QuantFormat.QDQ) "
         "instead of quantize_dynamic",
         lambda f, t: list(f.dynamic_nodes) + [q.node for q in f.qdq if not q.static]),
    Rule("fully_quantized", "fully quantized: every activation between a Q/DQ pair",
         "{n} activation(s) stay float outside any Q/DQ pair ({what}): the graph mixes float and "
         "integer, which {consumer} cannot run as one INT8 plan",
         "quantize the operators that produce these tensors (usually ones the quantizer skipped or "
         "does not support); the fix is upstream in the quantizer",
         _float_activation_offenders,
         weight_only_message="the file quantizes weights only: its {n} activation(s) stay float ({what}), and "
                             "{consumer} runs integer activations only",
         weight_only_fix="quantize weights and activations for this target (quantship quantize --target T, "
                         "static W8A8); a weight-only file is for ONNX Runtime (MatMulNBits) or OpenVINO"),
    Rule("per_tensor_activations", "activations quantized per tensor",
         "{n} activation Q/DQ node(s) are per-channel ({what}); {consumer} needs one scale per activation",
         "quantize activations per tensor (per-channel scales belong to weights only)",
         lambda f, t: [q.node for q in f.of_role("activation") if q.per_channel]),
    Rule("activation_dtype", "activation integer type accepted by the target",
         "{n} activation Q/DQ node(s) use a type {consumer} does not accept ({what})",
         "quantize activations to int8 (symmetric, zero-point 0), e.g. export_qdq(activation_dtype='int8')",
         _dtype_offenders("activation", lambda t: (*t.activation_dtypes, "undefined"))),
    Rule("weight_dtype", "weight integer type accepted by the target",
         "{n} weight Q/DQ node(s) use a type {consumer} does not accept ({what})",
         "quantize weights to int8",
         _dtype_offenders("weight", lambda t: (*t.weight_dtypes, "undefined"))),
    Rule("int32_bias", "a quantized bias is int32",
         "{n} bias(es) are quantized to a type other than int32 ({what}); integer kernels accumulate "
         "in int32, so {consumer} cannot place them",
         "leave the bias float or quantize it to int32 at scale input_scale * weight_scale",
         lambda f, t: [f"{node}:{tensor} ({dtype})" for node, tensor, dtype in f.biases
                       if dtype.startswith(("int", "uint")) and dtype != "int32"]),
    Rule("zero_point_zero", "every zero-point is 0 (symmetric)",
         "{n} Q/DQ node(s) have a non-zero zero-point ({what}); {consumer} supports symmetric "
         "quantization only",
         "quantize symmetrically (int8, zero-point 0): Quantizer(backend='pt2e', symmetric=True) "
         "and export_qdq(activation_dtype='int8')",
         lambda f, t: [f"{q.node} (zero-point {','.join(map(str, q.zero_points[:3]))})"
                       for q in f.qdq if any(z != 0 for z in q.zero_points)]),
    Rule("weight_range_7bit", "int8 weights within +-63 (no u8s8 overflow on x86 CPUs without VNNI)",
         "{n} int8 weight tensor(s) use values beyond +-63 ({what}); on x86 CPUs without VNNI "
         "(AVX2, AVX-512 without VNNI) {consumer}'s u8s8 integer kernels can saturate their int16 "
         "intermediate sums, so its outputs drift from the QDQ graph by many LSB",
         "deploy on a CPU with VNNI/AMX, or quantize weights to 7 bits (reduce_range) for such CPUs",
         # a weight-only file has no uint8 activation: nothing in it is the u8 operand of a u8s8 kernel
         lambda f, t: [f"{q.node} (|w| up to {q.max_abs_int})" for q in f.of_role("weight")
                       if q.dtype == "int8" and q.max_abs_int is not None and q.max_abs_int > 63
                       and f.format != "weight-only"]),
    Rule("tigris_kernels", "operators in the forms TiGrIS has kernels for: Clip as ReLU (min 0) or ReLU6 (0, 6); "
         "ReduceSum/Mean/Max of a rank-3 input over one constant axis, or of a rank-4 one over H and W; Slice "
         "of a rank-4 input at most",
         "{n} operator(s) in a form {consumer} has no kernel for ({what}), so it compiles no plan",
         "keep such ops out of the model (a hard sigmoid as HardSigmoid, not a Clip to [0, 1]; a "
         "LayerNorm or softmax over a rank-3 tensor; attention's q, k, v split from one rank-5 tensor), or "
         "deploy to a runtime that has them",
         lambda f, t: [f"{node} ({form})" for node, form in f.operator_forms]),
    Rule("one_scale_pairs", "each activation QuantizeLinear -> DequantizeLinear pair holds one scale and zero-point",
         "{n} activation Q/DQ pair(s) read the integers at another scale than they were written with ({what}); "
         "{consumer} reads a pair at its QuantizeLinear's scale, so the values after such a pair differ from "
         "ONNX Runtime's (measured with TiGrIS 0.12.1)",
         "write the rescaling as its own op between two pairs of one scale each (quantship's exports do)",
         lambda f, t: list(f.two_scale_pairs)),
    Rule("conv_kernel_shape", "every Conv carries kernel_shape",
         "{n} Conv node(s) have no kernel_shape attribute ({what}); {consumer}'s ONNX parser needs it",
         "write kernel_shape from the weight's spatial dims (quantship export_qdq does this)",
         lambda f, t: list(f.convs_without_kernel_shape)),
)}

# the targets by name, as ``quantship.inspect.TARGETS`` offered them (each one's rules: ``.file_rules``)
TARGETS: dict[str, Target] = {t.name: t for t in targets.ALL}
