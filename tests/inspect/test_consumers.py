"""Running the consumers: TiGrIS plan and OpenVINO against ONNX Runtime, in output LSB.

Reference: ONNX Runtime running the QDQ graph literally (ORT_DISABLE_ALL), 20 seeded inputs, on
the reference task's trained TinyResNet (pt2e INT8, 1x1x32x32). Measured on this machine:
  TiGrIS host runtime: max 1.0 LSB, mean 0.16 LSB.
  OpenVINO (CPU, f32 precision hint): max 34 LSB, mean 10.2 LSB; ONNX Runtime's own optimized
  session lands at max 30 LSB on the same file (its fused QLinearConv diverges first, at the Conv
  that feeds the first residual Add), while the literal graph stays within 2.75 LSB of the float
  model on held-out digits. Cause: this CPU (AMD EPYC, AVX2, no VNNI) runs u8s8 int8 kernels whose
  int16 pair sums saturate with weights using the full +-127 range. The same file with 7-bit
  weights: OpenVINO max 2.0 LSB (mean 0.31), ORT optimized max 1.0 LSB.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from quantship.inspect.judge.check import check_file
from quantship.inspect.judge.runs import run_consumer
from quantship.inspect.run.consumers import channels_first, cpu_info, tigris_executable

N_INPUTS = 20


@pytest.mark.slow
def test_tigris_plan_runs_within_4_lsb(digits_files):
    if tigris_executable() is None:
        pytest.skip("tigris CLI not installed")
    report = check_file(digits_files["int8"], "tigris", run=True, n_inputs=N_INPUTS)
    (result,) = report.runs
    assert result.ran and result.n_inputs == N_INPUTS, result
    assert result.max_lsb is not None and result.max_lsb <= 4.0, result
    assert report.ok


@pytest.mark.slow
def test_openvino_compiles_and_runs(digits_files):
    if importlib.util.find_spec("openvino") is None:
        pytest.skip("openvino not installed")
    result = run_consumer(digits_files["int8"], "openvino", n_inputs=N_INPUTS)
    assert result.ran and result.max_lsb is not None, result
    assert result.ok == (result.max_lsb <= 2.0)


@pytest.mark.slow
def test_openvino_within_2_lsb_with_8bit_weights(digits_files):
    """Full-range int8 weights: within 2 LSB on a VNNI CPU; on AVX2 without VNNI the u8s8 kernels
    saturate (measured ~34 LSB), which is why the openvino preset uses 7-bit weights."""
    if importlib.util.find_spec("openvino") is None:
        pytest.skip("openvino not installed")
    _, flags = cpu_info()
    vnni = bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)  # u8 x s8 accumulated in 32 bits
    if not vnni and "avx2" not in flags:
        pytest.skip("not an x86 CPU with AVX2: the u8s8 saturation case does not apply")
    result = run_consumer(digits_files["int8"], "openvino", n_inputs=N_INPUTS)
    if vnni:
        assert result.max_lsb <= 2.0, result
    else:  # vpmaddubsw sums u8 x s8 pairs in int16: full-range weights saturate
        assert result.max_lsb > 2.0, f"expected saturation on this AVX2 CPU without VNNI, got {result}"


def test_tensorrt_is_not_run_here(ort_files):
    result = run_consumer(ort_files["uint8"], "tensorrt")
    assert not result.ran and "statically" in result.detail


def test_onnxruntime_runs_qoperator_file(ort_files):
    result = run_consumer(ort_files["qoperator"], "onnxruntime", n_inputs=3)
    assert result.ran and result.ok


def test_tigris_refuses_qoperator_file_when_run(ort_files):
    if tigris_executable() is None:
        pytest.skip("tigris CLI not installed")
    report = check_file(ort_files["qoperator"], "tigris", run=True, n_inputs=2)
    (result,) = report.runs
    assert result.ran and not result.ok and "tigris compile" in result.detail
    assert not report.ok


def _seven_bit_weights(src, dst):
    """The same file with int8 weights halved (+-63) and their scales doubled."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        weight = inits.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if weight is not None and weight.data_type == onnx.TensorProto.INT8:
            w = numpy_helper.to_array(weight).astype(np.int32)
            scale = numpy_helper.to_array(inits[node.input[1]])
            weight.CopyFrom(numpy_helper.from_array(np.clip(np.round(w / 2), -63, 63).astype(np.int8), weight.name))
            inits[node.input[1]].CopyFrom(numpy_helper.from_array((scale * 2).astype(np.float32), node.input[1]))
    onnx.save(model, str(dst))
    return dst


