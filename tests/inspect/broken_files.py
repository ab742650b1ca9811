"""Broken copies of a small QDQ file: bad scales, zero-points, axes, dims and op domains.

Each case edits one thing of a real export (``SmallNet`` through pt2e and ``export_qdq``) and says
which node and value ``check`` must name when it refuses the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper


@dataclass(frozen=True)
class Broken:
    name: str
    edit: Callable[[onnx.ModelProto], None]
    named: str  # a word the refusal must contain (the node, tensor or value it is about)


def _nodes(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type]


def weight_dequantize(model: onnx.ModelProto) -> onnx.NodeProto:
    """The first DequantizeLinear of a stored weight (an export makes each right before its reader)."""
    stored = {t.name for t in model.graph.initializer}
    return next(n for n in _nodes(model, "DequantizeLinear") if n.input[0] in stored)


def _init(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in model.graph.initializer if t.name == name)


def _replace(model: onnx.ModelProto, name: str, values: np.ndarray) -> None:
    _init(model, name).CopyFrom(numpy_helper.from_array(values, name))


def _activation_scale(value: float):
    def edit(model):
        name = _nodes(model, "QuantizeLinear")[0].input[1]
        _replace(model, name, np.array(value, dtype=np.float32))
    return edit


def _weight_scale(value: float):
    def edit(model):
        name = weight_dequantize(model).input[1]
        values = numpy_helper.to_array(_init(model, name)).copy()
        values[1] = value
        _replace(model, name, values)
    return edit


def _axis(op_type: str, value: int):
    def edit(model):
        node = weight_dequantize(model) if op_type == "DequantizeLinear" else _nodes(model, op_type)[0]
        for attr in node.attribute:
            if attr.name == "axis":
                attr.i = value
                return
        node.attribute.append(helper.make_attribute("axis", value))
    return edit


def _weight_zero_point(values_of: Callable[[np.ndarray], np.ndarray]):
    def edit(model):
        node = weight_dequantize(model)
        _replace(model, node.input[2], values_of(numpy_helper.to_array(_init(model, node.input[2]))))
    return edit


def _custom_domain(domain: str, register: bool = False):
    def edit(model):
        relu = _nodes(model, "Relu")[0]
        relu.op_type, relu.domain = "FooBar", domain
        model.opset_import.append(helper.make_opsetid(domain, 1))
        if register:  # a model-local function defines FooBar as a Relu
            model.functions.append(helper.make_function(
                domain, "FooBar", ["x"], ["y"], [helper.make_node("Relu", ["x"], ["y"])],
                [helper.make_opsetid("", 18)]))
    return edit


def _input_dim(value: int):
    def edit(model):
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = value
    return edit


def _initializer_dims(model):
    """A weight stored with a negative dimension (and no data: nothing to read)."""
    tensor = model.graph.initializer.add()
    tensor.name, tensor.data_type = "bad_dims", onnx.TensorProto.FLOAT
    tensor.dims.extend([-2, 4])


BAD_SCALES = (float("nan"), 0.0, -0.1, float("inf"), 1e-45)
CASES: tuple[Broken, ...] = (
    *(Broken(f"activation scale {v}", _activation_scale(v), "scale") for v in BAD_SCALES),
    *(Broken(f"weight scale {v}", _weight_scale(v), "scale") for v in BAD_SCALES),
    Broken("weight axis 4", _axis("DequantizeLinear", 4), "axis"),
    Broken("weight axis -5", _axis("DequantizeLinear", -5), "axis"),
    Broken("weight axis 1 (8 scales for 3 channels)", _axis("DequantizeLinear", 1), "axis"),
    Broken("activation axis 7", _axis("QuantizeLinear", 7), "axis"),
    Broken("weight zero-point uint8 on int8", _weight_zero_point(lambda z: z.astype(np.uint8)), "zero-point"),
    Broken("weight zero-point int32 300", _weight_zero_point(lambda z: (z.astype(np.int32) + 300)), "zero-point"),
    Broken("custom domain com.acme", _custom_domain("com.acme"), "com.acme"),
    # a negative batch (-1, -5) is not here: ONNX Runtime reads it as dynamic (tests/quantize_onnx/test_check_dims.py)
    Broken("input batch 0", _input_dim(0), "dimension"),
    Broken("initializer dims -2x4", _initializer_dims, "bad_dims"),
)
# accepted where the runtime defines the domain or the file defines the op
REGISTERED_DOMAIN = Broken("com.acme registered as a local function", _custom_domain("com.acme", register=True),
                           "com.acme")
MICROSOFT_DOMAIN = Broken("com.microsoft domain", _custom_domain("com.microsoft"), "com.microsoft")


def write(case: Broken, source: Path, directory: Path) -> Path:
    """``source`` with ``case``'s edit applied, saved in ``directory``."""
    model = onnx.load(str(source))
    case.edit(model)
    path = directory / (case.name.replace(" ", "_").replace("/", "_") + ".onnx")
    onnx.save(model, str(path))
    return path


def acceptance(source: Path, directory: Path, targets: tuple[str, ...]) -> dict[str, int]:
    """For each target, how many of ``CASES`` its static check accepts (a refusal or exception: not accepted)."""
    from quantship.inspect.judge.check import check_file

    accepted = dict.fromkeys(targets, 0)
    for case in CASES:
        path = write(case, source, directory)
        for target in targets:
            try:
                accepted[target] += check_file(path, target).ok
            except (ValueError, FileNotFoundError):
                pass
    return accepted


if __name__ == "__main__":
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(len(CASES), "cases;", acceptance(Path(sys.argv[1]), Path(tmp),
                                               ("onnxruntime", "openvino", "tigris", "tensorrt")))
