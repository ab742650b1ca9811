"""Read ONNX files and say what they contain: counts, verification, deployability, memory.

Names are resolved lazily so reading a file never imports torch unless a function needs it.
"""

from __future__ import annotations

from typing import Any

from quantship.lazy import load_public

_PUBLIC = {
    "qdq_stats": "quantship.inspect.stats",
    "QDQStats": "quantship.inspect.stats",
    "quant_spec_of_file": "quantship.inspect.stats",
    "verify_qdq": "quantship.inspect.verify",
    "compare_logits": "quantship.inspect.verify",
    "output_scales": "quantship.inspect.lsb",
    "lsb_error": "quantship.inspect.lsb",
    "LSBError": "quantship.inspect.lsb",
    "wilson_interval": "quantship.inspect.intervals",
    "inspect_file": "quantship.inspect.graph",
    "FileReport": "quantship.inspect.graph",
    "load_onnx": "quantship.inspect.loading",
    "FileFacts": "quantship.inspect.facts",
    "read_file": "quantship.inspect.facts",
    "check_file": "quantship.inspect.check",
    "CheckReport": "quantship.inspect.check",
    "Finding": "quantship.inspect.check",
    "TARGETS": "quantship.inspect.rules",
    "RULES": "quantship.inspect.rules",
    "run_consumer": "quantship.inspect.consumers",
    "RunResult": "quantship.inspect.consumers",
    "tigris_analyze": "quantship.inspect.consumers",
    "compare_files": "quantship.inspect.compare",
    "CompareReport": "quantship.inspect.compare",
    "trace_divergence": "quantship.inspect.divergence",
    "DivergenceReport": "quantship.inspect.divergence",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    return load_public(__name__, _PUBLIC, name)