@pytest.mark.slow
def test_openvino_within_2_lsb_with_7bit_weights(digits_files, tmp_path):
    if importlib.util.find_spec("openvino") is None:
        pytest.skip("openvino not installed")
    path = _seven_bit_weights(digits_files["int8"], tmp_path / "seven_bit.onnx")
    before = {f.rule for f in check_file(digits_files["int8"], "openvino").findings}
    report = check_file(path, "openvino", run=True, n_inputs=N_INPUTS)
    assert "weight_range_7bit" in before and "weight_range_7bit" not in {f.rule for f in report.findings}
    (result,) = report.runs
    assert result.ran and result.max_lsb <= 2.0, result
    assert report.ok


# --- the run verdict: passed / failed / inconclusive, and CheckReport's one verdict -----------------

def _run(status: str, max_lsb: float | None = 1.0, tolerance: float | None = 2.0, consumer: str = "OpenVINO",
         detail: str = ""):
    from quantship.inspect.judge.runs import RunResult

    return RunResult(consumer, True, status == "passed", detail, 20, max_lsb, 0.1 if max_lsb else None,
                     tolerance, status)


def test_judge_names_a_tolerance_miss_failed_and_a_constant_reference_inconclusive():
    from quantship.inspect.judge.runs import judge

    assert judge("OpenVINO", 1.5, 0.2, 2.0, 20, constant=False).status == "passed"
    miss = judge("OpenVINO", 3.0, 0.5, 2.0, 20, constant=False)
    assert miss.status == "failed" and not miss.ok and "max 3.0 LSB > tolerance 2" in str(miss)
    vacuous = judge("OpenVINO", 0.0, 0.0, 2.0, 20, constant=True)
    assert vacuous.status == "inconclusive" and not vacuous.ok and "real inputs" in vacuous.detail
    # a miss is a failure even when the reference is constant; float outputs cannot be judged in LSB
    assert judge("OpenVINO", 9.0, 1.0, 2.0, 20, constant=True).status == "failed"
    assert judge("OpenVINO", None, None, 2.0, 20, constant=False).status == "inconclusive"
    assert judge("ONNX Runtime", None, None, None, 20, constant=False).status == "passed"


def test_constant_reference():
    import numpy as np

    from quantship.inspect.run.consumers import constant_reference

    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert not constant_reference([[rows]])
    assert constant_reference([[np.ones((3, 2))]]) and constant_reference([[np.ones((1, 2))], [np.ones((1, 2))]])
    assert constant_reference([[rows[:1]]])  # one row cannot show that the output varies
    assert not constant_reference([[rows[:1]], [rows[1:2]]])


def test_check_report_verdict_precedence_and_summary():
    from quantship.inspect.judge.check import CheckReport, Finding

    def report(findings=(), runs=()):
        return CheckReport("f.onnx", "openvino", "QDQ", list(findings), list(runs))

    refusal = Finding("static_scales", "error", "m", ["a", "b"], "fix")
    assert report().verdict == "accepted" and report().ok and report().summary() == "accepted"
    assert report(runs=[_run("passed")]).summary() == "accepted (ran: OpenVINO 1.0 LSB <= 2)"
    failed = report(runs=[_run("failed", max_lsb=3.0)])
    assert failed.verdict == "failed" and not failed.ok
    assert failed.summary() == "failed: OpenVINO 3.0 LSB > tolerance 2"
    crashed = report(runs=[_run("failed", max_lsb=None, detail="RuntimeError: tigris compile refused the file")])
    assert crashed.summary() == "failed: OpenVINO: RuntimeError: tigris compile refused the file"
    vacuous = report(runs=[_run("inconclusive", max_lsb=0.0, detail="inconclusive: pass real inputs")])
    assert vacuous.verdict == "inconclusive" and not vacuous.ok and "pass real inputs" in vacuous.summary()
    assert report([refusal], [_run("failed", 3.0)]).verdict == "refused"  # a static refusal comes first
    assert report([refusal]).summary() == "refused: static_scales (2)"
    assert report(runs=[_run("failed", 3.0), _run("inconclusive")]).verdict == "failed"
    not_run = _run("not run")
    not_run = type(not_run)(**{**not_run.as_dict(), "ran": False})
    absent = report(runs=[not_run])  # a consumer absent here: never "accepted", the reason in the summary
    assert absent.verdict == "not run" and absent.ok and absent.as_dict()["verdict"] == "not run"
    assert absent.summary().startswith("not run (OpenVINO: ") and "the rules accept the file" in absent.summary()
    assert report(runs=[failed.runs[0]]).as_dict()["verdict"] == "failed"


