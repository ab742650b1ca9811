"""Calibration and QAT across 2 gloo ranks on CPU, spawned from the test: the file one process makes.

The ranks run ``tests/quantize/distributed_ranks.py``; each records its results in JSON lines and
the test compares them with one process on the union of the shards.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from quantship import Quantizer, export_qdq
from quantship.examples import digits
from quantship.quantize.observers import rebin_histogram
from tests.quantize import distributed_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")

BS = 32
N_PER_RANK = 8 * BS  # 256 calibration samples per rank


def spawn(fn, out: Path, *args, world: int = 2, deadline_s: float = 240.0) -> list[list[dict]]:
    """Run ``fn(rank, world, out, *args)`` on ``world`` spawned processes; every rank's records."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=(world, out, *args), nprocs=world, join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world} ranks did not finish within {deadline_s:.0f} s (a deadlock?)")
    records = []
    for rank in range(world):
        path = out / f"rank{rank}.jsonl"
        records.append([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])
    return records


def case(records: list[dict], name: str) -> dict:
    (found,) = [r for r in records if r["case"] == name]
    return found


def ort_outputs(path: Path, inputs: list[np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x})[0] for x in inputs])


def output_scale(path: Path) -> float:
    """The scale of the DequantizeLinear that produces the graph output."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    out = model.graph.output[0].name
    (node,) = [n for n in model.graph.node if out in n.output]
    assert node.op_type == "DequantizeLinear", node.op_type
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.op_type == "Constant"}
    return float({**inits, **consts}[node.input[1]])


def sample_of(split) -> torch.Tensor:
    # a tensor of its own: the dynamo exporter records different range_constraints metadata for a
    # view into a larger tensor, and spawn hands each rank a private copy anyway
    return split.x_test[:BS].clone()


@pytest.fixture(scope="module")
def task():
    split = digits.load_split()
    model = digits.trained_model()
    x = split.x_train[: 2 * N_PER_RANK]
    shards = [list(x[r * N_PER_RANK:(r + 1) * N_PER_RANK].split(BS)) for r in range(2)]
    return model, split, shards


@pytest.fixture(scope="module")
def ptq(task, tmp_path_factory):
    """Two ranks: minmax and histogram on a shard each; records per rank."""
    model, split, shards = task
    out = tmp_path_factory.mktemp("ptq2")
    start = time.perf_counter()
    records = spawn(distributed_ranks.ptq_rank, out, model.state_dict(), shards, sample_of(split))
    return out, records, time.perf_counter() - start


@pytest.fixture(scope="module")
def bad(task, tmp_path_factory):
    """Two ranks, one batch each: different models, an empty shard, export_qdq on rank 1 alone."""
    model, split, shards = task
    out = tmp_path_factory.mktemp("bad2")
    records = spawn(distributed_ranks.bad_input_rank, out, model.state_dict(), [s[:1] for s in shards],
                    sample_of(split), deadline_s=180.0)
    return out, records


def one_process(model, shards, observer: str, path: Path, sample) -> Path:
    union = shards[0] + shards[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = Quantizer(backend="pt2e", act_observer=observer).quantize(model, union, max_calibration_samples=10**6)
        return export_qdq(quantized, sample, path)


@pytest.mark.slow
def test_minmax_two_shards_byte_identical_to_one_process(task, ptq, tmp_path):
    model, split, shards = task
    out, records, seconds = ptq
    for rank in range(2):
        assert case(records[rank], "minmax")["ok"], case(records[rank], "minmax")
        assert case(records[rank], "minmax")["path"] == str((out / "minmax.onnx").resolve())
        merged = case(records[rank], "minmax")["merged"]  # Quantizer.merged: what the merge sent
        assert merged["n_observers"] > 0 and merged["n_floats"] >= 2 * merged["n_observers"]  # a min and a max each, at least
    assert not list(out.glob(".minmax.onnx.*"))  # rank 0 wrote once, atomically
    single = one_process(model, shards, "minmax", tmp_path / "one.onnx", sample_of(split))
    assert (out / "minmax.onnx").read_bytes() == single.read_bytes()
    print(f"\n  2-rank PTQ group (spawn to join, minmax and histogram): {seconds:.1f} s")


@pytest.mark.slow
def test_histogram_two_shards_byte_identical_to_one_process(task, ptq, tmp_path):
    """Exact, so on every CPU: calibration records the histograms on the range of all the data
    (merged first), so both ranks count on the same bins and the sum of their whole-number counts
    is the one process's histogram, bit for bit; every scale chosen from it follows, and so does
    the file. (Histograms merged by re-binning differed by 2 LSB on an AVX-512/AMX Xeon.)"""
    model, split, shards = task
    out, records, _ = ptq
    assert case(records[0], "histogram")["ok"] and case(records[1], "histogram")["ok"]
    single = one_process(model, shards, "histogram", tmp_path / "one.onnx", sample_of(split))
    inputs = [b.numpy() for b in split.x_test[: (len(split.x_test) // BS) * BS].split(BS)]
    merged, reference = ort_outputs(out / "histogram.onnx", inputs), ort_outputs(single, inputs)
    worst = float(np.abs(merged - reference).max()) / output_scale(single)
    print(f"\n  histogram, 2 ranks vs 1 process: max |diff| = {worst:.3f} LSB on {len(merged)} held-out images")
    assert worst == 0.0 and output_scale(single) == output_scale(out / "histogram.onnx")
    assert (out / "histogram.onnx").read_bytes() == single.read_bytes()


def test_every_observer_kind_merges_to_the_union(bad):
    """minmax and per-channel: exactly the union's. Histogram-based: the scale within 1% of one
    observer fed both ranks' batches (that one re-bins at each range change too; measured ~0.1%)."""
    _, records = bad
    r0, r1 = case(records[0], "observers"), case(records[1], "observers")
    assert r0["ok"] and r1["ok"], r0.get("trace")
    assert r0["qparams"] == r1["qparams"]  # every rank ends with the same statistics
    assert r0["n_histograms"] == 3
    union = distributed_ranks.observer_set()
    for x in distributed_ranks.observer_data(0) + distributed_ranks.observer_data(1):
        for obs in union.values():
            obs(x)
    expected = distributed_ranks.qparams_of(union)
    assert r0["qparams"]["minmax"] == expected["minmax"]
    assert r0["qparams"]["per_channel"] == expected["per_channel"]
    for name in ("histogram", "percentile", "mse"):
        merged_scale, single_scale = r0["qparams"][name][0][0], expected[name][0][0]
        print(f"\n  {name}: merged scale {merged_scale:.6f}, one observer {single_scale:.6f} "
              f"({merged_scale / single_scale - 1:+.2%})")
        assert r0["qparams"][name][1:] == expected[name][1:]  # same range
        assert merged_scale == pytest.approx(single_scale, rel=0.01)


