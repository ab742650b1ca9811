"""Glob patterns in ``skip_activations`` / ``int16`` (``quantize --exclude '1*'``), as the ONNX path's ``--exclude``
takes them: a pattern covers every module (and op) it matches and everything below them, the same file as the names
it matches written out; a pattern that matches nothing is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from quantship import Quantizer, export_qdq
from quantship.inspect.read.facts import read_file
from quantship.precision import is_pattern, under_modules


def _blocks() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
                                 for _ in range(12)]).eval()


def test_a_pattern_covers_the_modules_it_matches_and_what_is_below_them():
    assert is_pattern("1*") and is_pattern("layer?.conv") and not is_pattern("layer1.conv")
    assert under_modules("10.0", ("1*",)) and under_modules("1", ("1*",)) and not under_modules("2.1", ("1*",))
    assert under_modules("3.up.inner", ("*.up",)) and not under_modules("3.down", ("*.up",))


def test_a_pattern_writes_the_file_its_matches_write(tmp_path):
    model, batches = _blocks(), [torch.randn(8, 32)]
    stats = []
    for k, names in enumerate((["1*"], ["1", "10", "11"])):
        qmodel = Quantizer.for_target("onnxruntime-cpu", skip_activations=names).quantize(model, batches)
        path = export_qdq(qmodel, batches[0][:1], tmp_path / f"q{k}.onnx", target="onnxruntime-cpu")
        facts = read_file(path)
        stats.append((facts.stats.as_dict(), sorted(f.module for f in facts.float_compute)))
    assert stats[0] == stats[1]
    assert {"1.0", "10.0", "11.0"} <= set(stats[0][1])


def test_a_pattern_that_matches_nothing_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"skip_activations names \['x\*'\]: neither modules .* glob pattern") as got:
        Quantizer.for_target("onnxruntime-cpu", skip_activations=["x*"]).quantize(_blocks(), [torch.randn(8, 32)])
    assert "\n" not in str(got.value)


def test_the_command_takes_a_pattern(tmp_path):
    (tmp_path / "blocks.py").write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())\n"
        "                                 for _ in range(12)]).eval()\n")
    np.save(tmp_path / "c.npy", np.random.default_rng(0).standard_normal((40, 32)).astype(np.float32))
    done = subprocess.run([sys.executable, "-m", "quantship", "quantize", "blocks.py:build", "--calib", "c.npy",
                           "--out", "q.onnx", "--exclude", "1*", "--no-speed", "--json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    kept = {m["module"] for m in report["float_ops"]["by_module"] if m["why"] == "kept float on request"}
    assert kept == {"1.0", "10.0", "11.0"} and report["float_ops"]["requested_but_int8"] == []
