"""SmoothQuant in the ONNX quantizer: the float function is kept (ORT, tight tolerance), only the smoothed
layers' weights and their producers' parameters change, 1 / s is folded only where it is exact (a layer
without such a producer is skipped and says why), a LayerNorm with outlier channels quantizes better than
plain, and the CLI flag runs end to end with a bad alpha refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from quantship.cli.main import main
from quantship.errors import SpecRefused
from quantship.examples import real
from quantship.quantize_onnx import quantize_onnx_file
from quantship.quantize_onnx import smooth_quant as sq
from tests.quantize_onnx import graphs, outlier

C, OUT = 32, 16
OUTLIERS = [3, 11, 20, 21]  # channels where the activation is ~40x the others (what SmoothQuant moves)
ROOT = Path(__file__).resolve().parents[2]


def _outlier_gamma() -> np.ndarray:
    gamma = np.linspace(0.8, 1.2, C).astype(np.float32)
    gamma[OUTLIERS] = 40.0
    return gamma


def _init(array, name):
    return numpy_helper.from_array(np.asarray(array, np.float32), name)


def layer_norm_projections(readers: int = 1) -> onnx.ModelProto:
    """x -> LayerNormalization (outlier channels in its scale) -> ``readers`` MatMul projections, summed."""
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], name="ln", axis=-1)]
    inits = [_init(_outlier_gamma(), "gamma"), graphs.weight(C, name="beta")]
    outs = []
    for k in range(readers):
        nodes.append(helper.make_node("MatMul", ["ln", f"w{k}"], [f"p{k}"], name=f"proj{k}"))
        inits.append(graphs.weight(C, OUT, name=f"w{k}"))
        outs.append(f"p{k}")
    total = outs[0]
    for k, name in enumerate(outs[1:]):
        nodes.append(helper.make_node("Add", [total, name], [f"sum{k}"], name=f"sum{k}"))
        total = f"sum{k}"
    nodes.append(helper.make_node("Add", [total, "b"], ["y"], name="bias"))
    inits.append(graphs.weight(OUT, name="b"))
    return graphs.model(nodes, [graphs.value("x", ["n", C])], [graphs.value("y", ["n", OUT])], inits)


def chains() -> onnx.ModelProto:
    """Every fold the pass knows, in one graph:
    x -> fc1 (Gemm, transB) -> Add(c) -> fc2 (MatMul): 1 / s into fc1's output channels and the Add's constant;
    x -> fc3 -> (h3 * (r * gamma)) + beta -> fc4: a LayerNorm written out, 1 / s into gamma and beta;
    x -> fc5 -> Div(d) -> fc6: the divisor multiplied by s;
    fc1 also reads the graph input x directly (skipped: nothing to fold into), and fc7 reads a Relu (skipped)."""
    f = 8
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], name="fc1", transB=1),
             helper.make_node("Add", ["h1", "c1"], ["a1"], name="add1"),
             helper.make_node("MatMul", ["a1", "w2"], ["y2"], name="fc2"),
             helper.make_node("MatMul", ["x", "w3"], ["h3"], name="fc3"),
             helper.make_node("ReduceSum", ["h3"], ["r0"], name="rsum", keepdims=1),
             helper.make_node("Abs", ["r0"], ["r1"], name="rabs"),
             helper.make_node("Add", ["r1", "one"], ["r"], name="rpos"),
             helper.make_node("Mul", ["r", "gamma"], ["rg"], name="rg"),
             helper.make_node("Mul", ["h3", "rg"], ["n3"], name="norm"),
             helper.make_node("Add", ["n3", "beta"], ["a3"], name="shift"),
             helper.make_node("MatMul", ["a3", "w4"], ["y4"], name="fc4"),
             helper.make_node("MatMul", ["x", "w5"], ["h5"], name="fc5"),
             helper.make_node("Div", ["h5", "d"], ["a5"], name="div"),
             helper.make_node("MatMul", ["a5", "w6"], ["y6"], name="fc6"),
             helper.make_node("Relu", ["h5"], ["r5"], name="relu"),
             helper.make_node("MatMul", ["r5", "w7"], ["y7"], name="fc7")]
    spread = np.ones(C, np.float32)
    spread[OUTLIERS] = 30.0
    inits = [_init(np.random.default_rng(5).standard_normal((C, f)) * spread[:, None], "w1"), _init(spread, "b1"),
             _init(spread * 0.1, "c1"), graphs.weight(C, OUT, name="w2"), graphs.weight(f, C, name="w3"),
             _init(1.0, "one"), _init(spread.reshape(1, C), "gamma"), graphs.weight(1, C, name="beta"),
             graphs.weight(C, OUT, name="w4"), graphs.weight(f, C, name="w5"), _init(1.0 / spread, "d"),
             graphs.weight(C, OUT, name="w6"), graphs.weight(C, OUT, name="w7")]
    outs = [graphs.value(y, ["n", OUT]) for y in ("y2", "y4", "y6", "y7")]
    return graphs.model(nodes, [graphs.value("x", ["n", f])], outs, inits)


def conv_1x1(depthwise: bool = False) -> onnx.ModelProto:
    """x -> Conv 3x3 (outlier output channels; depthwise, MobileNet's pattern, if asked) -> Conv 1x1:
    1 / s into the first conv's weight and bias."""
    spread = np.ones(C, np.float32)
    spread[OUTLIERS] = 30.0
    shape, group = ((C, 1, 3, 3), C) if depthwise else ((C, 3, 3, 3), 1)
    w1 = np.random.default_rng(6).standard_normal(shape).astype(np.float32) * spread[:, None, None, None]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1], group=group),
             helper.make_node("Conv", ["c1", "w2", "b2"], ["y"], name="conv2")]
    inits = [_init(w1, "w1"), _init(spread, "b1"), graphs.weight(OUT, C, 1, 1, name="w2"), graphs.weight(OUT, name="b2")]
    x_channels = C if depthwise else 3
    return graphs.model(nodes, [graphs.value("x", ["n", x_channels, 6, 6])], [graphs.value("y", ["n", OUT, 6, 6])],
                        inits)