def test_run_on_given_inputs(digits_files):
    from quantship.examples.digits import load_split

    real = load_split().x_test[:6].numpy()
    result = run_consumer(digits_files["int8"], "onnxruntime", n_inputs=4, inputs=real)
    assert result.ran and result.inputs == "given" and result.n_inputs == 4  # batch-1 file, capped at n
    assert result.status == "passed" and result.max_lsb is not None


def test_constant_output_file_is_inconclusive_never_a_pass(constant_file):
    report = check_file(constant_file, "onnxruntime", run=True, n_inputs=4)
    (result,) = report.runs
    assert result.ran and result.status == "inconclusive" and "real inputs" in result.detail
    assert report.verdict == "inconclusive" and not report.ok


def test_a_consumer_crash_is_a_failed_run_not_a_dead_process(digits_files, tmp_path, monkeypatch):
    """OpenVINO runs in a child process: a crash inside it (a segfault was seen on a DenseNet-121 file)
    becomes a failed run with a one-line reason, and this process lives on."""
    pytest.importorskip("openvino")
    from quantship.inspect.run import consumers

    crasher = tmp_path / "python-that-crashes"
    crasher.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crasher.chmod(0o755)
    monkeypatch.setattr(consumers.sys, "executable", str(crasher))
    result = run_consumer(digits_files["int8"], "openvino", n_inputs=2)
    assert result.ran and not result.ok and "OpenVINO crashed on this file (signal 11)" in result.detail


def test_a_tigris_output_comes_back_in_the_file_s_layout_whatever_its_rank():
    """TiGrIS returns channels last; the file's layout is channels first (4-D) or what it declares (a YOLO
    head's [1, 22, 2100] comes back as [1, 2100, 22])."""
    image = np.arange(2 * 5 * 6 * 3).reshape(2, 5, 6, 3)  # N H W C
    assert channels_first(image, (2, 3, 5, 6)).shape == (2, 3, 5, 6)
    head = np.arange(2100 * 22).reshape(1, 2100, 22)
    back = channels_first(head, (1, 22, 2100))
    assert back.shape == (1, 22, 2100) and back[0, 3, 7] == head[0, 7, 3]
    assert channels_first(head, (1, 2100, 22)) is head  # already the declared layout
    assert channels_first(head, (1, None, 22)) is head  # a dynamic dim: nothing to match against
    logits = np.zeros((1, 2))
    assert channels_first(logits, (1, 2)) is logits


def test_a_tigris_compile_refusal_names_the_operator_and_tigris_s_reason(tmp_path):
    """A rank-2 ReduceSum (magika's written-out LayerNorm has them): TiGrIS refuses it; the verdict's one
    line carries the operator and TiGrIS's own reason from ``tigris analyze``, not "no plan written"."""
    if tigris_executable() is None:
        pytest.skip("tigris CLI not installed")
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def qdq(name):
        return [helper.make_node("QuantizeLinear", [name, "s", "z"], [f"{name}_q"]),
                helper.make_node("DequantizeLinear", [f"{name}_q", "s", "z"], [f"{name}_d"])]

    nodes = [*qdq("x"), helper.make_node("ReduceSum", ["x_d", "axes"], ["total"], name="row_sum", keepdims=0),
             *qdq("total")]
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"), numpy_helper.from_array(np.array(0, np.int8), "z"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 10])],
                              [helper.make_tensor_value_info("total_d", TensorProto.FLOAT, [1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path / "reduce.onnx"
    onnx.save(model, str(path))
    result = run_consumer(path, "tigris", n_inputs=2)
    assert result.status == "failed" and "row_sum" in result.detail and "ReduceSum" in result.detail, result
    assert "no plan written" not in result.detail
