"""A deployment target as one record: its preset, the files it accepts, what quantship writes for it,
and how a file runs there. Data only: the rules, passes and runners that read it live in their rooms."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quantship.precision import Preset

# rule-id groups several targets share (the rules themselves: ``inspect.judge.rules``)
READABLE = ("valid_parameters", "op_domains")  # every target refuses a file that breaks these
ALL_QDQ = (*READABLE, "opset_declared", "opset_range", "quantized", "qdq_format", "static_scales")


@dataclass(frozen=True)
class FileRules:
    """What the runtime loads; ``inspect.judge.rules`` holds the rules these ids name."""

    opset: tuple[int, int]  # inclusive range of the default-domain opset it loads
    activation_dtypes: tuple[str, ...]
    weight_dtypes: tuple[str, ...]
    errors: tuple[str, ...]  # rule ids that make the target refuse the file
    warnings: tuple[str, ...] = ()  # rule ids it tolerates but a user should hear about
    source: str = ""  # where the facts come from
    lsb_tolerance: float | None = None  # a run this close to ONNX Runtime is accepted (None: not judged)
    domains: tuple[str, ...] = ()  # operator domains it runs besides the default ONNX one
    local_functions: bool = False  # runs ops a file defines as model-local functions (any domain)
    operators: tuple[str, ...] = ()  # single operators of domains not in ``domains`` it runs ("domain::Op")


@dataclass(frozen=True)
class FloatRule:
    """A weighted op the runtime runs faster (or only) in float: it stays float in an integer placement."""

    id: str
    why: str
    applies: Callable[[str, dict, tuple[int, ...]], bool]  # (op type, attributes, weight shape)


def wide_dtype(activation_dtype: str) -> str:
    """The 16-bit form of an activation type: uint16 beside uint8 (asymmetric), int16 beside int8."""
    return "uint16" if activation_dtype == "uint8" else "int16"


@dataclass(frozen=True, kw_only=True)
class Target(Preset):
    """A runtime, resolved: its ``Preset`` (what to quantize with, how to write the file) and the rest.

    Every function that takes ``target=`` turns a name into this object once (``targets.get``) and
    reads its fields from there on; nothing else in quantship compares a target's name.
    """

    consumer: str  # how the runtime calls itself
    file_rules: FileRules
    runner: str | None = None  # the ``inspect.run`` runner that runs a file here (None: not on this machine)
    runtime_is_onnxruntime: bool = False  # ONNX Runtime on this CPU: quantship's own timing and reference
    float_rules: tuple[FloatRule, ...] = ()  # weighted ops kept float in an integer placement
    float_output_ops: tuple[str, ...] = ()  # weighted ops whose integer kernel can write a float result
    requantize_before_relu: bool = False  # a Q/DQ pair before a Relu it cannot fold lets Conv/Gemm fuse
    has_hard_sigmoid: bool = True
    runs_lone_batch_norm: bool = True  # False: BatchNormalization runs only folded into a Conv
    spatial_mean_as_global_pool: bool = False  # a mean over H and W of NCHW written as GlobalAveragePool
    runs_written_out_layer_norm: bool = True  # False: a layer norm written out (Pow, Sqrt...) fused into one op
    max_slice_rank: int | None = None  # the highest input rank its Slice kernel reads (None: any)
    prelu_slower_than_written_out: bool = False
    hard_swish_faster_as_one_op: bool = False
    weight_only_form: str | None = None  # its own weight-only operator ("MatMulNBits"); None: none
    integer_recurrent_ops: tuple[str, ...] = ()  # recurrent ONNX ops it runs as integer kernels (others stay float)
    # it computes on 16-bit activations in integer kernels; False: it runs an op between 16-bit pairs in float (ONNX
    # Runtime's CPU), so 16 bits buy a unit nothing over float (``repairs_with_int16``)
    int16_kernels: bool = False
    # its optimizer quantizes the float weight of a Conv / ConvTranspose / Gemm read through a per-tensor
    # DequantizeLinear and written into a QuantizeLinear (``export.float_pairs.float_reads_per_axis`` keeps it float)
    quantizes_float_convs: bool = False

    @property
    def runs_integer_lstm(self) -> bool:
        """It has an integer LSTM kernel (ONNX Runtime's com.microsoft DynamicQuantizeLSTM)."""
        return "LSTM" in self.integer_recurrent_ops

    @property
    def name(self) -> str:
        return self.target

    @property
    def wide_activation_dtype(self) -> str:
        """The 16-bit form of the preset's activation type: uint16 beside uint8, int16 beside int8."""
        return wide_dtype(self.activation_dtype)

    @property
    def runs_int16(self) -> bool:
        """It accepts 16-bit activations of its preset's kind."""
        return self.wide_activation_dtype in self.file_rules.activation_dtypes

    @property
    def repairs_with_int16(self) -> bool:
        """The PyTorch path's fidelity repair tries a ranked unit in 16-bit activations before float only where the
        runtime computes on them in integer kernels. Where it runs an op between 16-bit pairs in float, a 16-bit value
        also takes its reader out of its 8-bit integer kernel, where a float unit costs one QuantizeLinear or
        DequantizeLinear at each edge (tests/quantize_onnx/test_int16_policy.py counts both in ONNX Runtime's
        optimized graph); float units were faster at the same budget there (docs/fidelity.md). The ONNX path's
        repair tries 16 bits wherever they run (``runs_int16``): measured, docs/fidelity.md."""
        return self.runs_int16 and self.int16_kernels

    def int16_refusal(self, flag: str) -> str | None:
        """Why ``flag`` (the caller's spelling of a 16-bit request) cannot be honoured here; None when it can."""
        if self.runs_int16:
            return None
        way_out = (f"drop {flag}, or keep those nodes in float with --exclude" if self.runs_mixed_graphs
                   else f"drop {flag} (it needs one integer type throughout)")
        return (f"{flag}: {self.consumer} (target {self.name}) does not run {self.wide_activation_dtype} activations "
                f"(it accepts {', '.join(self.file_rules.activation_dtypes)}); {way_out}")

    @property
    def runs_mixed_graphs(self) -> bool:
        """It runs float activations between integer ones (else every activation needs a Q/DQ pair)."""
        return "fully_quantized" not in self.file_rules.errors

    @property
    def runs_dynamic_activations(self) -> bool:
        """It has a run-time quantization kernel (else scales must be stored in the file)."""
        return "static_scales" not in self.file_rules.errors
