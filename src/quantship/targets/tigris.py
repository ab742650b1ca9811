"""TiGrIS: a fixed-memory plan for microcontrollers; fully quantized, static batch 1, its own kernel set."""

from __future__ import annotations

from quantship.targets.target import ALL_QDQ, FileRules, Target

TARGET = Target(
    target="tigris",
    spec_kwargs={"backend": "pt2e", "symmetric": True, "qscheme": "per_channel"},
    activation_dtype="int8",
    why="per-tensor int8 activations, fully quantized: one dtype for the whole plan",
    dynamic_batch=False,
    consumer="TiGrIS",
    file_rules=FileRules(
        (10, 26), ("int8", "uint8"), ("int8", "uint8"),
        errors=(*ALL_QDQ, "fully_quantized", "per_tensor_activations", "activation_dtype",
                "weight_dtype", "int32_bias", "tigris_kernels"),
        warnings=("one_scale_pairs",),
        source="TiGrIS quantization guide: QDQ, static, fully quantized; uint8 restated as int8; kernel "
               "forms measured with tigris analyze 0.12.1",
        lsb_tolerance=4.0),
    runner="tigris-cli",
    has_hard_sigmoid=False,  # its operator contract has HardSwish and Clip, not HardSigmoid
    runs_lone_batch_norm=False,  # it folds Conv -> BatchNormalization and has no kernel for one alone
    # 0.12.1 refused the PP-OCR classifier's squeeze-excitation means (ReduceMean over H, W, from the PyTorch
    # path) after some producers ("needs one rank-3 input"); the same file with GlobalAveragePool compiles
    spatial_mean_as_global_pool=True,
    # tigris compile 0.12.1: "StridedSlice supports rank at most 4" (also the tigris_kernels rule's bound)
    max_slice_rank=4,
    # no Pow kernel and int8 reductions only on quantized tensors; it has LayerNormalization (operator contract)
    runs_written_out_layer_norm=False,
)
