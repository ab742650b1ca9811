"""Placement by profile (``export.profile_place``), the default of ``quantize_onnx`` for ONNX Runtime
targets: per-node costs from one profiled run of each file, the candidates' fixed point, one verification."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from quantship.cli.main import main
from quantship.export.profile_place import (
    NodeCost,
    choose,
    least_loss,
    neighbours,
    next_along_run,
    place_by_profile,
    profile_costs,
)
from quantship.export.speed_gate import SEARCH_KEY, TOLERANCE, faster
from quantship.inspect.run.node_costs import run_costs
from quantship.quantize_onnx.quantizer import quantize_onnx_file
from quantship.quantize_onnx.repair import quantize_onnx
from tests.quantize_onnx import graphs


@pytest.fixture(scope="module")
def stem(tmp_path_factory) -> tuple[Path, np.ndarray, Path]:
    folder = tmp_path_factory.mktemp("profile")
    path = graphs.save(graphs.stem_then_body(), folder / "stem.onnx")
    x = np.random.default_rng(0).random((16, 1, 96, 96)).astype(np.float32)
    plain = quantize_onnx_file(path, folder / "plain.onnx", x, target="onnxruntime-cpu", run_check=False)
    return path, x, plain.path


def wide_convs() -> onnx.ModelProto:
    """Two 3 x 3 Convs of 32 -> 64 -> 64 channels at 32 px: both several times faster as integer kernels here."""
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("Conv", ["r0", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["y"], name="relu1")]
    return graphs.model(nodes, [graphs.value("x", ["n", 32, 32, 32])], [graphs.value("y", ["n", 64, 32, 32])],
                        [graphs.weight(64, 32, 3, 3, name="w0"), graphs.weight(64, 64, 3, 3, name="w1")])


def batch_of_four_only() -> onnx.ModelProto:
    """A symbolic batch that is really 4: a Reshape to [4, 512] (the shapes a batch-1 run needs do not exist)."""
    shape = onnx.numpy_helper.from_array(np.array([4, 512], np.int64), "shape")
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("Reshape", ["r0", "shape"], ["flat"], name="flatten"),
             helper.make_node("MatMul", ["flat", "w1"], ["y"], name="fc")]
    return graphs.model(nodes, [graphs.value("x", ["n", 3, 8, 8])], [graphs.value("y", [4, 10])],
                        [graphs.weight(8, 3, 3, 3, name="w0"), graphs.weight(512, 10, name="w1"), shape])


def test_the_qdq_and_layout_nodes_are_charged_to_the_integer_kernel_they_surround(stem):
    """Every QuantizeLinear, DequantizeLinear and Transpose of the plain file's run lands on a weighted node:
    the per-node totals add up to the run's (the plain file has no other node)."""
    _, x, plain = stem
    costs = run_costs(plain, {"x": x[:1]}, 0.1, ["stem", "body1", "body2", "head"])
    assert set(costs.weighted) == {"stem", "body1", "body2", "head"}
    assert costs.weighted["stem"].qdq_ms > 0 and costs.weighted["stem"].layout_ms > 0  # the input's Q + Transpose
    assert costs.weighted["head"].qdq_ms > 0  # the output's DequantizeLinear
    assert sum(c.ms for c in costs.weighted.values()) == pytest.approx(costs.total_ms, rel=1e-6)
    # each kind has a fixed part (its cheapest node's time) and a part per element beyond it, which is 0.0
    # when the profiler's microsecond clock read every node of that kind alike: never negative, never None
    assert costs.qdq_fixed_ms > 0 and costs.layout_fixed_ms >= 0
    assert costs.qdq_ns_per_element is not None and costs.qdq_ns_per_element >= 0
    assert costs.layout_ns_per_element is not None and costs.layout_ns_per_element >= 0


def test_the_one_channel_stem_is_the_candidate(stem):
    """ORT's integer Conv over a 1-channel 96 x 96 image costs several times its float NCHWc kernel
    (bench/conv_speed.py): the profile names the stem, and the wide Convs after it stay integer."""
    path, x, plain = stem
    weighted = ["stem", "body1", "body2", "head"]
    costs, crossing, fixed = profile_costs(path, plain, weighted, {1: {"x": x[:1]}, 8: {"x": x[:8]}}, seconds=0.2)
    by = {c.node: c for c in costs}
    assert all(by["stem"].int_ms[b] > by["stem"].float_ms[b] for b in (1, 8)), by["stem"]
    candidates, estimated = choose(costs, crossing, *neighbours(onnx.load(str(plain)), weighted), fixed)
    assert "stem" in candidates and "body2" not in candidates, costs
    assert all(estimated["stem"][b] > by["stem"].float_ms[b] for b in (1, 8))  # its output must cross back


