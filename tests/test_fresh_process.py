"""The export calls in the orders users make them, each in a fresh process.

An in-process suite hides a process-wide cache that leaks: whatever ran earlier in the worker has
already filled it. The seed notebook's order (a float baseline first, then quantize and export)
crashed every INT8 export because the exporter's shared translation table had been built before the
quantized operators existed; these tests run each order in a child process of its own and require
the same bytes whatever came first.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _python(*args: str, cwd: Path = ROOT, timeout: float = 600) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def _printed_dict(out: str, prefix: str) -> dict:
    line = next(line for line in out.splitlines() if line.startswith(prefix))
    return ast.literal_eval(line[len(prefix):].strip())


@pytest.mark.slow
def test_seed_order_then_reverse_order_write_the_same_int8_file(tmp_path):
    """docs/walkthrough_resnet18.py follows the seed: FP32 export, quantize, INT8 export, qdq_stats,
    verify_qdq. Its file holds the reference figures, and a process that exports the float model last
    writes the same INT8 bytes."""
    seed, reverse = tmp_path / "seed", tmp_path / "reverse"
    seed.mkdir(), reverse.mkdir()
    out = _python(str(ROOT / "docs" / "walkthrough_resnet18.py"), "--out-dir", str(seed))
    stats = _printed_dict(out, "qdq_stats:")
    assert (stats["n_quantize"], stats["n_dequantize"], stats["n_per_channel"], stats["n_nonzero_zero_point"],
            stats["n_unquantized_conv_add"]) == (33, 54, 21, 0, 0)
    assert "11,689,512 parameters" in out and "argmax agreement: 1.000" in out and "vacuous" in out
    assert "spec read back from the file equals the model's: True" in out
    assert _printed_dict(out, "skip_conv_add qdq_stats:")["n_unquantized_conv_add"] == 8 and "cleared 8 of 8" in out
    assert out.index("FP32 baseline") < out.index("label: W8A8")  # the float export came first
    _python("-m", "tests.fresh.orders", "reverse", str(reverse))
    assert (seed / "resnet18_int8.onnx").read_bytes() == (reverse / "resnet18_int8.onnx").read_bytes()
    assert (seed / "resnet18_fp32.onnx").read_bytes() == (reverse / "resnet18_fp32.onnx").read_bytes()


def test_two_models_interleaved_in_one_process_write_what_each_writes_alone(tmp_path):
    dirs = {order: tmp_path / order for order in ("interleaved", "alone-a", "alone-b")}
    for order, folder in dirs.items():
        folder.mkdir()
        _python("-m", "tests.fresh.orders", order, str(folder))
    for name in ("a", "b"):
        for kind in ("fp32", "int8"):
            alone = (dirs[f"alone-{name}"] / f"{name}_{kind}.onnx").read_bytes()
            assert (dirs["interleaved"] / f"{name}_{kind}.onnx").read_bytes() == alone, f"{name}_{kind}"


def test_the_shared_translation_table_is_keyed_on_the_operators_registered_now():
    """A table built before torchao registers quantized_decomposed is not the one reused after."""
    out = _python("-c", (
        "from quantship.export.capture import _translatable_operators as now\n"
        "before = now()\n"
        "import torchao.quantization.pt2e  # registers quantized_decomposed\n"
        "after = now()\n"
        "print(sorted(name for name, _, _ in after[1] - before[1]))\n"
        "print(before != after, before[0] == after[0], before[1] < after[1])\n"))
    added, flags = out.strip().splitlines()
    assert "quantized_decomposed::dequantize_per_channel" in added
    assert flags == "True True True"
