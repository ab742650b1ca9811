"""The one greedy search engine (``search_engine``) and its clients' rules, on plain numbers: no model.

A fake front-end: a "file" is the set of nodes kept float and in 16-bit; each node quantized in 8 bits
loses its ``LOSS``, in 16 bits a quarter of it, in float nothing; the score is 100 minus the loss. The
engine, its strategies, the labelled variant and the fidelity repair must order, measure, keep and stop
on these numbers exactly as their rules say.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from quantship.errors import FidelityMissed
from quantship.fidelity import MET, MISSED, Budget
from quantship.repair_loop import repair
from quantship.search_engine import (
    BudgetMissed,
    Engine,
    MetricSearch,
    MetricStep,
    fewest_nodes,
    metric_search,
    node_by_node,
    prefix_sizes,
    try_options,
)


def always(candidate, best) -> bool:
    """The accuracy search's accept rule: each node stays in the form chosen for it."""
    return True


LOSS = {"a": 8.0, "b": 4.0, "c": 2.0, "d": 1.0, "e": 0.5, "f": 0.25}


def _score(options: dict, excluded: tuple, wide: tuple) -> float:
    loss = sum(v / 4 if n in wide else v for n, v in LOSS.items() if n not in excluded)
    return 100.0 - loss * options.get("scale", 1.0)


class Fake:
    """``attempt`` over the numbers above; records what it was asked for; ``refuse``: sets that give no file."""

    def __init__(self, refuse=()):
        self.asked: list[tuple] = []
        self.refuse = refuse

    def __call__(self, what, options, excluded, wide):
        self.asked.append((what, tuple(excluded), tuple(wide)))
        if set(excluded) in [set(r) for r in self.refuse]:
            return None
        return _score(options, excluded, wide), ("file", excluded, wide)


def _engine(fake, goal_score, **kw):
    return Engine(fake, score=lambda m: m, goal=lambda m: m >= goal_score, **kw)


def test_the_engine_records_every_step_and_the_first_is_the_base():
    fake, lines = Fake(), []
    engine = _engine(fake, 99.0, label="t", log=lines.append)
    first = engine.step("as asked", {}, ("f",), ())
    assert engine.best is first and first.kept and not first.met and first.score == pytest.approx(100 - 15.5)
    second = engine.step("float for a", {}, ("f", "a"), ())
    assert second.score == pytest.approx(100 - 7.5) and not second.kept and second.seconds >= 0
    assert engine.consider(second) and engine.best is second and second.kept  # higher: the default rule
    assert not engine.consider(engine.step("worse", {}, (), ()))  # a lower score is not kept
    assert second.artifact == ("file", ("f", "a"), ())
    assert [s.excluded for s in engine.steps] == [("f",), ("f", "a"), ()] and engine.steps[0].artifact == ("file", ("f",), ())
    assert lines[1] == "t: step 1, float for a: 92.5"


def test_an_accept_rule_replaces_the_default():
    engine = _engine(Fake(), 101.0, accept=lambda candidate, best: candidate.what == "mine")
    engine.step("as asked", {}, (), ())
    assert not engine.consider(engine.step("higher", {}, ("a",), ()))
    assert engine.consider(engine.step("mine", {}, (), ()))
    engine = _engine(Fake(), 101.0, accept=always)
    engine.step("as asked", {}, ("a",), ())
    assert engine.consider(engine.step("lower", {}, (), ()))


def test_try_options_keeps_only_what_helps_and_skips_what_was_asked():
    fake = Fake()
    engine = _engine(fake, 100 - 15.75 * 0.5)
    engine.step("as asked", {"scale": 1.0}, (), ())
    try_options(engine, [("same", {"scale": 1.0}), ("worse", {"scale": 2.0}), ("better", {"scale": 0.75}),
                         ("best", {"scale": 0.5}), ("never", {"scale": 0.1})])
    assert [w for w, *_ in fake.asked] == ["as asked", "worse", "better", "best"]  # stops at the goal
    assert engine.best.what == "best" and engine.best.met and engine.best.options == {"scale": 0.5}
    assert [s.kept for s in engine.steps] == [True, False, True, True]


def test_node_by_node_tries_16_bit_first_keeps_the_better_form_and_stops_at_the_goal():
    fake = Fake()
    engine = _engine(fake, 100 - 2.25, accept=always)  # met once the nodes lose at most 2.25 in all
    engine.step("as asked", {}, (), ())
    node_by_node(engine, ["a", "b", "c", "d"], sixteen=True)
    assert fake.asked == [("as asked", (), ()), ("16-bit activations for a", (), ("a",)),
                          ("float for a", ("a",), ()), ("16-bit activations for b", ("a",), ("b",)),
                          ("float for b", ("a", "b"), ()), ("16-bit activations for c", ("a", "b"), ("c",))]
    # float beat 16-bit at each node and was kept; c's 16-bit form met the goal (loss 0.5 + 1.75): stop
    assert engine.steps[-1].met and engine.fewest() is engine.steps[-1]
    assert [s.kept for s in engine.steps] == [True, False, True, False, True, False]


