"""What export_qdq runs in ONNX Runtime to prove a file: each graph state once, the written file
optimized once, identity checks on one row of a symbolic batch; and they still refuse a bad rewrite."""

from __future__ import annotations

import numpy as np
import pytest

import quantship.export.checks as checks
import quantship.export.qdq as qdq
from quantship import export_qdq
from quantship.errors import ExportRefused
from tests.onnx_edits import doubled_scale_pass


@pytest.fixture
def sessions(monkeypatch):
    """Every ONNX Runtime session export_qdq builds, as (optimized, source kind) in order."""
    built: list[tuple[bool, str]] = []
    real = checks.ort_session

    def recording(model, *, optimized=False, **kwargs):
        built.append((optimized, "proto" if hasattr(model, "graph") else "file"))
        return real(model, optimized=optimized, **kwargs)

    monkeypatch.setattr(checks, "ort_session", recording)
    monkeypatch.setattr(qdq, "ort_session", recording)
    return built


@pytest.fixture
def identity_inputs(monkeypatch):
    """The inputs every identity check (check_identical) ran on."""
    seen: list[list[np.ndarray]] = []
    real = checks.check_identical

    def recording(model, reference, inputs, what):
        seen.append(inputs)
        return real(model, reference, inputs, what)

    monkeypatch.setattr(checks, "check_identical", recording)
    return seen


def test_static_int8_runs_the_produced_graph_once(tiny_pt2e, tiny_calib, tmp_path, reuse_produced, sessions,
                                                  identity_inputs):
    out = export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "m.onnx")
    # no rewrite changed an output-bearing part (the exporter wrote kernel_shape), so nothing is compared;
    # the literal reading is the produced graph's run (the file is that graph plus metadata), and the
    # written file is built once, optimized, for its own check and the fused reading
    assert identity_inputs == []
    assert sessions == [(False, "proto"), (True, "file")]
    assert out.readings.literal_lsb is not None and out.readings.fused_lsb is not None


def test_uint8_runs_each_graph_state_once(tiny_affine_pt2e, tiny_calib, tmp_path, sessions, identity_inputs):
    export_qdq(tiny_affine_pt2e, tiny_calib[0], tmp_path / "m.onnx", activation_dtype="uint8")
    # the produced graph (the reference) and the uint8 graph, on the whole static sample; the literal
    # reading reuses the reference, proven identical to the file's graph
    assert [x[0].shape[0] for x in identity_inputs] == [8]
    assert sessions == [(False, "proto"), (False, "proto"), (True, "file")]


def test_symbolic_batch_checks_run_on_one_row(tiny_affine_pt2e, tiny_calib, tmp_path, sessions, identity_inputs):
    out = export_qdq(tiny_affine_pt2e, tiny_calib[0], tmp_path / "m.onnx", activation_dtype="uint8",
                     dynamic_batch=True)
    assert [x[0].shape for x in identity_inputs] == [(1, 1, 32, 32)]
    # the two readings still cover the whole sample: the file optimized once, and literally once
    assert sessions == [(False, "proto"), (False, "proto"), (True, "file"), (False, "file")]
    assert out.readings.n_values == 8 * 10


def test_an_inexact_rewrite_is_refused_on_the_one_row(tiny_pt2e, tiny_calib, tmp_path, monkeypatch):
    monkeypatch.setattr(qdq, "PASSES", (*qdq.PASSES, doubled_scale_pass()))
    with pytest.raises(ExportRefused, match="doubling one activation scale: output 0 differs"):
        export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "m.onnx", dynamic_batch=True)
    assert list(tmp_path.iterdir()) == []


def test_one_row_probe_needs_a_symbolic_batch(tiny_produced):
    x = np.zeros((8, 1, 32, 32), np.float32)
    assert qdq.one_row_probe(tiny_produced, [x]) is None  # a static batch runs that batch only
    dynamic = type(tiny_produced)()
    dynamic.CopyFrom(tiny_produced)
    dynamic.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    (row,) = qdq.one_row_probe(dynamic, [x])
    assert row.shape == (1, 1, 32, 32)
    assert qdq.one_row_probe(dynamic, [x[:1]]) is None  # already one row


@pytest.mark.parametrize("rows, cuts", [(1, [1]), (3, [3]), (4, [2, 2]), (5, [2, 3]), (8, [2, 2, 2, 2]),
                                        (9, [2, 2, 2, 3])])
def test_reference_cuts_of_a_symbolic_batch(rows, cuts):
    import torch

    x = torch.arange(rows * 2.0).reshape(rows, 2)
    got = qdq.reference_batches(x, dynamic_batch=True)
    assert [len(b) for b in got] == cuts
    assert torch.equal(torch.cat(got), x)  # every row once, in order
    (pair,) = qdq.reference_batches((x, x + 1), dynamic_batch=False)  # a static batch runs whole
    assert len(pair[0]) == rows
    assert [[len(t) for t in b] for b in qdq.reference_batches((x, x + 1), dynamic_batch=True)] == [[c, c] for c in cuts]


