"""ONNX Runtime on a CPU: the runtime quantship measures with, and the most permissive reader of QDQ files."""

from __future__ import annotations

from quantship.targets.target import READABLE, FileRules, FloatRule, Target


# module-level predicates (no lambdas): a model carrying its Target pickles (torch.save, spawned ranks)
def _conv_transpose(op_type: str, attributes: dict, weight_shape: tuple[int, ...]) -> bool:
    return op_type == "ConvTranspose"


def _depthwise_over_3x3(op_type: str, attributes: dict, weight_shape: tuple[int, ...]) -> bool:
    group = attributes.get("group", 1)
    return (op_type == "Conv" and group > 1 and len(weight_shape) == 4 and weight_shape[1] == 1
            and weight_shape[2] * weight_shape[3] > 9)


def _lstm_under_64_units(op_type: str, attributes: dict, weight_shape: tuple[int, ...]) -> bool:
    return op_type == "LSTM" and len(weight_shape) == 3 and weight_shape[1] // 4 < 64  # W: [dirs, 4 * hidden, in]


TARGET = Target(
    target="onnxruntime-cpu",
    spec_kwargs={"backend": "pt2e", "symmetric": False, "reduce_range": True},
    activation_dtype="uint8",
    why="uint8 affine activations let ONNX Runtime fuse every Conv/Gemm/Add into integer kernels; "
        "7-bit weights keep its u8s8 kernels from saturating on x86 CPUs without VNNI",
    dynamic_batch=True,
    consumer="ONNX Runtime",
    file_rules=FileRules(
        (10, 26), ("int8", "uint8", "int16", "uint16"), ("int8", "uint8", "int16", "uint16", "int4", "uint4"),
        errors=(*READABLE, "opset_declared", "opset_range", "int32_bias"),
        warnings=("quantized", "qdq_format", "static_scales", "fully_quantized", "weight_range_7bit"),
        source="runs QOperator, dynamic and mixed files; QDQ is what other runtimes share",
        domains=("com.microsoft", "com.microsoft.nchwc", "ai.onnx.ml"), local_functions=True),
    runner="onnxruntime-fused",
    runtime_is_onnxruntime=True,
    # measured on its optimized graph; the plan says why each stays float (the census lists them as such)
    float_rules=(
        FloatRule("conv_transpose", "ONNX Runtime 1.32's CPU QDQ fusion leaves a per-channel ConvTranspose float "
                  "(census of the PP-OCRv4 detector): a Q/DQ pair would only add rounding",
                  _conv_transpose),
        FloatRule("depthwise_over_3x3", "ONNX Runtime's u8s8 depthwise kernel is fast for 3x3 only; a 5x5 depthwise "
                  "Conv ran 4-6x slower as QLinearConv than as its float NCHWc Conv (PP-OCR, batch 8)",
                  _depthwise_over_3x3),
        FloatRule("lstm_under_64_units", "ONNX Runtime's DynamicQuantizeLSTM ran slower than its float LSTM below 64 "
                  "hidden units at batch 1 (bench/recurrent.py, AVX-512 VNNI: 0.83x at 32 units, 0.99-1.16x at 64, "
                  "1.52x at 128)", _lstm_under_64_units),
    ),
    # it fuses DequantizeLinear -> MatMul with a float result into MatMulIntegerToFloat: a MatMul whose
    # readers are float ops keeps its result float (one rounding fewer), and still runs on integers
    float_output_ops=("MatMul",),
    requantize_before_relu=True,
    prelu_slower_than_written_out=True,  # measured: PRelu 14x slower than Max(x, x*a), 4x than Relu+Min*a+Add
    hard_swish_faster_as_one_op=True,  # measured: a written-out hard swish is slower than one HardSwish
    # measured: PP-OCRv4's detector from PyTorch, its 10 squeeze-excitation means as ReduceMean on the INT8 file's
    # NHWC tensors took 7.9 ms of 104 ms at batch 1; as GlobalAveragePool (QLinearGlobalAveragePool) under 1 ms
    spatial_mean_as_global_pool=True,
    weight_only_form="MatMulNBits",  # com.microsoft
    # com.microsoft DynamicQuantizeLSTM (int8 W and R, activations quantized in the kernel); no integer GRU or RNN
    integer_recurrent_ops=("LSTM",),
    quantizes_float_convs=True,  # its weight and bias quantization (1.21+), at its default optimizations
)
