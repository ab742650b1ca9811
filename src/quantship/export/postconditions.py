"""Post-conditions read off the written file and held against the spec it claims to carry.

The file is read once (``FileFacts``): the counts, the declared opset, the stored weights, the spec
in its metadata and the target's static rules all come from that one read.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from quantship.errors import ExportRefused
from quantship.inspect.judge import check as deployability
from quantship.inspect.read.facts import FileFacts, read_file
from quantship.inspect.read.stats import QDQStats, qdq_stats, quant_spec_of_file
from quantship.precision import QuantSpec
from quantship.targets import Target

WIDE_DTYPES = ("int16", "uint16")


def read_written(path: Path | FileFacts) -> FileFacts:
    """``FileFacts`` of the written file: the facts themselves when given (one read serves every
    post-condition), else a fresh read. Nothing is kept between calls: a cache keyed on the file's
    identity could answer for a file rewritten in place within one timestamp tick."""
    return path if isinstance(path, FileFacts) else read_file(path)


def check_spec_held(path: Path | FileFacts, spec: QuantSpec, *, activation_dtype: str, opset_version: int,
                    int16_tensors: Sequence[str] = ()) -> QDQStats:
    """Refuse the file unless what it holds matches ``spec``; returns its ``QDQStats``. (Whether a target
    accepts a file is ``inspect.judge.check.check_file``'s question; ``check_target`` asks it here.)
    ``int16_tensors``: the activations the file says it stores in 16 bits; exactly those must be."""
    facts = read_written(path)
    stats = qdq_stats(facts)
    problems: list[str] = []
    wide = {q.tensor for q in facts.quant.of_role("activation")
            if q.dtype in WIDE_DTYPES and q.op_type == "QuantizeLinear"}  # a DequantizeLinear names its output
    if wide != set(int16_tensors):
        problems.append(f"16-bit activations {sorted(wide)} where the file names {sorted(int16_tensors)}")
    if spec.int16 and not wide:
        problems.append(f"no 16-bit activation although the spec stores {list(spec.int16)}'s in 16 bits")
    all_wide = bool(wide) and all(q.dtype in WIDE_DTYPES for q in facts.quant.of_role("activation"))
    declared = facts.opset_imports
    if declared.get("") != opset_version:
        problems.append(f"it declares opset {declared} instead of {opset_version}")
    if stats.n_quantize == 0 or stats.n_dequantize == 0:
        problems.append(f"it holds {stats.n_quantize} QuantizeLinear and {stats.n_dequantize} DequantizeLinear")
    if spec.qscheme == "per_channel" and stats.n_per_channel == 0:
        problems.append("no per-channel scale although the spec asks for per_channel weights")
    if spec.qscheme == "per_tensor" and stats.n_per_channel:
        problems.append(f"{stats.n_per_channel} per-channel scale(s) although the spec asks for per_tensor")
    if activation_dtype == "int8" and stats.n_uint8:
        problems.append(f"{stats.n_uint8} uint8 zero-point(s) in an int8 file")
    if activation_dtype == "uint8" and stats.n_uint8 == 0 and not all_wide:
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
    if spec.reduce_range:
        widest = facts.widest_stored_weight()
        if widest > 63:
            problems.append(f"a weight reaches {widest} although reduce_range=True keeps weights in [-63, 63]")
    if quant_spec_of_file(facts) != spec:
        problems.append("the spec read back from metadata_props differs from the model's")
    if facts.quant.parameter_problems:
        problems.append(f"broken quantization parameters: {'; '.join(facts.quant.parameter_problems[:4])}")
    if problems:
        raise ExportRefused(f"the produced file does not match {spec.label} ({spec.as_dict()}): " + "; ".join(problems))
    return stats


def check_target(path: Path | FileFacts, target: Target) -> None:
    """Refuse a file that the preset's own deployment target would not accept (static rules)."""

    facts = read_written(path)
    report = deployability.check_file(facts, target)
    if not report.ok:
        reasons = "; ".join(f"[{f.rule}] {f.message}" for f in report.errors)
        raise ExportRefused(f"the file written for target={target.target!r} fails {report.target}'s rules: {reasons}")
