"""The ONNX operator -> role table: which tensors of each operator carry a Q/DQ pair, as data.

The same concept as the PyTorch path's annotator (``quantize.annotator.ROLES``), over ONNX op types:

- ``weighted``: Conv / ConvTranspose / Gemm / MatMul reading a stored weight: the activation input
  and the output are quantized per tensor, the weight int8 per channel (``weight_axis``); the bias
  stays a float initializer (ONNX Runtime quantizes it to int32 itself when it fuses). A MatMul of two activations is ``matmul``: both inputs per
  tensor.
- ``shared``: data movement (Reshape, Transpose, Slice, Gather, MaxPool, Resize...): the data input
  and the output share one scale and zero-point, so a runtime can drop the pair and move integers.
- ``concat``: every input and the output share one scale.
- ``integer_capable``: ops ONNX Runtime has integer kernels for (Add, Mul, average pooling, Sigmoid,
  LeakyRelu); one runs on integers when its output is read quantized: its inputs then read quantized,
  a float op's value getting a pair unless another float reader would then dequantize it, and a stored
  operand of an Add or a Mul (``x * a + b``) kept per tensor beside it (``place.plan``).
- ``table`` (``TABLE_OPS``): a Gather reading a stored float table by computed indices (an embedding):
  the table is stored int8 per tensor and the output quantized under the same scale (``tables``);
  the indices stay integer.
- ``fused_activation``: Relu / Clip right after a weighted op: the quantization point moves past
  them (the integer kernel clamps instead).

Everything else (the arithmetic of a written-out normalisation: ReduceSum, Sub, Pow, Sqrt, Div...)
stays float, unless the target needs a fully integer graph (``full`` placement), where every float
activation gets a pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantship.inspect.read.view import TABLE_READERS
from quantship.targets import FloatRule

WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
SHARED_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Slice", "Gather",
              "MaxPool", "GlobalMaxPool", "Resize", "Split", "Expand", "Tile", "DepthToSpace", "SpaceToDepth",
              "ReduceMax", "ReduceMin", "Dropout")
CONCAT_OPS = ("Concat",)
TABLE_OPS = TABLE_READERS  # pure data movement: a stored data input is a table (inspect reads the same list)
INTEGER_CAPABLE_OPS = ("Add", "Mul", "GlobalAveragePool", "AveragePool", "Sigmoid", "LeakyRelu")
FUSED_ACTIVATION_OPS = ("Relu", "Clip")

# which inputs of an op hold the values (the others are shapes, indices, axes, scales)
DATA_INPUTS: dict[str, tuple[int, ...]] = {
    **{op: (0,) for op in ("Reshape", "Squeeze", "Unsqueeze", "Slice", "Gather", "Resize", "Split", "Expand",
                           "Tile", "ReduceMax", "ReduceMin", "ReduceMean", "ReduceSum", "Pad", "Clip", "Dropout",
                           "Shape", "Size", "TopK", "GatherElements", "ScatterND")},
    "Conv": (0,), "ConvTranspose": (0,), "Gemm": (0,), "MatMul": (0, 1),
    "BatchNormalization": (0,), "LayerNormalization": (0,), "InstanceNormalization": (0,),
    "Range": (), "ConstantOfShape": (), "NonZero": (),
}

ROLES: dict[str, str] = {
    **{op: "weighted" for op in WEIGHTED_OPS},
    **{op: "shared" for op in SHARED_OPS},
    **{op: "concat" for op in CONCAT_OPS},
    **{op: "integer_capable" for op in INTEGER_CAPABLE_OPS},
    **{op: "fused_activation" for op in FUSED_ACTIVATION_OPS},
}


@dataclass(frozen=True)
class Placement:
    """How a target wants Q/DQ pairs placed: ``integer`` (around the ops its runtime runs as integer
    kernels; fragile float arithmetic stays float) or ``full`` (every float activation, for targets
    whose rules refuse a mixed graph)."""

    mode: str  # "integer" or "full"
    activation_dtype: str  # "uint8" or "int8"
    symmetric: bool
    weight_bound: int  # 127, or 63 with reduce_range
    per_channel: bool
    float_rules: tuple[FloatRule, ...] = ()  # the target's: weighted ops its runtime runs faster in float
    float_output_ops: tuple[str, ...] = ()  # weighted ops whose integer kernel can write a float result

    def as_dict(self) -> dict:
        return {"mode": self.mode, "activation_dtype": self.activation_dtype, "symmetric": self.symmetric,
                "weight_bound": self.weight_bound, "per_channel": self.per_channel,
                "float_rules": [rule.id for rule in self.float_rules], "float_output_ops": list(self.float_output_ops)}


def runs_faster_in_float(placement: Placement, op_type: str, attributes: dict,
                         weight_shape: tuple[int, ...]) -> str | None:
    """The reason a weighted op stays float for the placement's runtime (None: quantize it)."""
    return next((rule.why for rule in placement.float_rules if rule.applies(op_type, attributes, weight_shape)), None)


def role_of(op_type: str, domain: str = "") -> str:
    """The role of an operator (``float`` when it has none)."""
    if domain not in ("", "ai.onnx"):
        return "float"
    return ROLES.get(op_type, "float")


def data_inputs(op_type: str, n_inputs: int) -> tuple[int, ...]:
    """Indices of the inputs that carry values (every input for ops the table does not name)."""
    found = DATA_INPUTS.get(op_type)
    return tuple(range(n_inputs)) if found is None else tuple(i for i in found if i < n_inputs)


def weight_axis(op_type: str, attributes: dict, weight_rank: int) -> int | None:
    """The output-channel axis of a stored weight (None: per tensor only)."""
    if op_type == "Conv":
        return 0
    if op_type == "ConvTranspose":
        group = attributes.get("group", 1)
        return 1 if group == 1 else None
    if op_type == "Gemm":
        return 0 if attributes.get("transB", 0) else 1
    if op_type == "MatMul":
        return weight_rank - 1 if weight_rank == 2 else None
    return None
