"""quantize-onnx keeps the float file's interface (issue 38, item 4): every input and output name, in
order; a weight the float file declares as an input a caller may feed cannot stay one in an INT8 file
(the weight is stored as int8), so that file is refused in one line, before any work."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantship.errors import FileRefused
from quantship.quantize_onnx import quantize_onnx_file

RNG = np.random.default_rng(0)
WEIGHT = RNG.standard_normal((4, 8, 3, 3)).astype(np.float32)


def _two_head_model(weight_as_input: bool = False) -> onnx.ModelProto:
    """pixels -> Conv -> Relu -> 'features'; -> GlobalAveragePool -> 'pooled': two named outputs."""
    nodes = [helper.make_node("Conv", ["pixels", "W"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["features"]),
             helper.make_node("GlobalAveragePool", ["features"], ["pooled"])]
    inputs = [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["n", 8, 6, 6])]
    if weight_as_input:  # torch.onnx.export(..., keep_initializers_as_inputs=True) writes this
        inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, list(WEIGHT.shape)))
    outputs = [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["n", 4, 6, 6]),
               helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["n", 4, 1, 1])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(WEIGHT, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _names(path) -> tuple[list[str], list[str]]:
    graph = onnx.load(str(path)).graph
    return [i.name for i in graph.input], [o.name for o in graph.output]


def test_input_and_output_names_kept(tmp_path):
    src = tmp_path / "fp32.onnx"
    onnx.save(_two_head_model(), src)
    calib = RNG.standard_normal((8, 8, 6, 6)).astype(np.float32)
    quantize_onnx_file(src, tmp_path / "int8.onnx", calib, target="onnxruntime-cpu")
    assert _names(tmp_path / "int8.onnx") == _names(src) == (["pixels"], ["features", "pooled"])


def test_weight_declared_as_input_is_refused_before_any_work(tmp_path):
    src = tmp_path / "fp32.onnx"
    onnx.save(_two_head_model(weight_as_input=True), src)
    calib = RNG.standard_normal((8, 8, 6, 6)).astype(np.float32)
    with pytest.raises(FileRefused, match=r"input\(s\) 'W' are also initializers.*cannot keep those inputs"):
        quantize_onnx_file(src, tmp_path / "int8.onnx", calib, target="onnxruntime-cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp32.onnx"]


def test_a_half_precision_model_is_refused_by_name(tmp_path):
    """An fp16 file gets "give the float32 file", not a runtime error about calibration (issue 38)."""
    half = _two_head_model()
    half.graph.initializer[0].CopyFrom(numpy_helper.from_array(WEIGHT.astype(np.float16), "W"))
    for v in (*half.graph.input, *half.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    src = tmp_path / "fp16.onnx"
    onnx.save(half, src)
    with pytest.raises(FileRefused, match=r"is a float16 model .*give the float32 file"):
        quantize_onnx_file(src, tmp_path / "int8.onnx", RNG.standard_normal((8, 8, 6, 6)).astype(np.float16),
                           target="onnxruntime-cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp16.onnx"]
