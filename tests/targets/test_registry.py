"""The target registry: one Target per runtime, looked up once, carrying everything about it."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from quantship import precision, targets
from quantship.errors import TargetRefused
from quantship.inspect.judge.rules import RULES
from quantship.inspect.run.consumers import RUNNERS

SRC = Path(__file__).resolve().parents[2] / "src"


def test_names_aliases_and_the_one_look_up():
    assert targets.names() == ("onnxruntime-cpu", "tensorrt", "openvino", "tigris", "onnxruntime")
    assert targets.get("onnxruntime") is targets.get("onnxruntime-cpu") is targets.ALL[0]
    assert all(targets.get(t) is t for t in targets.ALL)  # a Target passes as is
    with pytest.raises(TargetRefused, match="valid targets"):
        targets.get("coreml")
    with pytest.raises(TypeError, match="bare Preset"):
        targets.get(precision.Preset("tigris"))


def test_precision_still_serves_the_names_that_moved():
    assert precision.PRESETS is targets.ALL and precision.preset is precision.resolve_target is targets.get
    assert precision.target_names() == targets.names() and dict(precision.TARGET_ALIASES) == dict(targets.ALIASES)
    assert precision.same_file_as("openvino") == ["onnxruntime-cpu"]  # the same spec, dtype and batch options


def test_each_target_names_rules_and_a_runner_that_exist():
    for t in targets.ALL:
        assert isinstance(t, precision.Preset) and t.name == t.target == t.check_target
        assert set(t.file_rules.errors) | set(t.file_rules.warnings) <= set(RULES)
        assert t.runner is None or t.runner in RUNNERS
        assert set(t.as_dict()) == {"target", "spec_kwargs", "activation_dtype", "why", "dynamic_batch"}


def test_what_each_runtime_can_run():
    can = {t.name: (t.runs_int16, t.runs_mixed_graphs, t.runs_dynamic_activations, t.weight_only_form)
           for t in targets.ALL}
    assert can == {"onnxruntime-cpu": (True, True, True, "MatMulNBits"), "tensorrt": (False, False, False, None),
                   "openvino": (False, True, False, None), "tigris": (False, False, False, None)}


def test_a_target_pickles_as_itself():  # a quantized model carries its Target through torch.save
    assert all(pickle.loads(pickle.dumps(t)) == t for t in targets.ALL)


def test_targets_loads_no_array_or_graph_library():
    code = ("import sys, quantship.targets; heavy = {'numpy', 'onnx', 'onnx_ir', 'onnxruntime', 'torch'}; "
            "print(sorted(heavy & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(SRC)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
