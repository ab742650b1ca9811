"""The speed search (``quantize_onnx.speed``): files timed in ONNX Runtime on this CPU, the weighted ops
whose integer form made the file slower kept float, the chosen file written with every check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from quantship.errors import SpecRefused
from quantship.export.speed_gate import SEARCH_KEY, faster
from quantship.inspect.run.timing import cpu_line, median_ms, single_thread_session
from quantship.quantize_onnx import speed
from quantship.quantize_onnx.speed import speed_search_onnx
from tests.quantize_onnx import graphs
from tests.quantize_onnx.real_nets import mtcnn_file


@pytest.fixture(scope="module")
def stem_file(tmp_path_factory) -> tuple[Path, np.ndarray]:
    folder = tmp_path_factory.mktemp("speed")
    path = graphs.save(graphs.stem_then_body(), folder / "stem.onnx")
    return path, np.random.default_rng(0).random((16, 1, 96, 96)).astype(np.float32)


@pytest.fixture(scope="module")
def searched(stem_file, tmp_path_factory):
    path, x = stem_file
    out = tmp_path_factory.mktemp("speed_out") / "int8.onnx"
    return out, *speed_search_onnx(path, out, x, target="onnxruntime-cpu", seconds=0.25)


def test_two_sessions_of_one_file_time_alike(stem_file):
    """The timer itself: the same file in two sessions, interleaved, reads within 15% of itself."""
    path, x = stem_file
    (a, b), rounds = median_ms([single_thread_session(path), single_thread_session(path)], {"x": x[:1]}, 0.3)
    assert rounds >= 10 and a > 0 and b > 0
    assert 0.85 < a / b < 1.18, (a, b)


def test_the_one_channel_stem_is_kept_float_and_the_file_is_faster(searched):
    """ORT's integer Conv over a 1-channel 96 x 96 image is several times slower than its float kernel
    (bench/conv_speed.py): the search keeps the stem float, and the final side-by-side reading of the
    written file's twin is faster than step 0's at every batch."""
    out, result, search = searched
    assert search.steps[0].kind == "start" and search.candidates == ["stem", "body1", "body2", "head"]
    assert "stem" in search.chosen and len(search.chosen) < len(search.candidates)
    for b in search.batches:
        assert search.final_ms["chosen"][b] < search.final_ms["start"][b], search.final_ms
    assert search.batches == (1, 8)
    for s in search.steps[1:]:  # each step was kept exactly when its own timing says faster
        assert s.kept == (s.ms != {} and faster(s.ms, s.against))


def test_the_written_file_records_the_search_and_passes_its_checks(searched):
    out, result, search = searched
    assert result.verdict.verdict == "accepted" and out.is_file()
    assert set(result.excluded) == set(search.chosen)
    assert result.census["n_integer"] == len(search.candidates) - len(search.chosen)
    props = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert props[SEARCH_KEY] == search.describe() and cpu_line() in props[SEARCH_KEY]
    assert sorted(p.name for p in out.parent.iterdir()) == ["int8.onnx"], "the search left files behind"


def test_max_steps_zero_times_step_zero_only(stem_file, tmp_path):
    path, x = stem_file
    result, search = speed_search_onnx(path, tmp_path / "q.onnx", x, target="onnxruntime-cpu", max_steps=0,
                                       seconds=0.1)
    assert [s.kind for s in search.steps] == ["start"] and search.chosen == ()
    assert result.census["n_integer"] == 4


def test_a_fixed_batch_file_is_timed_at_its_own_batch(tmp_path):
    m = graphs.conv_relu_conv()
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 2
    path = graphs.save(m, tmp_path / "fixed.onnx")
    feeds = speed.timing_feeds(path, graphs.images(4), (1, 8))
    assert list(feeds) == [2] and feeds[2]["x"].shape == (2, 3, 8, 8)


def test_other_targets_are_refused_before_any_work(stem_file, tmp_path):
    path, x = stem_file
    with pytest.raises(SpecRefused, match="ONNX Runtime on this CPU"):
        speed_search_onnx(path, tmp_path / "q.onnx", x, target="tensorrt")
    assert not list(tmp_path.iterdir())


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantship", "quantize-onnx", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_speed_search_reports_its_steps(stem_file, tmp_path):
    path, x = stem_file
    calib = tmp_path / "calib.npy"
    np.save(calib, x)
    out = tmp_path / "int8.onnx"
    done = _cli(str(path), "--calib", str(calib), "--out", str(out), "--speed-search", "--max-steps", "1", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [s["kind"] for s in report["speed_search"]["steps"]] == ["start", "prefix"]
    assert report["speed_search"]["cpu"] == cpu_line() and out.is_file()


@pytest.mark.parametrize("extra, says", [
    (("--target", "tensorrt"), "serves --target onnxruntime-cpu"),
    (("--max-drop", "1", "--eval", "x.npz"), "two searches"),
    (("--engine", "ort"), "--engine ort"),
])
def test_cli_refusals_are_one_line_and_write_nothing(stem_file, tmp_path, extra, says):
    path, x = stem_file
    calib = tmp_path / "calib.npy"
    np.save(calib, x[:2])
    out = tmp_path / "int8.onnx"
    (tmp_path / "x.npz").touch()  # paths are checked first: it exists, so the refusal of the options speaks
    extra = tuple(str(tmp_path / e) if e == "x.npz" else e for e in extra)
    done = _cli(str(path), "--calib", str(calib), "--out", str(out), "--speed-search", *extra)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists()


def test_the_real_pnet_at_12_px_gets_faster_with_its_first_convs_float(tmp_path):
    """facenet-pytorch's PNet on 12 x 12 crops (REAL.md's task): 20-30 us of FP32 work, where every
    integer file (ORT's, NNCF's, ours) ran at about 0.7x FP32. The search keeps its first Convs float
    (prefix steps) and the written file is faster than step 0's at batch 1 and 8, its face probability
    still agreeing with FP32 on every calibration crop."""
    path, crops = mtcnn_file("pnet", tmp_path, dynamic_batch=True)
    result, search = speed_search_onnx(path, tmp_path / "pnet_int8.onnx", crops, target="onnxruntime-cpu",
                                       seconds=0.25)
    assert search.chosen and search.chosen[0] == search.candidates[0]
    for b in (1, 8):
        assert search.final_ms["chosen"][b] < search.final_ms["start"][b], search.final_ms
    assert result.fidelity["fused"]["argmax_agreement"] == 1.0 and result.verdict.verdict == "accepted"


def test_single_steps_try_the_shortest_reductions_first(stem_file, tmp_path):
    """stem: 1 x 3 x 3 = 9 products per output; head 64 (1x1 over 64 channels); body1 16 x 9 = 144; body2 576."""
    path, _ = stem_file
    names = ["stem", "body1", "body2", "head"]
    assert speed.by_reduction_length(path, names) == ["stem", "head", "body1", "body2"]


def test_the_callers_exclusions_stay_float_and_are_not_counted_as_the_searchs(stem_file, tmp_path):
    path, x = stem_file
    out = tmp_path / "q.onnx"
    result, search = speed_search_onnx(path, out, x, target="onnxruntime-cpu", exclude=["head"], max_steps=0,
                                       seconds=0.1)
    assert search.chosen == ("head",) and search.added == () and "head" not in search.candidates
    assert result.excluded == ["head"] and search.describe().startswith("0 weighted op(s) kept float for speed")