def test_calibrated_observers_merge_exactly_to_the_union(bad):
    """With calibration's two passes (ranges, then histograms on the merged range), every observer
    kind ends with the union's histogram and qparams exactly, on both ranks."""
    from quantship.quantize.calibration import run_batches

    _, records = bad
    r0, r1 = case(records[0], "calibrated_observers"), case(records[1], "calibrated_observers")
    assert r0["ok"] and r1["ok"], r0.get("trace") or r1.get("trace")
    assert (r0["qparams"], r0["histograms"]) == (r1["qparams"], r1["histograms"])
    union = distributed_ranks.observer_set()
    run_batches(distributed_ranks.Feed(union), distributed_ranks.observer_data(1) + distributed_ranks.observer_data(0))
    assert r0["histograms"] == distributed_ranks.histograms_of(union)
    assert r0["qparams"] == distributed_ranks.qparams_of(union)
    assert sorted(r0["histograms"]) == ["histogram", "mse", "percentile"]


def test_calibration_histograms_do_not_depend_on_the_batch_order():
    """One process: the same batches in another order give the same histograms, bit for bit. Fed
    once, torchao's observer re-bins what it holds whenever a batch widens the range, so there the
    order shows (the reason calibration records histograms in a second pass)."""
    from quantship.quantize.calibration import run_batches

    batches = distributed_ranks.observer_data(0) + distributed_ranks.observer_data(1)
    recorded, streamed = [], []
    for order in (batches, batches[::-1]):
        observers = distributed_ranks.observer_set()
        run_batches(distributed_ranks.Feed(observers), order)
        recorded.append((distributed_ranks.histograms_of(observers), distributed_ranks.qparams_of(observers)))
        once = distributed_ranks.observer_set()
        with torch.no_grad():
            for x in order:
                distributed_ranks.Feed(once)(x)
        streamed.append(distributed_ranks.histograms_of(once))
    assert recorded[0] == recorded[1]
    assert streamed[0] != streamed[1]
    assert sum(recorded[0][0]["histogram"]) == sum(b.numel() for b in batches)  # every value counted once


def test_different_models_refused_on_every_rank_with_one_message(bad):
    _, records = bad
    r0, r1 = case(records[0], "structure"), case(records[1], "structure")
    assert not r0["ok"] and not r1["ok"]
    assert r0["error"] == r1["error"] == "ValueError"
    assert r0["message"] == r1["message"]
    assert "different models" in r0["message"] and "rank 1" in r0["message"]