def test_adjacent_candidates_are_kept_float_together_or_not_at_all():
    """a -> b -> c: a and b lose as integers only when they need not cross into each other (a group);
    c is faster as an integer kernel. Each element costs 1 ns to cross."""
    def cost(node, int_ms, float_ms):
        return NodeCost(node, {1: int_ms}, {1: float_ms}, {1: 1000_000}, {1: 1000_000})

    before, after = {"a": set(), "b": {"a"}, "c": {"b"}}, {"a": {"b"}, "b": {"c"}, "c": set()}
    costs = [cost("a", 1.5, 1.0), cost("b", 2.5, 1.0), cost("c", 1.0, 4.0)]
    kept, estimated = choose(costs, {1: 1.0}, before, after)
    assert kept == ("a", "b")  # a alone would cross out (1 + 1 ms > 1.5); together only b crosses (1 + 1 < 2.5)
    assert estimated == {"a": {1: 1.0}, "b": {1: 2.0}}
    costs[1] = cost("b", 1.9, 1.0)  # b with its crossing now costs more float: a loses its partner and goes too
    assert choose(costs, {1: 1.0}, before, after) == ((), {})


def test_when_every_weighted_op_loses_as_an_integer_the_one_that_loses_least_stays_integer():
    """Every weighted op float is no INT8 file (the quantizer refuses it: the placement used to give up with "gives
    no file", the plain file kept); the fastest INT8 file keeps integer the op whose integer cost is nearest its
    float one (geometric mean over the batches). Not when an op stays integer already."""
    def cost(node, int_ms, float_ms):
        return NodeCost(node, {1: int_ms[0], 8: int_ms[1]}, {1: float_ms[0], 8: float_ms[1]}, {1: 10, 8: 80},
                        {1: 10, 8: 80})

    costs = [cost("a", (2.0, 9.0), (1.0, 4.0)), cost("b", (1.1, 4.6), (1.0, 4.0)), cost("c", (3.0, 5.0), (1.0, 4.0))]
    before, after = {"a": set(), "b": {"a"}, "c": {"b"}}, {"a": {"b"}, "b": {"c"}, "c": set()}
    kept, estimated = choose(costs, {1: 0.0, 8: 0.0}, before, after)
    assert kept == ("a", "b", "c")
    assert least_loss(kept, estimated, costs, ["a", "b", "c"]) == "b"  # 1.1x and 1.15x: the nearest to float
    assert least_loss(("a", "c"), estimated, costs, ["a", "b", "c"]) is None  # b stays integer already
    assert least_loss((), {}, costs, ["a", "b", "c"]) is None


def test_a_chosen_set_grows_along_its_run_by_the_largest_loss_first():
    """The neighbours of the kept set whose integer kernel the profile read slower (geometric mean over the
    batches), by any margin (a few microseconds each on MTCNN PNet, below what the crossing estimate tells): the
    largest saving first; none that wins as an integer kernel on the mean; nothing when the set is empty."""
    def cost(node, int_ms, float_ms):
        return NodeCost(node, dict(enumerate(int_ms, 1)), dict(enumerate(float_ms, 1)), {1: 10, 2: 10}, {1: 10, 2: 10})

    before = {"a": set(), "b": {"a"}, "c": {"b"}, "d": {"b"}, "e": {"c", "d"}}
    after = {"a": {"b"}, "b": {"c", "d"}, "c": {"e"}, "d": {"e"}, "e": set()}
    costs = [cost("a", (0.025, 0.057), (0.012, 0.030)), cost("b", (0.011, 0.017), (0.008, 0.012)),
             cost("c", (0.010, 0.012), (0.009, 0.0115)), cost("d", (0.010, 0.013), (0.009, 0.011)),
             cost("e", (0.050, 0.010), (0.040, 0.014))]
    assert next_along_run(costs, ("a",), before, after) == "b"
    assert next_along_run(costs, ("a", "b"), before, after) == "d"  # 3 us saved against c's 1.5 us
    assert next_along_run(costs, ("a", "b", "c", "d"), before, after) is None  # e: 1.25x slower at b1, 1.4x faster at b2
    assert next_along_run(costs, (), before, after) is None


def test_the_chosen_file_follows_the_verification(stem, tmp_path):
    """The written file is the profile's only when its own side-by-side reading says faster by the search's
    rule, and then it is no slower than the plain file at any batch beyond the tolerance."""
    path, x, _ = stem
    result, _ = quantize_onnx(path, tmp_path / "q.onnx", x, target="onnxruntime-cpu", budget=None)
    record = result.profile
    assert record.candidates and "stem" in record.candidates and record.not_run is None
    assert record.chosen == faster(record.verified_ms["profile"], record.verified_ms["plain"])
    assert set(record.batches) == {1, 16}
    if record.chosen:
        assert set(record.kept_float) <= set(result.excluded)
        assert all(g >= 1 - TOLERANCE for g in record.gain.values())
        assert record.kept_float == (*record.candidates, *record.grown) and len(record.kept_float) < 4
        for k, step in enumerate(record.grown_ms):  # each growth kept was verified faster; a refused one ends it
            assert faster(step["grown"], step["before"]) == (k < len(record.grown))
    else:
        assert result.excluded == []
    props = {p.key: p.value for p in onnx.load(str(result.path)).metadata_props}
    said = json.loads(props[SEARCH_KEY])
    assert said["kept_float"] == list(record.kept_float) and said["chosen"] == record.chosen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx"], "the trial file was left behind"


