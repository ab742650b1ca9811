"""Placement by profile on the PyTorch path (``export.placement``, ``export.judged``): the float reference torch
exports is matched to the INT8 file node for node (by position when both hold the same weighted ops, a
BatchNorm folded into its Conv by the float export included), each integer node named by the module
``--exclude`` takes; the profile runs on every ONNX Runtime quantize unless ``--plain-placement``, and what it
keeps float is recorded in the report, the JSON and the file."""

from __future__ import annotations

import json

import onnx
import pytest
import torch
import torch.nn as nn

from quantship import Quantizer, export_qdq
from quantship.cli.main import main
from quantship.export.onnx_float import export_onnx
from quantship.export.placement import float_named_as, integer_weighted
from quantship.export.speed_gate import SEARCH_KEY
from quantship.inspect.read.facts import read_file
from quantship.inspect.read.float_ops import WHY_SPEED, float_ops
from tests.model_files import factory_and_calibration

MODEL = """
import torch.nn as nn


def build():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                         nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).eval()
"""


def _build() -> nn.Module:
    namespace: dict = {}
    exec(MODEL, namespace)
    torch.manual_seed(0)
    return namespace["build"]()


def test_the_float_reference_is_matched_node_for_node_and_named_by_module(tmp_path):
    model, x = _build(), torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    reference = onnx.load(str(export_onnx(model, x[:2], tmp_path / "float.onnx", optimize=False)))
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, calibration_dl=[x])
    int8 = onnx.load(str(export_qdq(qmodel, x[:2], tmp_path / "int8.onnx", target="onnxruntime-cpu")))
    integer = set(integer_weighted(int8).values())
    matched = float_named_as(reference, int8)
    assert set(matched) == integer and len(integer) == 3  # two Convs and the Linear, every one matched
    assert sorted(matched.values()) == ["0", "3", "8"]  # the modules --exclude names (not the BatchNorms)
    weighted = {n.name for n in reference.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")}
    assert integer <= weighted  # the float file's nodes now carry the INT8 file's names


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return factory_and_calibration(tmp_path_factory.mktemp("torch_profile"), MODEL, "build", (32, 3, 16, 16))


def test_the_profile_runs_by_default_and_plain_placement_skips_it(files, tmp_path, capsys):
    model, calib = files
    runs = {}
    for flag in ((), ("--plain-placement",)):
        out = tmp_path / f"q{len(flag)}.onnx"
        assert main(["quantize", model, "--calib", str(calib), "--out", str(out), "--json", *flag]) == 0
        runs[flag] = json.loads(capsys.readouterr().out), onnx.load(str(out))
    report, plain = runs[("--plain-placement",)]
    assert report["placement_by_profile"] is None
    assert SEARCH_KEY not in {p.key for p in plain.metadata_props}
    report, written = runs[()]
    said = report["placement_by_profile"]
    assert said["not_run"] is None or said["not_run"].startswith("no weighted op of 3"), said["not_run"]
    assert {n["node"] for n in said["nodes"]} == set(integer_weighted(plain).values())  # every integer op profiled
    recorded = json.loads({p.key: p.value for p in written.metadata_props}[SEARCH_KEY])
    assert recorded["kept_float"] == said["kept_float"]
    skipped = json.loads({p.key: p.value for p in written.metadata_props}["quantship.spec"]).get("skip_activations")
    if said["chosen"]:  # kept float by keeping their modules float, and verified faster than the plain file
        assert said["kept_float"] and skipped and len(integer_weighted(written)) == 3 - len(said["kept_float"])
        assert all(said["verified_ms"]["profile"][b] < said["verified_ms"]["plain"][b] * 1.05
                   for b in said["verified_ms"]["plain"])
        assert said["kept_float_modules"] == sorted(skipped)  # named as --exclude names them
        why = {g["module"]: g["why"] for g in report["float_ops"]["by_module"]}
        assert all(why[m] == WHY_SPEED for m in skipped), why  # not "kept float on request"
        alone = {g["module"]: g["why"] for g in float_ops(read_file(tmp_path / "q0.onnx"))["by_module"]}
        assert all(alone[m] == WHY_SPEED for m in skipped), alone  # inspect, from the file's own record
    else:  # the plain file, as --plain-placement writes it
        assert not skipped and len(integer_weighted(written)) == 3


def test_a_module_kept_float_keeps_its_weight_float_too(tmp_path):
    """``exclude`` (``skip_activations``: the fidelity repair's and the profile's way to keep a module float)
    keeps a conv's weight float too, as the ONNX path keeps an excluded node: a weight stored int8 for a float
    input would be a DequantizeLinear ONNX Runtime runs on every call before a float Conv (MTCNN PNet's first
    Conv, kept float by the profile, ran so: 0.78x FP32 where the ONNX path's file ran 0.83x)."""
    model, x = _build(), torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    qmodel = Quantizer.for_target("onnxruntime-cpu", skip_activations=["0"]).quantize(model, calibration_dl=[x])
    int8 = onnx.load(str(export_qdq(qmodel, x[:2], tmp_path / "int8.onnx", target="onnxruntime-cpu")))
    producer = {o: n for n in int8.graph.node for o in n.output}
    stored = {t.name: t for t in int8.graph.initializer}
    convs = [n for n in int8.graph.node if n.op_type == "Conv"]
    assert len(convs) == 2
    first, second = convs
    assert first.input[1] in stored and stored[first.input[1]].data_type == onnx.TensorProto.FLOAT  # float, stored
    assert first.input[0] not in producer or producer[first.input[0]].op_type != "DequantizeLinear"
    assert producer[second.input[1]].op_type == "DequantizeLinear"  # the other conv still reads int8 weights
    assert sorted(integer_weighted(int8).values()) == [second.name, *[n.name for n in int8.graph.node
                                                                      if n.op_type in ("Gemm", "MatMul")]]
