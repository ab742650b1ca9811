"""Models whose forward returns a tuple, a dict or a transformers ``ModelOutput``: every tensor exported under
its key, checked, and read in its own LSB (issue 29, item 1).

What is refused, in one line naming the output: a None or non-tensor leaf (a number, a string), an empty
container, two keys that print the same name, ``output_names`` of the wrong length. Nested containers are
accepted (``hidden_states.0``).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn

from quantship import Quantizer
from quantship.errors import ExportRefused, OutputsRefused
from quantship.export.qdq import export_qdq
from quantship.inspect.run.outputs import flatten_outputs, names_of
from quantship.inspect.run.verify import verify_qdq
from tests.fresh.structured import two_heads

ROOT = Path(__file__).resolve().parent.parent
COMPUTE_OPS = {"Conv", "Gemm", "MatMul"}
LSB_LITERAL = 4  # ORT literal vs the torch quantized model (the transformers suite's bound)
MIN_SPAN_LSB = 20  # an output spanning fewer steps than this makes its LSB figure say little


def _t(*shape: int) -> torch.Tensor:
    return torch.zeros(shape)


# ---------------------------------------------------------------- names, without a model


def test_names_follow_keys_positions_and_nesting():
    assert names_of(_t(1, 2)) is None  # a single tensor keeps the exporter's name
    assert names_of((_t(1), _t(2))) == ["output_0", "output_1"]
    assert names_of([_t(1)]) == ["output_0"]
    assert names_of(collections.OrderedDict(out=_t(1), aux=_t(1))) == ["out", "aux"]
    assert names_of({"b": _t(1), "a": _t(1)}) == ["b", "a"]  # insertion order, as torch's pytree flattens
    assert names_of({"a": _t(1), "h": (_t(1), {"k": _t(1)})}) == ["a", "h.0", "h.1.k"]
    assert names_of((_t(1), (_t(1), _t(1)))) == ["output_0", "output_1.0", "output_1.1"]


def test_a_model_output_gives_its_fields_that_are_set_in_order():
    from transformers.utils import ModelOutput

    @dataclass
    class TwoLogits(ModelOutput):
        loss: torch.Tensor | None = None
        start_logits: torch.Tensor | None = None
        end_logits: torch.Tensor | None = None

    start, end = _t(2, 3), torch.ones(2, 3)
    leaves = flatten_outputs(TwoLogits(start_logits=start, end_logits=end))
    assert [name for name, _ in leaves] == ["start_logits", "end_logits"]
    assert leaves[1][1] is end


@pytest.mark.parametrize("output, named", [
    ((_t(1), None), "output 'output_1' of the model is None"),
    ({"out": _t(1), "n": 3}, "output 'n' of the model is of type int"),
    ({"out": _t(1), "h": ()}, "output 'h' of the model is an empty tuple"),
    ({1: _t(1), "1": _t(1)}, "repeat the name(s) ['1']"),
    ("text", "the output of the model is of type str"),
])
def test_what_cannot_be_exported_is_refused_by_name(output, named):
    with pytest.raises(OutputsRefused) as info:
        flatten_outputs(output)
    message = str(info.value)
    assert named in message and "\n" not in message


def test_a_graph_whose_outputs_do_not_line_up_with_the_model_is_refused():
    from onnx import TensorProto, helper

    from quantship.export.named_outputs import check_outputs_line_up

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph)
    check_outputs_line_up(model, [np.zeros((2, 3))])
    with pytest.raises(ExportRefused, match=r"wrote 1 output\(s\) of rank\(s\) \[2\] for a model that returns 2"):
        check_outputs_line_up(model, [np.zeros((2, 3)), np.zeros(2)])
    with pytest.raises(ExportRefused, match=r"returns 1 tensor\(s\) of rank\(s\) \[4\]"):
        check_outputs_line_up(model, [np.zeros((2, 3, 1, 1))])


# ---------------------------------------------------------------- the small two-head model, end to end


@pytest.fixture(scope="module")
def dict_pt2e():
    model, calibration, sample = two_heads("dict")
    return Quantizer.for_target("onnxruntime-cpu").quantize(model, calibration), sample


@pytest.fixture(scope="module")
def dict_file(dict_pt2e, tmp_path_factory):
    qmodel, sample = dict_pt2e
    return export_qdq(qmodel, sample, tmp_path_factory.mktemp("structured") / "dict.onnx", target="onnxruntime-cpu")


def _output_span_lsb(qmodel, sample, path) -> dict[str, float]:
    from quantship.inspect.read.lsb import output_scales

    scales = output_scales(path)
    with torch.no_grad():
        leaves = flatten_outputs(qmodel(sample))
    return {name: float(t.max() - t.min()) / scales[name] for (name, t) in leaves}


def test_a_dict_output_is_exported_under_its_keys_and_read_output_by_output(dict_pt2e, dict_file):
    """The failure of issue 29: 'OrderedDict' object has no attribute 'detach'. Both outputs are now
    graph outputs named after their keys, in the model's order, and each is read in its own LSB."""
    qmodel, sample = dict_pt2e
    graph = onnx.load(str(dict_file)).graph
    assert [o.name for o in graph.output] == ["out", "aux"]
    assert [len(o.type.tensor_type.shape.dim) for o in graph.output] == [4, 2]
    readings = dict_file.readings
    assert list(readings.per_output) == ["out", "aux"]
    for name, reading in readings.per_output.items():
        assert reading.literal_lsb is not None and reading.literal_lsb <= LSB_LITERAL, (name, reading)
        assert reading.fused_lsb is not None
    assert readings.literal_lsb == max(r.literal_lsb for r in readings.per_output.values())
    assert readings.n_values == 2 * 4 * 12 * 12 + 2 * 5
    spans = _output_span_lsb(qmodel, sample, dict_file)
    assert min(spans.values()) > MIN_SPAN_LSB, spans  # neither output is constant: the LSB figures mean something
    assert "aux" in str(readings) and "out" in str(readings)
    as_json = json.loads(json.dumps(readings.as_dict()))  # the CLI's --json document carries it as is
    assert list(as_json["per_output"]) == ["out", "aux"]
    assert as_json["per_output"]["aux"]["literal_lsb"] == readings.per_output["aux"].literal_lsb
    producer = {o: n for n in graph.node for o in n.output}
    compute = [n for n in graph.node if n.op_type in COMPUTE_OPS]
    assert compute and all(producer[i].op_type == "DequantizeLinear" for n in compute for i in n.input[:2])


