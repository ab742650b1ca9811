"""Bias correction: only bias initializers change, the per-channel mean shift of the quantized output
shrinks, layers of one depth share a pass, and the CLI flags reach the file's provenance."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from quantship.cli.main import main
from quantship.quantize_onnx import quantize_onnx_file
from tests.quantize_onnx import graphs

X = graphs.images(32, seed=4)


def _quantize(path, out, **options):
    return quantize_onnx_file(path, out, [X[:16], X[16:]], target="onnxruntime-cpu", run_check=False, **options)


def _literal(path, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_bias_correction_changes_only_bias_initializers(tmp_path):
    float_path = graphs.save(graphs.conv_relu_conv(), tmp_path / "float.onnx")
    plain = onnx.load(str(_quantize(float_path, tmp_path / "plain.onnx").path))
    result = _quantize(float_path, tmp_path / "corrected.onnx", bias_correction=True)
    corrected = onnx.load(str(result.path))
    assert result.algorithms["bias_correction"]["n_corrected"] == 2
    assert result.algorithms["bias_correction"]["n_added"] == 1  # conv2 had no bias: it got one
    added = [n for n in corrected.graph.node if n.name == "conv2"][0].input[2]
    assert [(n.op_type, [i for i in n.input if i != added]) for n in corrected.graph.node] == \
        [(n.op_type, list(n.input)) for n in plain.graph.node]  # the same graph, plus conv2's new bias input
    before = {t.name: numpy_helper.to_array(t) for t in plain.graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in corrected.graph.initializer}
    assert set(after) == set(before) | {added}
    changed = {name for name in before if not np.array_equal(before[name], after[name])}
    assert changed == {"b1"} and np.abs(after[added]).max() > 0  # only the biases moved
    meta = {p.key: p.value for p in corrected.metadata_props}
    assert meta["quantship.algorithms"].startswith("bias_correction: n_corrected 2, n_added 1")


def test_the_mean_shift_of_the_output_shrinks(tmp_path):
    float_path = graphs.save(graphs.conv_relu_conv(), tmp_path / "float.onnx")
    reference = _literal(float_path, X).mean(axis=(0, 2, 3))
    shift = {}
    for on in (False, True):
        q = _quantize(float_path, tmp_path / f"q{on}.onnx", per_tensor=True, bias_correction=on).path
        shift[on] = np.abs(_literal(q, X).mean(axis=(0, 2, 3)) - reference).max()
    assert shift[True] < 0.5 * shift[False], shift


def test_layers_of_one_depth_are_measured_in_one_pass(tmp_path):
    float_path = graphs.save(graphs.concat_convs(), tmp_path / "float.onnx")
    x = graphs.images(16, shape=(3, 4, 4), seed=2)
    result = quantize_onnx_file(float_path, tmp_path / "q.onnx", x, target="onnxruntime-cpu", run_check=False,
                                bias_correction=True)
    done = result.algorithms["bias_correction"]
    assert done["n_corrected"] == 3 and done["n_passes"] == 2  # conv_a and conv_b side by side, then conv_c
    assert done["samples"] == 16


def matmul_head(with_bias: bool) -> onnx.ModelProto:
    """x [n, 16] -> MatMul(w) (-> Add(b)) -> y [n, 6]."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h" if with_bias else "y"], name="fc")]
    inits = [graphs.weight(16, 6, name="w")]
    if with_bias:
        nodes.append(helper.make_node("Add", ["h", "b"], ["y"], name="bias"))
        inits.append(graphs.weight(6, name="b"))
    return graphs.model(nodes, [graphs.value("x", ["n", 16])], [graphs.value("y", ["n", 6])], inits)


def test_a_matmul_is_corrected_through_its_bias_add_and_skipped_without_one(tmp_path):
    x = np.random.default_rng(5).standard_normal((24, 16)).astype(np.float32) + 0.5
    for with_bias in (True, False):
        path = graphs.save(matmul_head(with_bias), tmp_path / f"fc{with_bias}.onnx")
        result = quantize_onnx_file(path, tmp_path / f"q{with_bias}.onnx", x, target="tigris", run_check=False,
                                    bias_correction=True)
        done = result.algorithms["bias_correction"]
        if with_bias:
            assert done["n_corrected"] == 1 and not done["skipped"]
            stored = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(result.path)).graph.initializer}
            assert not np.array_equal(stored["b"], numpy_helper.to_array(matmul_head(True).graph.initializer[1]))
        else:
            assert done["n_corrected"] == 0 and done["skipped"] == {"fc": "a MatMul without a bias Add after it"}


def test_the_cli_flags_reach_the_provenance_and_ort_engine_refuses_them(tmp_path, capsys):
    float_path = graphs.save(graphs.conv_relu_conv(), tmp_path / "float.onnx")
    np.save(tmp_path / "cal.npy", X)
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(float_path), "--calib", str(tmp_path / "cal.npy"), "--out", str(out),
                 "--equalize", "--bias-correction", "--quiet", "--plain-placement"]) == 0  # both Convs int8 on any CPU
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert "equalize: pairs_changed 1" in meta["quantship.algorithms"]
    assert "bias_correction: n_corrected 2" in meta["quantship.algorithms"]
    capsys.readouterr()
    refused = tmp_path / "ort.onnx"
    assert main(["quantize-onnx", str(float_path), "--calib", str(tmp_path / "cal.npy"), "--out", str(refused),
                 "--engine", "ort", "--equalize"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--equalize run in quantship's engine only" in err[0] and not refused.exists()