def test_no_candidate_leaves_the_plain_placement(tmp_path):
    """Convs that run faster as integer kernels: nothing kept float, the graph written is the plain one's."""
    path = graphs.save(wide_convs(), tmp_path / "wide.onnx")
    x = np.random.default_rng(1).random((8, 32, 32, 32)).astype(np.float32)
    by_profile, _ = quantize_onnx(path, tmp_path / "default.onnx", x, target="onnxruntime-cpu", budget=None)
    plain, _ = quantize_onnx(path, tmp_path / "plain.onnx", x, target="onnxruntime-cpu", budget=None,
                             profile_placement=False)
    assert by_profile.profile.candidates == () and "no weighted op" in by_profile.profile.not_run
    assert plain.profile is None
    graph = [onnx.load(str(p)).graph.SerializeToString() for p in (by_profile.path, plain.path)]
    assert graph[0] == graph[1]


def test_a_profile_that_cannot_run_leaves_the_plain_file_and_says_so(tmp_path, capfd):
    """A file that runs at batch 4 only (its input and a Reshape to [4, 512] say so) profiled at batch 1: ONNX
    Runtime refuses the run, the plain file stays, nothing is quantized again, the record says why in one line."""
    model = batch_of_four_only()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4
    path = graphs.save(model, tmp_path / "four.onnx")
    x = np.random.default_rng(2).random((4, 3, 8, 8)).astype(np.float32)
    plain = quantize_onnx_file(path, tmp_path / "plain.onnx", x, target="onnxruntime-cpu", run_check=False)
    asked: list = []
    chosen, record = place_by_profile(path, plain, {1: {"x": x[:1]}, 4: {"x": x}}, asked.append)
    assert chosen is plain and asked == [] and not record.chosen and record.kept_float == ()
    assert record.not_run.startswith("the profile could not run (") and "input: x" in record.not_run
    assert record.describe().startswith("plain placement: the profile could not run")
    assert "\n" not in record.not_run and "[E:onnxruntime" not in capfd.readouterr().err


def test_the_report_names_what_was_kept_float_and_plain_placement_skips_it(stem, tmp_path, capsys):
    """quantize-onnx's JSON carries the profile's record, and a row names every candidate in full with its
    measured ms; --plain-placement runs none."""
    path, x, _ = stem
    np.save(tmp_path / "cal.npy", x)
    for flag, out in (((), tmp_path / "a.onnx"), (("--plain-placement",), tmp_path / "b.onnx")):
        assert main(["quantize-onnx", str(path), "--calib", str(tmp_path / "cal.npy"), "--out", str(out), "--json",
                     "--no-fidelity", *flag]) == 0
        report = json.loads(capsys.readouterr().out)
        if flag:
            assert report["placement_by_profile"] is None
        else:
            said = report["placement_by_profile"]
            assert "stem" in said["candidates"] and said["nodes"] and said["verified_ms"]["plain"]


def test_a_crossing_is_priced_as_a_fixed_part_and_a_part_per_element():
    """Q/DQ nodes of 100 and 10,000 elements taking 5 us and 15 us: 5 us per node whatever its size, and 1 ns
    per element beyond it. Priced per element alone (20 us / 10,100 elements), the small node would be charged
    0.2 us; priced as the average of a few small nodes' total, a crossing of a tiny input is charged many times
    what the whole node costs (MTCNN's PNet at 12 x 12: 30 ns per element at batch 1, no candidate found)."""
    from quantship.inspect.run.node_costs import fixed_and_per_element

    fixed, ns = fixed_and_per_element([(0.005, 100), (0.015, 10_000)])
    assert fixed == pytest.approx(0.005) and ns == pytest.approx(1.0, rel=0.02)
    assert fixed_and_per_element([]) == (0.0, None)
    # one node kept float on a small input: crossing out costs 5 us + 1,000 x 1 ns, not 1,000 x 30 ns
    costs = [NodeCost("a", {1: 0.04}, {1: 0.02}, {1: 400}, {1: 1000}), NodeCost("b", {1: 0.01}, {1: 0.03}, {1: 1000},
                                                                              {1: 100})]
    before, after = {"a": set(), "b": {"a"}}, {"a": {"b"}, "b": set()}
    assert choose(costs, {1: 30.0}, before, after) == ((), {})  # the per-element price of a small run's average
    kept, estimated = choose(costs, {1: 1.0}, before, after, {1: 0.005})
    assert kept == ("a",) and estimated["a"][1] == pytest.approx(0.02 + 0.005 + 0.001)