def test_verify_qdq_reads_every_output_so_a_wrong_second_output_shows(dict_pt2e, dict_file, tmp_path):
    """Doubling the scale of the DequantizeLinear that writes ``aux`` doubles that output only: the file
    still agrees on ``out``, and ``aux`` is read tens of LSB away (a check of the first output only
    would pass this file)."""
    qmodel, sample = dict_pt2e
    model = onnx.load(str(dict_file))
    producer = {o: n for n in model.graph.node for o in n.output}
    dq = producer["aux"]
    assert dq.op_type == "DequantizeLinear"
    scale = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == dq.input[1]))
    # a scale of its own: the QuantizeLinear before it reads the same initializer
    model.graph.initializer.append(onnx.numpy_helper.from_array(scale * 2, "aux_scale_doubled"))
    dq.input[1] = "aux_scale_doubled"
    wrong = tmp_path / "wrong_aux.onnx"
    onnx.save(model, str(wrong))
    good = verify_qdq(qmodel, dict_file, sample).readings
    bad = verify_qdq(qmodel, wrong, sample).readings
    assert bad.per_output["out"].literal_lsb == good.per_output["out"].literal_lsb
    assert bad.per_output["aux"].literal_lsb > 10 * max(good.per_output["aux"].literal_lsb, 1)
    assert bad.literal_lsb == bad.per_output["aux"].literal_lsb


def test_a_tuple_output_is_named_by_position_and_output_names_rename_it(tmp_path):
    model, calibration, sample = two_heads("tuple")
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, calibration)
    path = export_qdq(qmodel, sample, tmp_path / "tuple.onnx")
    assert [o.name for o in onnx.load(str(path)).graph.output] == ["output_0", "output_1"]
    assert list(path.readings.per_output) == ["output_0", "output_1"]
    assert verify_qdq(qmodel, path, sample).readings.per_output.keys() == path.readings.per_output.keys()
    with pytest.raises(ExportRefused, match=r"returns 2 tensor output\(s\) \(output_0, output_1\); give 2"):
        export_qdq(qmodel, sample, tmp_path / "one_name.onnx", output_names=["seg"])
    assert not (tmp_path / "one_name.onnx").exists()


def test_nested_outputs_are_named_by_their_path(tmp_path):
    model, calibration, sample = two_heads("nested")
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, calibration)
    path = export_qdq(qmodel, sample, tmp_path / "nested.onnx")
    assert [o.name for o in onnx.load(str(path)).graph.output] == ["seg.out", "cls.0"]
    assert all(r.literal_lsb is not None and r.literal_lsb <= LSB_LITERAL for r in path.readings.per_output.values())


def test_a_none_output_is_refused_before_anything_is_written(tmp_path):
    model, calibration, sample = two_heads("none")
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, calibration)
    target = tmp_path / "none.onnx"
    with pytest.raises(ExportRefused) as info:
        export_qdq(qmodel, sample, target)
    message = str(info.value)
    assert "output 'output_1'" in message and "is None" in message and "return tensors only" in message
    assert "\n" not in message and not target.exists() and not list(tmp_path.iterdir())