def test_node_by_node_float_wins_a_tie_and_skip_passes_nodes_over():
    engine = Engine(Fake(), score=int, goal=lambda m: False, accept=always)
    engine.step("as asked", {}, (), ())
    node_by_node(engine, ["f", "e", "d"], sixteen=True, skip=lambda node, best: node == "e")
    # 16-bit and float score the same (84 for f, 85 for d): float kept; e skipped
    assert [s.what for s in engine.steps if s.kept] == ["as asked", "float for f", "float for d"]
    assert engine.best.excluded == ("f", "d") and engine.stopped is None


def test_stop_reasons_max_steps_counts_files_asked_for_and_a_float_without_file_ends_the_search():
    fake = Fake(refuse=[("b",)])
    engine = _engine(fake, 101.0, accept=always, max_steps=3)
    engine.step("as asked", {}, (), ())
    node_by_node(engine, ["b", "a", "c", "d"], sixteen=True)
    assert engine.stopped == "keeping ['b'] in float gives no file" and len(fake.asked) == 3
    fake = Fake(refuse=[("a",)])
    engine = _engine(fake, 101.0, accept=always, max_steps=2)
    engine.step("as asked", {}, (), ())
    node_by_node(engine, ["b", "c", "d"], sixteen=False)
    assert len(fake.asked) == 3 and engine.stopped == "--max-steps 2 reached"
    assert [s.excluded for s in engine.steps] == [(), ("b",), ("b", "c")]


def test_fewest_nodes_grows_prefixes_then_bisects_to_the_fewest_float_nodes():
    assert prefix_sizes(0) == [] and prefix_sizes(1) == [1] and prefix_sizes(6) == [1, 2, 4, 6]
    fake = Fake()
    engine = _engine(fake, 100 - 1.75)  # met when a, b, c are float (loss 1.75), not with a, b only (3.75)
    engine.step("as asked", {}, (), ())
    ranked = ["a", "b", "c", "d", "e", "f"]
    fewest_nodes(engine, ranked, sixteen=False)
    assert [len(e) for _, e, _ in fake.asked] == [0, 1, 2, 4, 3]  # 4 meets, bisection finds 3
    assert engine.fewest().excluded == ("a", "b", "c")


def test_a_float_prefix_without_file_is_set_aside_and_the_next_nodes_are_tried():
    """Keeping ``a`` float alone gives no file (as a float node whose outputs go non-finite would): every longer
    prefix holds ``a`` too, so without setting it aside the prefixes would never reach a file; with it set aside
    the prefixes go on over b, c, ... and bisection finds the fewest of those."""
    fake = Fake(refuse=[("a",), ("a", "b"), ("a", "b", "c", "d"), ("a", "b", "c", "d", "e", "f")])
    engine = _engine(fake, 100 - 9.75)  # met when b and c are float (loss 8 + 1 + 0.5 + 0.25 = 9.75)
    engine.step("as asked", {}, (), ())
    fewest_nodes(engine, ["a", "b", "c", "d", "e", "f"], sixteen=False)
    assert engine.set_aside == ["a"]
    assert [e for _, e, _ in fake.asked] == [(), ("a",), ("b",), ("b", "c")]
    assert engine.fewest().excluded == ("b", "c")
    # a prefix that gives no file after one that missed: only the nodes it added are set aside
    fake = Fake(refuse=[("b", "c")])
    engine = _engine(fake, 100 - 9.25)  # needs b and c float: never met once c is set aside
    engine.step("as asked", {}, (), ())
    fewest_nodes(engine, ["b", "c", "d", "e", "f"], sixteen=False)
    assert engine.set_aside == ["c"] and engine.fewest() is None
    assert [e for _, e, _ in fake.asked] == [(), ("b",), ("b", "c"), ("b", "d"), ("b", "d", "e", "f")]


def _search(max_drop):
    return MetricSearch("score", MetricStep((), 100.0), max_drop)


def _labelled(what, options, excluded, wide):
    score = _score(options, excluded, wide)
    return MetricStep(tuple(excluded), score, int16=tuple(wide)), ("file", excluded, wide)


def test_the_labelled_variant_keeps_nodes_until_the_drop_fits_and_returns_that_file():
    record = _search(max_drop=2.0)
    chosen = metric_search(_labelled, record, lambda artifact: ["a", "b", "c", "d", "e", "f"], sixteen=False)
    assert [s.excluded for s in record.steps] == [(), ("a",), ("a", "b"), ("a", "b", "c")]  # drops 15.75 ... 1.75
    assert record.met and record.chosen is record.steps[-1] and record.drop(record.chosen) == pytest.approx(1.75)
    assert [record.within(s) for s in record.steps] == [False, False, False, True]
    assert chosen == ("file", ("a", "b", "c"), ())
    assert record.order == ["a", "b", "c", "d", "e", "f"] and record.as_dict()["chosen"] == list(record.chosen.excluded)


