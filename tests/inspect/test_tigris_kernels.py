"""The tigris target's ``tigris_kernels`` rule: the operator forms TiGrIS 0.12.1 has no kernel for
(Clip other than ReLU / ReLU6; a reduction that is neither over one axis of a rank-3 tensor nor a
global pool over H and W), read statically, so a file it cannot compile is refused before it is
written, with the node and its form. Each case is checked against ``tigris analyze`` where the CLI is
installed: the rule and TiGrIS agree on every form here. Found on the REAL.md files: the PyTorch path's
PP-OCR classifier (onnx2torch writes HardSigmoid as Clip 0..1: 9 of them) and magika's written-out
LayerNorm and softmax (rank-2 reductions).
"""

from __future__ import annotations

import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantship.inspect.judge.check import check_file
from quantship.inspect.run.consumers import tigris_analyze, tigris_executable


def _file(tmp_path, op: str, shape: list[int], out: list[int], *, axes=None, low=None, high=None):
    inputs = ["x_d"]
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"), numpy_helper.from_array(np.array(0, np.int8), "z")]
    attrs = {}
    if op == "Clip":
        inputs += ["low", "high"]
        inits += [numpy_helper.from_array(np.array(low, np.float32), "low"),
                  numpy_helper.from_array(np.array(high, np.float32), "high")]
    elif op == "Slice":  # the first of the leading axis's rows
        inputs += ["starts", "ends", "axes"]
        inits += [numpy_helper.from_array(np.array([v], np.int64), k) for k, v in (("starts", 0), ("ends", 1), ("axes", 0))]
    else:
        inputs.append("axes")
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
        attrs["keepdims"] = 1
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "s", "z"], ["x_d"]),
             helper.make_node(op, inputs, ["y"], name="the_op", **attrs),
             helper.make_node("QuantizeLinear", ["y", "s", "z"], ["y_q"]),
             helper.make_node("DequantizeLinear", ["y_q", "s", "z"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, out)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    path = tmp_path / f"{op}.onnx"
    onnx.save(model, str(path))
    return path


CASES = {  # name: (op, input shape, output shape, keyword arguments, TiGrIS has a kernel)
    "relu6": ("Clip", [1, 4, 8, 8], [1, 4, 8, 8], {"low": 0.0, "high": 6.0}, True),
    "hard sigmoid clip": ("Clip", [1, 4, 8, 8], [1, 4, 8, 8], {"low": 0.0, "high": 1.0}, False),
    "clip -1..3": ("Clip", [1, 4, 8, 8], [1, 4, 8, 8], {"low": -1.0, "high": 3.0}, False),
    "global mean": ("ReduceMean", [1, 8, 3, 96], [1, 8, 1, 1], {"axes": [2, 3]}, True),
    "rank-3 one axis": ("ReduceMean", [1, 12, 96], [1, 12, 1], {"axes": [2]}, True),
    "rank-2 sum": ("ReduceSum", [1, 96], [1, 1], {"axes": [1]}, False),
    "rank-4 one axis": ("ReduceMean", [1, 8, 12, 96], [1, 8, 12, 1], {"axes": [3]}, False),
    "rank-4 slice": ("Slice", [3, 8, 40, 12], [1, 8, 40, 12], {}, True),
    "rank-5 slice": ("Slice", [3, 1, 8, 40, 12], [1, 1, 8, 40, 12], {}, False),  # an attention's q, k, v split
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rule_refuses_what_tigris_cannot_compile_and_nothing_else(case, tmp_path):
    op, shape, out, kwargs, runs = CASES[case]
    path = _file(tmp_path, op, shape, out, **kwargs)
    report = check_file(path, "tigris")
    flagged = [f for f in report.findings if f.rule == "tigris_kernels"]
    assert bool(flagged) != runs, report.findings
    if flagged:
        assert "the_op" in flagged[0].message and op in flagged[0].message
    if tigris_executable() is None:
        pytest.skip("tigris CLI not installed: the static half checked only")
    if op == "Slice":  # analyze lists it as supported: its compile is what refuses a rank-5 one
        compiled = subprocess.run([tigris_executable(), "compile", str(path), "-m", "64M", "-o",
                                   str(tmp_path / "plan.tgrs")], capture_output=True, text=True)
        assert (compiled.returncode == 0) == runs, compiled.stderr[-300:]
        return
    unsupported = tigris_analyze(path).get("model", {}).get("unsupported_operators") or []
    assert (not unsupported) == runs, unsupported


def test_other_targets_do_not_apply_it(tmp_path):
    path = _file(tmp_path, "Clip", [1, 4, 8, 8], [1, 4, 8, 8], low=0.0, high=1.0)
    assert not [f for f in check_file(path, "openvino").findings if f.rule == "tigris_kernels"]


def _relu6_pair_file(tmp_path, dq_scale: float):
    """x -> Q(0.05) -> DQ(``dq_scale``) -> Clip(0, 6) -> Q/DQ(6/127): with ``dq_scale`` 6 x 0.05, the pair reads the
    integers at 6 times the scale they were written with (the form the PyTorch path's hard sigmoid had for TiGrIS)."""
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"), numpy_helper.from_array(np.array(dq_scale, np.float32), "s_read"),
             numpy_helper.from_array(np.array(6 / 127, np.float32), "so"), numpy_helper.from_array(np.array(0, np.int8), "z"),
             numpy_helper.from_array(np.array(0.0, np.float32), "low"), numpy_helper.from_array(np.array(6.0, np.float32), "high")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["x_q"], name="q_in"),
             helper.make_node("DequantizeLinear", ["x_q", "s_read", "z"], ["x_d"], name="dq_in"),
             helper.make_node("Clip", ["x_d", "low", "high"], ["y"], name="relu6"),
             helper.make_node("QuantizeLinear", ["y", "so", "z"], ["y_q"]),
             helper.make_node("DequantizeLinear", ["y_q", "so", "z"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    path = tmp_path / f"pair_{dq_scale:g}.onnx"
    onnx.save(model, str(path))
    return path


def test_a_pair_of_two_scales_is_a_tigris_warning_and_tigris_reads_it_otherwise():
    """``one_scale_pairs``: a Q -> DQ pair whose DequantizeLinear reads at another scale is named for TiGrIS (a
    warning: TiGrIS compiles and runs it), and the premise is measured: TiGrIS's values after such a pair are not
    ONNX Runtime's literal ones, while a pair of one scale reads alike."""
    import tempfile
    from pathlib import Path

    from quantship.inspect.run.consumers import run_onnxruntime, run_tigris

    x = np.random.default_rng(0).uniform(-2, 8, (1, 4, 8, 8)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        for dq_scale, two in ((0.3, True), (0.05, False)):
            path = _relu6_pair_file(Path(tmp), dq_scale)
            report = check_file(path, "tigris")
            flagged = [f for f in report.findings if f.rule == "one_scale_pairs"]
            assert bool(flagged) == two and all(f.severity == "warning" for f in flagged), report.findings
            assert report.ok
            if two:
                assert "q_in -> dq_in" in flagged[0].offending[0]
                assert not [f for f in check_file(path, "openvino").findings if f.rule == "one_scale_pairs"]
            if tigris_executable() is None:
                continue
            literal = run_onnxruntime(path, [{"x": x}], optimize=False)[0][0]
            tigris = np.asarray(run_tigris(path, [{"x": x}], onnx.load(str(path)))[0][0]).reshape(literal.shape)
            steps = np.abs(tigris - literal).max() / (6 / 127)
            assert (steps > 10) == two, steps
    if tigris_executable() is None:
        pytest.skip("tigris CLI not installed: the static half checked only")
