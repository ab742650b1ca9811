"""NVIDIA TensorRT: explicit quantization, int8 with zero-point 0, every activation quantized."""

from __future__ import annotations

from quantship.targets.target import ALL_QDQ, FileRules, Target

TARGET = Target(
    target="tensorrt",
    spec_kwargs={"backend": "pt2e", "symmetric": True},
    activation_dtype="int8",
    why="TensorRT accepts only int8 with zero-point 0",
    dynamic_batch=True,
    consumer="TensorRT",
    file_rules=FileRules(
        (9, 25), ("int8",), ("int8",),
        errors=(*ALL_QDQ, "fully_quantized", "per_tensor_activations", "activation_dtype",
                "weight_dtype", "int32_bias", "zero_point_zero", "conv_kernel_shape"),
        source="TensorRT ONNX opset guide (opsets 9-25); explicit quantization: int8, zero-point 0"),
    runner=None,  # needs an NVIDIA GPU: checked statically only
)