def test_the_cli_refuses_a_none_output_in_one_line_with_exit_2(tmp_path, capsys):
    from quantship.cli.main import main

    src = tmp_path / "net.py"
    src.write_text("from tests.fresh.structured import TwoHeads\n\n\ndef build():\n    return TwoHeads('none')\n")
    calib = tmp_path / "cal.npy"
    np.save(calib, np.random.default_rng(0).standard_normal((4, 3, 12, 12)).astype(np.float32))
    out = tmp_path / "none.onnx"
    code = main(["quantize", f"{src}:build", "--calib", str(calib), "--out", str(out), "--target", "onnxruntime-cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    assert "output 'output_1' of the model (TwoHeads) is None" in err[-1] and "Traceback" not in "".join(err)


def test_the_float_file_names_its_outputs_as_the_int8_file(dict_file, tmp_path):
    from quantship import export_onnx

    model, _, sample = two_heads("dict")
    path = export_onnx(model, sample, tmp_path / "fp32.onnx")
    assert [o.name for o in onnx.load(str(path)).graph.output] == [o.name for o in onnx.load(str(dict_file)).graph.output]


def test_the_int8_file_is_the_same_after_a_float_export_in_a_fresh_process(dict_file, tmp_path):
    """In a child process: the float export first (the order in which the exporter's shared translation
    table once leaked), then quantize and the INT8 export. Same bytes as this process's file, same
    names, every output read."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])),
               # the child calibrates with this process's torch thread count (one per xdist worker): a
               # float reduction split over another number of threads can move a scale by one step
               OMP_NUM_THREADS=str(torch.get_num_threads()))
    done = subprocess.run([sys.executable, "-m", "tests.fresh.structured", "fp32-first", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "names: ['out', 'aux']" in done.stdout
    assert "per_output: {'out':" in done.stdout and "'aux':" in done.stdout
    assert [o.name for o in onnx.load(str(tmp_path / "fp32.onnx")).graph.output] == ["out", "aux"]
    assert (tmp_path / "int8.onnx").read_bytes() == dict_file.read_bytes()


# ---------------------------------------------------------------- real models: torchvision, transformers


def _reestimate_batch_norms(model: nn.Module, size: int) -> None:
    """An untrained torchvision MobileNetV3's signal shrinks to nothing by its head (depthwise init and
    BatchNorm at mean 0 / variance 1: see ZOO.md's preparation); one batch of random images as
    BatchNorm statistics puts every activation back at unit spread."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    with torch.no_grad():
        model(torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(2)))
    model.eval()


@pytest.mark.slow  # 30 s of CPU, 90 s on the shared 2-core machine
# the fused reading drifts from the literal one as on torchvision's mobilenet_v3_large (ZOO.md: 0 / 29 LSB)
@pytest.mark.filterwarnings("ignore::quantship.inspect.run.verify.FusedKernelDrift")
def test_lraspp_segmentation_is_fully_int8_and_its_output_named_out(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    size = 64
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None).eval()
    _reestimate_batch_norms(model, size)
    g = torch.Generator().manual_seed(1)
    calibration = [torch.randn(1, 3, size, size, generator=g) for _ in range(2)]
    sample = torch.randn(1, 3, size, size, generator=g)
    quantizer = Quantizer.for_target("onnxruntime-cpu")
    qmodel = quantizer.quantize(model, calibration)
    path = export_qdq(qmodel, sample, tmp_path / "lraspp.onnx", target="onnxruntime-cpu")
    graph = onnx.load(str(path)).graph
    assert [o.name for o in graph.output] == ["out"]
    producer = {o: n.op_type for n in graph.node for o in n.output}
    compute = [n for n in graph.node if n.op_type in COMPUTE_OPS]
    float_compute = [n.name for n in compute if any(producer.get(i) != "DequantizeLinear" for i in n.input[:2])]
    # integer but for the depthwise convs the target's float rules keep float, as the ONNX path does
    assert len(compute) > 50 and len(float_compute) == len(quantizer.report.kept_float)
    assert path.readings.literal_lsb is not None and path.readings.literal_lsb <= LSB_LITERAL, path.readings
    assert path.readings.fused_lsb is not None  # the file ran at ORT's default optimizations too
    assert _output_span_lsb(qmodel, sample, path)["out"] > MIN_SPAN_LSB


@pytest.mark.slow
def test_a_question_answering_model_output_exports_both_logits(tmp_path):
    """DistilBERT's QuestionAnsweringModelOutput (loss None, start_logits, end_logits): both logits are
    graph outputs under their field names, each fully INT8 upstream and read in its own LSB."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(vocab_size=128, dim=64, n_layers=2, n_heads=2, hidden_dim=128,
                                           max_position_embeddings=32)
    model = transformers.DistilBertForQuestionAnswering(config).eval()
    g = torch.Generator().manual_seed(1)
    calibration = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)]
    sample = torch.randint(0, 128, (2, 16), generator=g)
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, calibration)
    path = export_qdq(qmodel, sample, tmp_path / "qa.onnx", target="onnxruntime-cpu")
    graph = onnx.load(str(path)).graph
    assert [o.name for o in graph.output] == ["start_logits", "end_logits"]
    readings = path.readings
    assert list(readings.per_output) == ["start_logits", "end_logits"]
    assert all(r.literal_lsb is not None and r.literal_lsb <= LSB_LITERAL for r in readings.per_output.values())
    spans = _output_span_lsb(qmodel, sample, path)
    assert min(spans.values()) > MIN_SPAN_LSB, spans
    producer = {o: n.op_type for n in graph.node for o in n.output}
    compute = [n for n in graph.node if n.op_type in COMPUTE_OPS]
    assert compute and all(producer.get(i) == "DequantizeLinear" for n in compute for i in n.input[:2])