def test_the_labelled_variant_refuses_with_every_step_when_the_budget_is_missed():
    record = _search(max_drop=0.1)
    with pytest.raises(BudgetMissed, match=r"budget of 0.1 \(score\).*step 0 \[nothing\] drop \+15.8.*advice") as info:
        metric_search(_labelled, record, lambda artifact: ["a", "b"], max_nodes=2, advice="advice")
    assert info.value.search is record and len(record.steps) == 3 and not record.met
    assert record.chosen.excluded == ("a", "b")  # the best found, named in the message


def _fidelity(options, excluded, wide, goal):
    margin = _score(options, excluded, wide) - goal
    sqnr = margin + goal
    return SimpleNamespace(sqnr_db=sqnr, margin=margin, status=MET if margin >= 0 else MISSED,
                           worst=SimpleNamespace(agreement=None, describe=lambda: f"SQNR {sqnr:.1f} dB"),
                           bounds_that_keep_it=lambda: {"min_sqnr": sqnr} if margin < 0 else {})


def test_the_repair_tries_options_then_the_fewest_float_nodes_and_records_each_step():
    goal = 100 - 3.75 * 0.5

    def attempt(what, options, excluded, wide):
        return _fidelity(options, excluded, wide, goal), ("file", excluded)

    record, chosen = repair(attempt, budget=Budget(20.0, 0.5), options={"scale": 1.0},
                            algorithm_steps=[("halve", {"scale": 0.5}), ("double", {"scale": 2.0})],
                            order=lambda artifact, options: ["a", "b", "c", "d", "e", "f"])
    # halving helps (kept, not enough), doubling does not; then float prefixes 1, 2 (met), bisection none
    assert [(s.what, s.algorithms) for s in record.steps] == [
        ("as asked", ()), ("halve", ("halve",)), ("double", ("double",)), ("float for 1 node(s)", ("halve",)),
        ("float for 2 node(s)", ("halve",))]
    assert record.met and record.chosen == 4 and chosen == ("file", ("a", "b"))
    with pytest.raises(FidelityMissed, match="max-steps 1 reached") as refused:
        repair(attempt, budget=Budget(20.0, 0.5), options={"scale": 1.0}, max_steps=1,
               algorithm_steps=[("double", {"scale": 2.0})], order=lambda artifact, options: ["a"])
    # the refusal names its closest file and the bound that would keep it: step 0 (doubling did worse)
    assert f"The closest: step 0, as asked (SQNR {_score({'scale': 1.0}, (), ()):.1f} dB); `--min-sqnr" \
        in str(refused.value)


def test_both_front_ends_read_the_one_table_of_algorithm_steps():
    """repair_loop's table names recipe.Algorithms fields; each front-end spells them as its own keywords, the
    same steps in the same order, the range observer first of the observers."""
    import inspect

    from quantship.export.judged import ALGORITHM_STEPS as TORCH_STEPS
    from quantship.quantize import Quantizer
    from quantship.quantize_onnx.quantizer import quantize_onnx_file
    from quantship.quantize_onnx.repair import ALGORITHM_STEPS as ONNX_STEPS
    from quantship.recipe import FIELDS, Algorithms
    from quantship.repair_loop import ALGORITHM_STEPS

    assert all(field in FIELDS for _, field, _ in ALGORITHM_STEPS)
    names = [name for name, _, _ in ALGORITHM_STEPS]
    assert [n for n, _ in ONNX_STEPS] == [n for n, _ in TORCH_STEPS] == names
    assert names.index("minmax observer") < names.index("percentile observer") < names.index("mse observer")
    onnx_keys = inspect.signature(quantize_onnx_file).parameters
    for (_, field, value), (_, onnx_opts), (_, torch_opts) in zip(ALGORITHM_STEPS, ONNX_STEPS, TORCH_STEPS):
        Algorithms(**{field: value})  # a valid request
        assert list(onnx_opts.values()) == list(torch_opts.values()) == [value]
        assert all(k in onnx_keys for k in onnx_opts), onnx_opts
        Quantizer(**torch_opts)  # the PyTorch path's keywords, accepted as they are
    assert {k for _, opts in TORCH_STEPS for k in opts} == {"bias_correction", "equalize", "act_observer"}


def test_a_16_bit_name_left_with_nothing_to_widen_is_dropped_not_fatal():
    """The placement by profile keeps float the neighbours of a 16-bit node, which then reads and writes no
    quantized value: that name is dropped and the file made (measured on the notes example, ONNX path: the
    power's Mul, 16-bit, left alone once the seven front-end convs were float; the placement had said 'gives no
    file' and the slower file was written)."""
    from quantship.errors import Int16Uncovered
    from quantship.repair_loop import dropping_uncovered

    asked = []

    def make(wide):
        asked.append(wide)
        if "mul" in wide:
            raise Int16Uncovered("--int16 'mul' names nodes that read and write no quantized activation", "mul")
        return wide

    assert dropping_uncovered(make, ("conv", "mul")) == ("conv",) and asked == [("conv", "mul"), ("conv",)]
    with pytest.raises(Int16Uncovered):  # a name the caller did not give is the caller's own refusal
        dropping_uncovered(lambda wide: make(("mul",)), ("conv",))
