"""The one data loader (``inspect.read.feeds``): exact casts, shape checks, refusals naming the input,
and data generated per input's dtype and range. Hand-built graphs: nothing here runs a model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from quantship.errors import DataRefused
from quantship.inspect.read.feeds import as_feeds, cut, for_run, generated, id_ranges, model_inputs, read_data
from tests.quantize_onnx import graphs

VOCAB = 100


def text_graph(quantized_table: bool = False):
    """ids -> Cast -> Gather(words) and mask and flag: the inputs of a text model, with a float one."""
    words = numpy_helper.from_array(np.zeros((VOCAB, 4), np.float32), "words")
    inits = [words]
    table = "words"
    nodes = [helper.make_node("Cast", ["input_ids"], ["ids64"], to=TensorProto.INT64)]
    if quantized_table:
        inits = [numpy_helper.from_array(np.zeros((VOCAB, 4), np.int8), "words_q"),
                 numpy_helper.from_array(np.array(0.1, np.float32), "s")]
        nodes.append(helper.make_node("DequantizeLinear", ["words_q", "s"], ["words_dq"]))
        table = "words_dq"
    nodes += [helper.make_node("Gather", [table, "ids64"], ["emb"]),
              helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
              helper.make_node("Identity", ["flag"], ["f"]),
              helper.make_node("Identity", ["scale"], ["s2"])]
    inputs = [graphs.value("input_ids", ["batch", 8], TensorProto.INT32),
              graphs.value("attention_mask", ["batch", 8], TensorProto.INT64),
              graphs.value("flag", ["batch"], TensorProto.BOOL), graphs.value("scale", ["batch", 3])]
    outputs = [graphs.value("emb", ["batch", 8, 4]), graphs.value("m", ["batch", 8]),
               graphs.value("f", ["batch"], TensorProto.BOOL), graphs.value("s2", ["batch", 3])]
    return graphs.model(nodes, inputs, outputs, inits)


@pytest.mark.parametrize("quantized_table", [False, True])
def test_generated_data_has_each_input_s_dtype_and_range(quantized_table):
    model = text_graph(quantized_table)
    assert id_ranges(model) == {"input_ids": (VOCAB, "words_dq" if quantized_table else "words")}
    fed = generated(model, n=3)
    assert fed.origin == "generated" and len(fed.batches) == 3
    assert fed.detail == ("seeded; input_ids: ids in [0, 100), attention_mask: ones, flag: True, "
                          "scale: standard normal")
    ids = np.concatenate([b["input_ids"] for b in fed.batches])
    assert ids.dtype == np.int32 and ids.shape == (3, 8) and 0 <= ids.min() and ids.max() < VOCAB
    assert len(np.unique(ids)) > 1
    assert all((b["attention_mask"] == 1).all() and b["attention_mask"].dtype == np.int64 for b in fed.batches)
    assert all(b["flag"].dtype == bool and b["flag"].all() for b in fed.batches)
    assert fed.batches[0]["flag"].shape == (1,) and fed.batches[0]["scale"].dtype == np.float32 and fed.batches[0]["scale"].shape == (1, 3)
    again = generated(model, n=3)  # seeded: the same data every time
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(fed.batches, again.batches))


def test_exact_casts_are_made_and_inexact_ones_refused_naming_the_input():
    inputs = model_inputs(text_graph())
    good = {"input_ids": np.arange(16, dtype=np.int64).reshape(2, 8),  # int64 -> the declared int32
            "attention_mask": np.ones((2, 8), np.float32),  # whole floats -> int64
            "flag": np.array([1, 0], np.uint8),  # 0/1 -> bool
            "scale": np.zeros((2, 3), np.float64)}
    with pytest.raises(DataRefused, match="different numbers of samples"):
        cut(inputs, {**good, "flag": np.ones(3, bool)}, batch_size=2, max_samples=10)
    (batch,) = cut(inputs, good, batch_size=2, max_samples=10)
    assert batch["input_ids"].dtype == np.int32 and batch["attention_mask"].dtype == np.int64
    assert batch["flag"].dtype == bool and batch["scale"].dtype == np.float32

    def refused(**change):
        with pytest.raises(DataRefused) as caught:
            cut(inputs, {**good, **change}, batch_size=2, max_samples=10, source="cal.npz")
        message = str(caught.value)
        assert "\n" not in message and message.startswith("cal.npz: ")
        return message

    fractions = refused(input_ids=np.full((2, 8), 3.5))
    assert "'input_ids'" in fractions and "with a fraction (e.g. 3.5)" in fractions and "np.rint" in fractions
    assert "NaN" in refused(scale=np.full((2, 3), np.nan))
    assert "NaN" in refused(input_ids=np.full((2, 8), np.nan))
    assert "'input_ids'" in refused(input_ids=np.full((2, 8), "a"))
    assert "outside int32" in refused(input_ids=np.full((2, 8), 2 ** 40))
    assert "other than 0 and 1" in refused(flag=np.full((2,), 2))
    assert "booleans" in refused(scale=np.ones((2, 3), bool))
    assert "beyond what float32 holds exactly" in refused(scale=np.full((2, 3), 2 ** 30))
    assert "dimension 1 is 9, not 8" in refused(input_ids=np.zeros((2, 9), np.int32))
    assert "rank 2" in refused(input_ids=np.zeros((2, 8, 1), np.int32))
    missing = dict(good)
    del missing["attention_mask"]
    with pytest.raises(DataRefused, match=r"no data for input\(s\) \['attention_mask'\].*keyed by its name"):
        cut(inputs, missing, batch_size=2, max_samples=10)


def test_npz_keyed_by_input_name_npy_and_key(tmp_path):
    inputs = model_inputs(graphs.embedding_matmul(vocab=VOCAB))
    two = model_inputs(text_graph())
    ids = np.random.default_rng(0).integers(0, VOCAB, (4, 6)).astype(np.int32)
    np.savez(tmp_path / "named.npz", ids=ids)
    np.savez(tmp_path / "other.npz", tokens=ids, extra=ids)
    np.save(tmp_path / "ids.npy", ids)
    assert (read_data(tmp_path / "named.npz", inputs)["ids"] == ids).all()
    assert (read_data(tmp_path / "ids.npy", inputs)["ids"] == ids).all()
    assert (read_data(tmp_path / "other.npz", inputs, key="tokens")["ids"] == ids).all()
    with pytest.raises(DataRefused, match=r"holds arrays \['tokens', 'extra'\]; the file's inputs are \['ids'\]"):
        read_data(tmp_path / "other.npz", inputs)
    with pytest.raises(DataRefused, match="holds no array 'nope'"):
        read_data(tmp_path / "other.npz", inputs, key="nope")
    with pytest.raises(DataRefused, match="the file has 4 inputs .*give a .npz with one array per input name"):
        read_data(tmp_path / "ids.npy", two)
    with pytest.raises(DataRefused, match="--key picks one array, but the file has 4 inputs"):
        read_data(tmp_path / "other.npz", two, key="tokens")
    with pytest.raises(DataRefused, match="image folder, but the file's inputs"):
        read_data(tmp_path, two)


def test_the_python_api_takes_arrays_tensors_dicts_tuples_and_lists_of_them():
    one = model_inputs(graphs.embedding_matmul(vocab=VOCAB))
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    for data in (ids, torch.from_numpy(ids), {"ids": ids}, [ids, ids], [{"ids": ids}], [(torch.from_numpy(ids),)]):
        feeds = as_feeds(data, one)
        assert all(f["ids"].dtype == np.int64 and f["ids"].shape == (2, 6) for f in feeds)
    two = model_inputs(text_graph())
    batch = (ids[:, :1].repeat(8, 1), np.ones((2, 8)), np.ones(2, bool), np.zeros((2, 3)))
    (feed,) = as_feeds(batch, two)  # one positional batch, in the file's input order
    assert list(feed) == ["input_ids", "attention_mask", "flag", "scale"]
    with pytest.raises(DataRefused, match="give each batch as a dict"):
        as_feeds([ids], two)
    with pytest.raises(DataRefused, match="no calibration batch"):
        as_feeds([], one)
    with pytest.raises(DataRefused, match="the data is a int"):
        as_feeds(3, one)


def test_a_run_is_fed_at_the_file_s_batch_size_at_most_n_batches():
    model = graphs.embedding_matmul(vocab=VOCAB)
    ids = np.arange(30, dtype=np.int64).reshape(5, 6)
    given = for_run(model, ids, n=3)
    assert given.origin == "given" and [f["ids"].shape for f in given.batches] == [(1, 6)] * 3
    assert len(for_run(model, [ids[:2], ids[2:]], n=20).batches) == 5  # batches re-cut at the file's batch
    made = for_run(model, None, n=4)
    assert made.origin == "generated" and len(made.batches) == 4 and "ids: ids in [0, 100)" in made.describe()
