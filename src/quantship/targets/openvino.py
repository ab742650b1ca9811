"""Intel OpenVINO (CPU plugin): runs partially quantized QDQ graphs, and ONNX Runtime's weight-only MatMulNBits."""

from __future__ import annotations

from quantship.targets.target import ALL_QDQ, FileRules, Target

TARGET = Target(
    target="openvino",
    spec_kwargs={"backend": "pt2e", "symmetric": False, "reduce_range": True},
    activation_dtype="uint8",
    why="uint8 activation files compile on CPU without a precision hint",
    dynamic_batch=True,
    consumer="OpenVINO",
    file_rules=FileRules(
        (10, 26), ("int8", "uint8"), ("int8", "uint8"),
        errors=(*ALL_QDQ, "int32_bias"), warnings=("fully_quantized", "weight_range_7bit", "activation_dtype"),
        source="runs partially quantized QDQ graphs (float parts stay float); OpenVINO 2026.4 compiles and runs "
               "uint16 activation pairs, but not as their Q/DQ arithmetic (outputs up to 0.11 from ONNX Runtime's "
               "literal reading on the PP-OCR classifier, where int8 agrees to 2e-6): a remark, not int8/uint8",
        lsb_tolerance=2.0,
        local_functions=True,
        # its ONNX frontend reads ONNX Runtime's weight-only MatMulNBits (4 and 8 bits, grouped scales) as a
        # compressed-weight MatMul: measured with OpenVINO 2026.4 on quantship's weight-only files, within 3e-7
        # (relative) of ONNX Runtime reading them at accuracy_level 0 with DYNAMIC_QUANTIZATION_GROUP_SIZE=0
        operators=("com.microsoft::MatMulNBits",)),
    runner="openvino-cpu",
)