def _data(m: onnx.ModelProto, n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feed = {}
    for i in m.graph.input:
        dims = [d.dim_value or n for d in i.type.tensor_type.shape.dim]
        feed[i.name] = rng.standard_normal(dims).astype(np.float32)
    return feed


def _run(m: onnx.ModelProto | Path, feed) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = m.SerializeToString() if isinstance(m, onnx.ModelProto) else str(m)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None, feed)


def _smoothed(m: onnx.ModelProto, alpha: float = 0.5) -> tuple[onnx.ModelProto, sq.Smoother]:
    model = ir.from_proto(m)
    smoother = sq.Smoother(alpha, [_data(m, 32, seed=1)])
    smoother.run(model)
    return ir.to_proto(model), smoother


def _weights(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


@pytest.mark.parametrize("build, smoothed, skipped", [
    (layer_norm_projections, {"proj0"}, set()),
    (lambda: layer_norm_projections(3), {"proj0", "proj1", "proj2"}, set()),
    (chains, {"fc2", "fc4", "fc6"}, {"fc1", "fc3", "fc5", "fc7"}),
    (conv_1x1, {"conv2"}, set()),
    (lambda: conv_1x1(depthwise=True), {"conv2"}, set()),
])
def test_the_float_outputs_are_kept_and_the_record_names_each_layer(build, smoothed, skipped):
    m = build()
    after, smoother = _smoothed(m)
    record = smoother.record()
    assert set(record["smoothed"]) == smoothed and set(record["skipped"]) == skipped
    assert record["layers_smoothed"] == len(smoothed) and record["largest_scale"] > 2  # the outliers moved
    feed = _data(m, 64, seed=2)  # not the calibration data
    for before, now in zip(_run(m, feed), _run(after, feed)):
        assert np.abs(before - now).max() <= 1e-5 * np.abs(before).max()  # float rounding only


def test_the_skip_reasons_say_why():
    _, smoother = _smoothed(chains())
    skipped = smoother.record()["skipped"]
    assert all("graph input" in skipped[k] for k in ("fc1", "fc3", "fc5"))  # x: one group, nothing to fold into
    assert "Relu cannot take 1 / s" in skipped["fc7"]
    m = layer_norm_projections(1)
    m.graph.node.append(helper.make_node("Relu", ["ln"], ["r"], name="side"))
    m.graph.output.append(graphs.value("r", ["n", C]))
    after, smoother = _smoothed(m)  # the LayerNorm's output also feeds a Relu: one s cannot serve both
    assert smoother.record()["skipped"] == {"proj0": "its input is also read by Relu side"}
    assert _weights(after).keys() == _weights(m).keys()
    assert all(np.array_equal(a, _weights(m)[k]) for k, a in _weights(after).items())


def test_only_the_smoothed_layers_weights_and_their_producers_params_change():
    m = chains()
    before, (after, _) = _weights(m), _smoothed(m)
    now = _weights(after)
    changed = {k for k in before if k not in now or not np.array_equal(before[k], now[k])}
    assert changed == {"w2", "w1", "b1", "c1",  # fc2; fc1's output channels and the Add constant after it
                       "w4", "gamma", "beta",  # fc4; the written-out LayerNorm's gamma and beta
                       "w6", "d"}  # fc6; the divisor
    assert set(now) == set(before)  # nothing added: every constant changed had one reader


def test_a_shared_activation_gets_one_scale_for_all_its_readers():
    m = layer_norm_projections(3)
    before, (after, _) = _weights(m), _smoothed(m)
    now = _weights(after)
    ratios = [now[f"w{k}"][:, 0] / before[f"w{k}"][:, 0] for k in range(3)]  # s per input channel
    assert np.allclose(ratios[0], ratios[1]) and np.allclose(ratios[0], ratios[2])
    assert np.allclose(before["gamma"] / now["gamma"], ratios[0], rtol=1e-5)
    assert ratios[0][OUTLIERS].min() > 3 * np.median(ratios[0])  # the outlier channels move most


def test_a_constant_with_other_readers_is_copied_not_changed():
    m = layer_norm_projections(1)
    m.graph.node.append(helper.make_node("Mul", ["x", "gamma"], ["g2"], name="other_reader"))
    m.graph.output.append(graphs.value("g2", ["n", C]))
    after, smoother = _smoothed(m)
    now = _weights(after)
    assert np.array_equal(now["gamma"], _outlier_gamma())  # other_reader still reads the original
    assert "gamma_smoothed" in now and smoother.record()["layers_smoothed"] == 1
    feed = _data(m, 16, seed=2)
    for before, current in zip(_run(m, feed), _run(after, feed)):
        assert np.abs(before - current).max() <= 1e-5 * np.abs(before).max()


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan"), "half"])
def test_a_bad_alpha_is_refused_before_any_work(tmp_path, alpha):
    path = graphs.save(layer_norm_projections(), tmp_path / "ln.onnx")
    out = tmp_path / "out.onnx"
    with pytest.raises(SpecRefused, match=r"alpha.*\[0, 1\]"):
        quantize_onnx_file(path, out, _data(onnx.load(str(path)), 8, 0)["x"], target="onnxruntime-cpu",
                           smooth_quant=alpha)
    assert not out.exists() and list(tmp_path.iterdir()) == [path]


def _error(path: Path, x: np.ndarray, reference: np.ndarray) -> float:
    batch = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim[0].dim_value or len(x)  # tigris: 1
    out = np.concatenate([_run(path, {"x": x[i:i + batch]})[0] for i in range(0, len(x), batch)])
    return float(np.abs(out - reference).mean())


@pytest.mark.parametrize("target", ["onnxruntime-cpu", "tigris"])
def test_outlier_channels_quantize_better_smoothed_than_plain(tmp_path, target):
    m = layer_norm_projections(1)
    path = graphs.save(m, tmp_path / "ln.onnx")
    calib, held_out = _data(m, 128, seed=1)["x"], _data(m, 512, seed=2)["x"]
    reference = _run(m, {"x": held_out})[0]
    batches = [calib[i:i + 16] for i in range(0, len(calib), 16)]
    plain = quantize_onnx_file(path, tmp_path / "plain.onnx", batches, target=target, run_check=False)
    smooth = quantize_onnx_file(path, tmp_path / "smooth.onnx", batches, target=target, run_check=False,
                                smooth_quant=0.5)
    assert "smooth_quant" not in plain.algorithms
    record = smooth.algorithms["smooth_quant"]
    assert record["layers_smoothed"] == 1 and record["alpha"] == 0.5
    assert record["max_abs_diff"] <= 1e-5 * np.abs(reference).max()
    err_plain, err_smooth = _error(plain.path, held_out, reference), _error(smooth.path, held_out, reference)
    # measured (mean abs error, plain -> smoothed): onnxruntime-cpu 0.49 -> 0.30 (0.60x), tigris 0.52 -> 0.36
    # (0.69x); the outlier channels set the per-tensor grid of the LayerNorm's output in the plain file
    assert err_smooth < 0.8 * err_plain, (err_smooth, err_plain)
    meta = {p.key: p.value for p in onnx.load(str(smooth.path)).metadata_props}
    assert "smooth_quant: alpha 0.5, layers_smoothed 1" in meta["quantship.algorithms"]
    assert "smooth_quant: 1" in meta["quantship.normalised"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run([sys.executable, "-m", "quantship", "quantize-onnx", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def test_the_cli_flag_end_to_end_and_a_bad_alpha_in_one_line(tmp_path):
    path = graphs.save(layer_norm_projections(3), tmp_path / "ln.onnx")
    np.save(tmp_path / "cal.npy", _data(onnx.load(str(path)), 64, seed=1)["x"])
    out = tmp_path / "int8.onnx"
    done = _cli(str(path), "--calib", str(tmp_path / "cal.npy"), "--out", str(out), "--smooth-quant", "--quiet")
    assert done.returncode == 0, done.stderr
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert "smooth_quant: alpha 0.5, layers_smoothed 3" in meta["quantship.algorithms"]
    for bad in ("1.5", "-1"):
        refused = tmp_path / f"refused{bad}.onnx"
        done = _cli(str(path), "--calib", str(tmp_path / "cal.npy"), "--out", str(refused), f"--smooth-quant={bad}")
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "[0, 1]" in done.stderr and "Traceback" not in done.stderr and not refused.exists()


def test_magika_s_layer_norm_is_folded_and_its_outputs_kept():
    """The real transformer-like file: its LayerNorm is written out (``(x - mean) * (rstd * gamma) + beta``)
    before the classifier head ``Dense_1``, which is smoothed; ``Dense_0`` reads a one-hot Cast and is
    skipped. Random bytes are valid input (the proof needs the function, not real files)."""
    try:
        real.require("magika")
    except real.MissingPackage as exc:
        pytest.skip(str(exc))
    from quantship.examples.real import magika_files

    m = onnx.load(str(magika_files.model_path()))
    name = m.graph.input[0].name
    rng = np.random.default_rng(0)
    calib = {name: rng.integers(0, 257, (16, 2048)).astype(np.int32)}
    held_out = {name: rng.integers(0, 257, (16, 2048)).astype(np.int32)}
    model = ir.from_proto(m)
    smoother = sq.Smoother(0.5, [calib])
    smoother.run(model)
    record = smoother.record()
    assert [k.rsplit("/", 2)[-2] for k in record["smoothed"]] == ["Dense_1"]
    assert [(k.split("MagikaV2/")[-1], why) for k, why in record["skipped"].items()] == [
        ("Dense_0/einsum/Einsum", "its producer Cast cannot take 1 / s exactly")]
    before, after = _run(m, held_out)[0], _run(ir.to_proto(model), held_out)[0]
    assert np.abs(before - after).max() <= 1e-5 * np.abs(before).max()


@pytest.mark.parametrize("extra, said", [(["--engine", "ort"], "quantship's engine only")])
def test_the_cli_refuses_smooth_quant_where_it_does_not_run(tmp_path, capsys, extra, said):
    path = graphs.save(layer_norm_projections(), tmp_path / "ln.onnx")
    x = _data(onnx.load(str(path)), 16, seed=1)["x"]
    np.save(tmp_path / "cal.npy", x)
    np.savez(tmp_path / "eval.npz", x=x, y=np.zeros(len(x), np.int64))
    out = tmp_path / "int8.onnx"
    argv = [str(tmp_path / "eval.npz") if a == "EVAL" else a for a in extra]
    assert main(["quantize-onnx", str(path), "--calib", str(tmp_path / "cal.npy"), "--out", str(out),
                 "--smooth-quant", "0.5", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and not out.exists()


def test_the_accuracy_search_runs_smoothed_and_the_outlier_needs_no_float_layer(tmp_path, capsys):
    """``outlier.model``: fc1's channel 0 is 400x the others and fc2 does not read it (its weights there
    are zero). Plain min/max int8 misses a 3-point budget (tests/quantize_onnx/test_search.py); smoothed,
    step 0 already fits, so the search keeps nothing in float."""
    files = outlier.files(tmp_path)
    out = tmp_path / "q.onnx"
    assert main(["quantize-onnx", str(files["float"]), "--calib", str(files["calib"]), "--out", str(out),
                 "--observer", "minmax", "--eval", str(files["eval"]), "--max-drop", "3", "--smooth-quant",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["accuracy_search"]["chosen"] == [] and len(doc["accuracy_search"]["steps"]) == 1
    assert doc["algorithms"]["smooth_quant"]["smoothed"].keys() == {"fc2"}