def test_symbolic_batch_reference_is_the_whole_batch_reading(tiny_affine_pt2e, tiny_calib, tmp_path, monkeypatch):
    import quantship.export.named_outputs as named_outputs

    forwards: list[int] = []
    real = named_outputs.output_arrays

    def recording(model, batches):
        forwards.extend(int(b.shape[0]) for b in batches)
        return real(model, batches)

    monkeypatch.setattr(named_outputs, "output_arrays", recording)
    cut = export_qdq(tiny_affine_pt2e, tiny_calib[0], tmp_path / "cut.onnx", dynamic_batch=True)
    assert forwards == [2, 2, 2, 2]
    monkeypatch.setattr(qdq, "reference_batches", lambda sample, dynamic: [sample])
    whole = export_qdq(tiny_affine_pt2e, tiny_calib[0], tmp_path / "whole.onnx", dynamic_batch=True)
    assert forwards[4:] == [8]
    assert cut.readings == whole.readings
    assert (tmp_path / "cut.onnx").read_bytes() == (tmp_path / "whole.onnx").read_bytes()


def test_the_exporter_builds_its_translation_table_once_per_process(tiny_pt2e, tiny_calib, monkeypatch):
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    import quantship.export.capture as capture

    built = ONNXRegistry.__dict__["from_torchlib"]
    calls: list[int] = []

    def counting(cls, opset_version=18):
        calls.append(opset_version)
        return built.__func__(cls, opset_version=opset_version)

    monkeypatch.setattr(ONNXRegistry, "from_torchlib", classmethod(counting))
    capture._tables.clear()
    kwargs = dict(opset_version=18, dynamic_batch=False, input_names=None, output_names=None)
    first = capture.dynamo_export(tiny_pt2e, tiny_calib[0], **kwargs)
    second = capture.dynamo_export(tiny_pt2e, tiny_calib[0], **kwargs)
    assert calls == [18]  # built for the first export, reused by the second
    assert first.SerializeToString() == second.SerializeToString()
    assert ONNXRegistry.__dict__["from_torchlib"].__func__ is counting  # torch's own method is back after each call
    capture._tables.clear()  # the next export builds with torch's method again


def test_the_uint8_read_back_holds_no_weight(tiny_affine_pt2e, tiny_calib, tmp_path, monkeypatch):
    """The read-back compares node lists and the Q/DQ nodes' scales and zero-points; it keeps no decoded weight (a
    large model's read-back held two copies of every weight, one per graph state, beside the graphs)."""
    import onnx

    import quantship.export.activations as activations

    states: list[activations.GraphState] = []
    real = activations.check_read_back

    def recording(before, after):
        states.extend((before, after))
        return real(before, after)

    monkeypatch.setattr(qdq, "check_read_back", recording)
    out = export_qdq(tiny_affine_pt2e, tiny_calib[0], tmp_path / "m.onnx", activation_dtype="uint8")
    graph = onnx.load(str(out)).graph
    weights = {n.input[0] for n in graph.node if n.op_type == "DequantizeLinear"} & {t.name for t in graph.initializer}
    assert weights and len(states) == 2
    for state in states:
        assert state.parameters and not set(state.parameters) & weights
        assert weights <= state.stored  # what the read-back knows of them: that they are stored
    # the read-back still refuses a state whose scale moved
    before, after = states
    moved = dict(after.parameters)
    name = next(n.input[1] for n in after.nodes if n.op_type == "QuantizeLinear")
    moved[name] = moved[name] * 2
    with pytest.raises(Exception, match="the scale of QuantizeLinear"):
        real(before, activations.GraphState(after.nodes, after.stored, moved))


def test_the_file_facts_keep_no_decoded_weight(tiny_pt2e, tiny_calib, tmp_path):
    """Reading a file's facts decodes each stored weight once (its integer extent) and keeps none of them."""
    from quantship.inspect.read.facts import read_file

    out = export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "m.onnx")
    facts = read_file(out)
    weights = {n.input[0] for n in facts.view.nodes if n.op_type == "DequantizeLinear"} & set(facts.view.initializers)
    assert weights
    assert facts.widest_stored_weight() > 0 and any(q.max_abs_int for q in facts.quant.qdq)
    assert not set(facts.view._values) & weights


@pytest.mark.parametrize("in_memory_below", [checks.CHECKED_IN_MEMORY_BELOW, 0])
def test_the_checker_refuses_a_broken_graph_in_memory_and_written_out(tiny_pt2e, tiny_calib, tmp_path, monkeypatch,
                                                                       in_memory_below):
    """A large graph is checked with its weights written beside it (onnx would otherwise hold two more copies of
    them): the same verdicts, and nothing left behind in the temporary folder."""
    import tempfile

    import onnx

    monkeypatch.setattr(checks, "CHECKED_IN_MEMORY_BELOW", in_memory_below)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out = export_qdq(tiny_pt2e, tiny_calib[0], tmp_path / "m.onnx")
    model = onnx.load(str(out))
    checks.check_model(model, "as written")
    model.graph.node[1].input.append("nowhere")
    with pytest.raises(ExportRefused, match="broken: the rewritten graph fails onnx.checker"):
        checks.check_model(model, "broken")
    short = onnx.load(str(out))  # stored bytes too few for the tensor's shape: refused either way, as onnx refuses it
    weight = max(short.graph.initializer, key=lambda t: len(t.raw_data))
    weight.raw_data = weight.raw_data[:-1]
    with pytest.raises(ExportRefused, match=f"short: .*{weight.name}.*too small for the declared shape"):
        checks.check_model(short, "short")
    assert list((tmp_path / "tmp").iterdir()) == []
