"""Read ONNX files and say what they contain: counts, verification, deployability, memory.

Three jobs, each a subpackage, lowest first: ``read`` (a file), ``run`` (it, in the runtimes that
consume it), ``judge`` (it, for a target). Names are resolved lazily so reading a file never
imports torch unless a function needs it.
"""

from __future__ import annotations

from typing import Any

from quantship.lazy import load_public

_PUBLIC = {
    "qdq_stats": "quantship.inspect.read.stats",
    "QDQStats": "quantship.inspect.read.stats",
    "quant_spec_of_file": "quantship.inspect.read.stats",
    "verify_qdq": "quantship.inspect.run.verify",
    "compare_logits": "quantship.inspect.run.verify",
    "output_scales": "quantship.inspect.read.lsb",
    "lsb_error": "quantship.inspect.read.lsb",
    "LSBError": "quantship.inspect.read.lsb",
    "wilson_interval": "quantship.intervals",
    "inspect_file": "quantship.inspect.read.graph",
    "FileReport": "quantship.inspect.read.graph",
    "load_onnx": "quantship.inspect.read.loading",
    "FileFacts": "quantship.inspect.read.facts",
    "read_file": "quantship.inspect.read.facts",
    "check_file": "quantship.inspect.judge.check",
    "CheckReport": "quantship.inspect.judge.check",
    "Finding": "quantship.inspect.judge.check",
    "TARGETS": "quantship.inspect.judge.rules",
    "RULES": "quantship.inspect.judge.rules",
    "run_consumer": "quantship.inspect.judge.runs",
    "RunResult": "quantship.inspect.judge.runs",
    "tigris_analyze": "quantship.inspect.run.consumers",
    "compare_files": "quantship.inspect.judge.compare",
    "CompareReport": "quantship.inspect.judge.compare",
    "trace_divergence": "quantship.inspect.run.divergence",
    "DivergenceReport": "quantship.inspect.run.divergence",
    "file_size": "quantship.inspect.read.loading",
    # running a file: an ONNX Runtime session (threads, optimization level), its outputs, the consumers' runtimes
    "ort_session": "quantship.inspect.run.consumers",
    "run_session": "quantship.inspect.run.consumers",
    "ort_optimized_ops": "quantship.inspect.run.consumers",
    "run_openvino": "quantship.inspect.run.consumers",
    "run_tigris": "quantship.inspect.run.consumers",
    "flatten_outputs": "quantship.inspect.run.outputs",
    "torch_outputs": "quantship.inspect.run.verify",
    "measure_readings": "quantship.inspect.run.verify",
    "match_detections": "quantship.inspect.run.detections",
    "MATCH_IOU": "quantship.inspect.run.detections",
    # timing a file: the machine's CPU and int8 flags, one-thread sessions, per-node costs
    "cpu_info": "quantship.inspect.run.consumers",
    "cpu_line": "quantship.inspect.run.timing",
    "single_thread_session": "quantship.inspect.run.timing",
    "measure_speed": "quantship.inspect.run.speed",
    "relative_error": "quantship.inspect.run.weight_only",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    return load_public(__name__, _PUBLIC, name)
