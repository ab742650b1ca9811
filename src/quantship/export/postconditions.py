"""Post-conditions read off the written file and held against the spec it claims to carry."""

from __future__ import annotations

from pathlib import Path

import onnx

from quantship.export.checks import ExportRefused
from quantship.inspect.stats import QDQStats, qdq_stats, quant_spec_of_file
from quantship.precision import QuantSpec


def check_file(path: Path, spec: QuantSpec, *, activation_dtype: str, opset_version: int) -> QDQStats:
    """Refuse the file unless what it holds matches ``spec``; returns its ``QDQStats``."""
    stats = qdq_stats(path)
    problems: list[str] = []
    declared = {o.domain: o.version for o in onnx.load(str(path), load_external_data=False).opset_import}
    if declared.get("", declared.get("ai.onnx")) != opset_version:
        problems.append(f"it declares opset {declared} instead of {opset_version}")
    if stats.n_quantize == 0 or stats.n_dequantize == 0:
        problems.append(f"it holds {stats.n_quantize} QuantizeLinear and {stats.n_dequantize} DequantizeLinear")
    if spec.qscheme == "per_channel" and stats.n_per_channel == 0:
        problems.append("no per-channel scale although the spec asks for per_channel weights")
    if spec.qscheme == "per_tensor" and stats.n_per_channel:
        problems.append(f"{stats.n_per_channel} per-channel scale(s) although the spec asks for per_tensor")
    if activation_dtype == "int8" and stats.n_uint8:
        problems.append(f"{stats.n_uint8} uint8 zero-point(s) in an int8 file")
    if activation_dtype == "uint8" and stats.n_uint8 == 0:
        problems.append("no uint8 zero-point although activation_dtype='uint8'")
    if spec.symmetric:
        expected = stats.n_uint8 if activation_dtype == "uint8" else 0
        if stats.n_nonzero_zero_point != expected:
            problems.append(f"{stats.n_nonzero_zero_point} non-zero zero-point(s) where a symmetric spec "
                            f"with {activation_dtype} activations allows {expected}")
    if spec.qdq_placement == "skip_conv_add" and stats.n_unquantized_conv_add == 0:
        problems.append("qdq_placement='skip_conv_add' but every conv->add edge carries a Q/DQ pair")
    if spec.qdq_placement == "per_op" and not spec.skip_activations and stats.n_unquantized_conv_add:
        problems.append(f"qdq_placement='per_op' but {stats.n_unquantized_conv_add} conv->add edge(s) carry no "
                        "Q/DQ pair")
    if quant_spec_of_file(path) != spec:
        problems.append("the spec read back from metadata_props differs from the model's")
    if problems:
        raise ExportRefused(f"the produced file does not match {spec.label} ({spec.as_dict()}): " + "; ".join(problems))
    return stats