def test_empty_shard_refused_on_every_rank_with_one_message(bad):
    _, records = bad
    r0, r1 = case(records[0], "empty"), case(records[1], "empty")
    assert not r0["ok"] and not r1["ok"]
    assert r0["message"] == r1["message"]
    assert "rank(s) [1]" in r0["message"] and "yielded no batch" in r0["message"]
    assert r0["seconds"] < 30  # refused by the agreement, not by a timeout


def test_export_on_one_nonzero_rank_refused_after_timeout(bad):
    out, records = bad
    r1 = case(records[1], "export_one_rank")
    assert not r1["ok"] and r1["error"] == "ValueError"
    assert "called on rank 1 but not on all 2 ranks" in r1["message"]
    assert 2.5 < r1["seconds"] < 30
    assert not (out / "one.onnx").exists()


def test_rebin_histogram_keeps_mass_and_places_it():
    counts = torch.tensor([1.0, 2.0, 3.0, 4.0])
    moved = rebin_histogram(counts, 0.0, 4.0, -4.0, 4.0)  # bins of width 2 on [-4, 4]
    assert torch.allclose(moved, torch.tensor([0.0, 0.0, 3.0, 7.0], dtype=torch.float64))
    assert torch.equal(rebin_histogram(counts, 0.0, 4.0, 0.0, 4.0), counts.double())
    assert rebin_histogram(counts, 1.0, 1.0, 0.0, 4.0).tolist() == [0.0, 10.0, 0.0, 0.0]
    assert rebin_histogram(counts, float("inf"), float("-inf"), 0.0, 4.0).sum() == 0
    with pytest.raises(ValueError, match="drop values"):
        rebin_histogram(counts, 0.0, 4.0, 1.0, 4.0)


def test_outside_a_process_group_nothing_changes():
    from quantship import ranks
    from quantship.quantize.distributed import merge_observers

    assert ranks.world() is None
    assert merge_observers(torch.nn.Linear(2, 2), n_samples=0) is None


@pytest.mark.slow
def test_qat_two_ranks_same_file_and_accuracy_of_one_rank(task, tmp_path):
    pytest.importorskip("fastai", reason="QuantizeCallback needs the fastai extra")
    from quantship.cli.common import format_accuracy
    from quantship.intervals import wilson_interval

    model, split, _ = task
    qat_bs, n_train = 30, 600  # 10 steps of 60 images: one rank at batch 60, or two ranks at 30 each
    data = {"x_train": split.x_train[:n_train], "y_train": split.y_train[:n_train],
            "x_valid": split.x_test[:2 * qat_bs], "y_valid": split.y_test[:2 * qat_bs],
            "x_test": split.x_test, "y_test": split.y_test, "sample": split.x_test[:qat_bs].clone()}
    start = time.perf_counter()
    records = spawn(distributed_ranks.qat_rank, tmp_path, model.state_dict(), data, qat_bs, deadline_s=480.0)
    two_rank_s = time.perf_counter() - start
    r0, r1 = case(records[0], "qat"), case(records[1], "qat")
    assert r0["ok"], r0.get("trace")
    assert r1["ok"], r1.get("trace")
    assert r0["type"] == r1["type"] == "GraphModule"  # DDP dropped after conversion
    assert r0["shared"] == r1["shared"] == str((tmp_path / "qat.onnx").resolve())
    own = [(tmp_path / f"qat_rank{r}.onnx").read_bytes() for r in range(2)]
    assert own[0] == own[1]  # the same file whichever rank's model is exported
    assert (tmp_path / "qat.onnx").read_bytes() == own[0]
    assert (r0["k"], r0["n"]) == (r1["k"], r1["n"])

    torch.set_num_threads(1)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = distributed_ranks.qat_fit(copy.deepcopy(model).train(), data["x_train"], data["y_train"],
                                        data["x_valid"], data["y_valid"], 2 * qat_bs)
    one_rank_s = time.perf_counter() - start
    k1, n1 = digits.evaluate(one, split.x_test, split.y_test, batch_size=2 * qat_bs)
    lo, hi = wilson_interval(k1, n1)
    print(f"\n  QAT 1 rank (batch {2 * qat_bs}): {format_accuracy(k1, n1)} ({one_rank_s:.1f} s)"
          f"\n  QAT 2 ranks (batch {qat_bs} each): {format_accuracy(r0['k'], r0['n'])} "
          f"(fit {r0['fit_seconds']:.1f} s, spawn to join {two_rank_s:.1f} s); files identical on both ranks")
    assert lo <= r0["k"] / r0["n"] <= hi
