"""The accuracy search on an ONNX file: ``quantize-onnx --eval --max-drop`` and ``search_onnx``.

The premise is built, not assumed: ``outlier.model`` collapses under min/max int8 (step 0 misses a
3-point budget, asserted) and keeping its ``fc2`` float recovers it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from quantship.cli.main import main
from quantship.errors import DataRefused
from quantship.quantize_onnx.search import OnnxBudgetMissed, file_runner, search_onnx, top1
from tests.quantize_onnx import outlier

BUDGET = 3.0  # points


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return outlier.files(tmp_path_factory.mktemp("search"))


def _argv(files, out, *extra):
    return ["quantize-onnx", str(files["float"]), "--calib", str(files["calib"]), "--out", str(out),
            "--observer", "minmax", "--eval", str(files["eval"]), *extra]


def test_the_search_stops_at_the_first_step_within_budget_and_writes_only_that_file(files, tmp_path, capsys):
    out = tmp_path / "q.onnx"
    assert main(_argv(files, out, "--max-drop", str(BUDGET), "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    search = doc["accuracy_search"]
    assert search["steps"][0]["drop"] > BUDGET  # the premise: the plain file misses the budget
    assert search["met"] and search["steps"][-1]["within"] and not any(s["within"] for s in search["steps"][:-1])
    last = search["steps"][-1]
    assert search["chosen"] == last["excluded"] and search["chosen_int16"] == last["int16"]
    # onnxruntime-cpu runs 16-bit activations: the worst node's 16-bit form is tried first, and meets it here
    assert len(search["steps"]) == 2 and last["int16"] == search["order"][:1] and last["excluded"] == []
    assert search["steps"][0]["interval"][0] <= search["steps"][0]["metric"] <= search["steps"][0]["interval"][1]
    assert [p.name for p in tmp_path.iterdir()] == ["q.onnx"]  # the steps' files are gone
    # the accepted file, measured again here: within the budget of the float file
    ev = np.load(files["eval"])
    run, _, fixed = file_runner(out)
    correct, n = top1(run, ev["x"], ev["y"], 32, fixed)
    assert 100.0 * correct / n == pytest.approx(search["steps"][-1]["metric"])
    assert search["float"]["metric"] - 100.0 * correct / n <= BUDGET
    assert doc["excluded"] == search["chosen"] and doc["verdict"] == "accepted"


def test_no_step_within_budget_exits_1_names_every_step_and_writes_nothing(files, tmp_path, capsys):
    out = tmp_path / "q.onnx"
    assert main(_argv(files, out, "--max-drop", str(BUDGET), "--max-steps", "0")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no exclusion set met the budget" in err[0] and "step 0 [nothing]" in err[0]
    assert not out.exists() and not list(tmp_path.iterdir())


def test_eval_alone_scores_both_files_without_a_search(files, tmp_path, capsys):
    out = tmp_path / "q.onnx"
    code = main(_argv(files, out, "--json"))
    doc = json.loads(capsys.readouterr().out)
    assert code == (0 if doc["verdict"] == "accepted" else 1)  # the check --run verdict decides, as without --eval
    assert "accuracy_search" not in doc and doc["excluded"] == [] and out.is_file()
    ev = np.load(files["eval"])
    run, _, fixed = file_runner(out)
    assert doc["accuracy"]["int8_file_ort"]["correct"] == top1(run, ev["x"], ev["y"], 32, fixed)[0]
    assert doc["accuracy"]["float_file_ort"]["correct"] == len(ev["y"])  # y is the float file's own argmax


def test_max_drop_needs_eval(files, tmp_path, capsys):
    assert main(["quantize-onnx", str(files["float"]), "--calib", str(files["calib"]), "--out",
                 str(tmp_path / "q.onnx"), "--max-drop", "1"]) == 2
    assert "--eval" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_a_metric_callable_drives_the_search_in_the_api(files, tmp_path):
    ev = np.load(files["eval"])

    def agreement_mass(run) -> float:
        """Mean softmax probability of the float file's class, in percent (not top-1)."""
        logits = run(ev["x"])[0].astype(np.float64)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return 100.0 * float(p[np.arange(len(ev["y"])), ev["y"]].mean())

    x = np.load(files["calib"])
    with pytest.raises(OnnxBudgetMissed) as missed:
        search_onnx(files["float"], tmp_path / "q.onnx", x, target="onnxruntime-cpu", observer="minmax",
                    max_drop=0.0, metric=agreement_mass, max_steps=0)
    plain = missed.value.search
    assert plain.steps[0].correct is None and plain.drop(plain.steps[0]) > 0 and not (tmp_path / "q.onnx").exists()
    budget = plain.drop(plain.steps[0]) / 2  # half the plain file's loss: step 0 misses it by construction
    result, search = search_onnx(files["float"], tmp_path / "q.onnx", x, target="onnxruntime-cpu",
                                 observer="minmax", max_drop=budget, metric=agreement_mass)
    assert len(search.steps) >= 2 and search.within(search.steps[-1]) and result.path == (tmp_path / "q.onnx")
    assert agreement_mass(file_runner(result.path)[0]) == pytest.approx(search.steps[-1].metric)
    with pytest.raises(DataRefused, match="one metric"):
        search_onnx(files["float"], tmp_path / "r.onnx", x, target="onnxruntime-cpu", max_drop=1.0)


def test_a_custom_metric_without_16_bit_keeps_the_reader_of_the_outlier_float(files, tmp_path):
    """The ONNX adapter of the labelled search, float only (``try_int16=False``), with a metric that is not
    top-1 (minus the mean absolute logit error against the float file): ``fc2`` reads the activation whose
    range the outlier sets, so it is ranked first and keeping it float meets half of step 0's drop."""
    ev, x = np.load(files["eval"]), np.load(files["calib"])
    reference = file_runner(files["float"])[0](ev["x"])[0]

    def minus_logit_error(run) -> float:
        return -float(np.abs(run(ev["x"])[0] - reference).mean())

    with pytest.raises(OnnxBudgetMissed) as missed:
        search_onnx(files["float"], tmp_path / "q.onnx", x, target="onnxruntime-cpu", observer="minmax",
                    max_drop=0.0, metric=minus_logit_error, max_steps=0)
    budget = missed.value.search.drop(missed.value.search.steps[0]) / 2
    result, search = search_onnx(files["float"], tmp_path / "q.onnx", x, target="onnxruntime-cpu",
                                 observer="minmax", max_drop=budget, metric=minus_logit_error, try_int16=False)
    assert search.metric_name == "minus_logit_error" and search.order[0] == "fc2"
    assert [s.excluded for s in search.steps] == [(), ("fc2",)] and search.steps[-1].int16 == ()
    assert result.excluded == ["fc2"]  # the written file is the chosen step's
    assert minus_logit_error(file_runner(result.path)[0]) == pytest.approx(search.steps[-1].metric)
    assert search.drop(search.steps[-1]) <= budget
