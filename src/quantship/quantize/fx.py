"""The FX backends (x86, fbgemm, onednn, qnnpack): static and dynamic INT8 through quantize_fx.

``torch.ao.quantization.quantize_fx`` is deprecated upstream but present in the pinned torch; it
gives each backend's own default qconfig mapping (affine observers, uint8 activations). The work
runs under ``torch.backends.quantized.engine = spec.engine`` and the previous engine is restored.
The result is checked to hold quantized modules: a float model under an INT8 label is an error.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.fx import GraphModule

from quantship.errors import SpecRefused, cause
from quantship.precision import FLOAT_BITS, QuantSpec
from quantship.quantize.calibration import run_batches

# layer types dynamic quantization rewrites (weights int8, activation scales computed per call)
DYNAMIC_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.LSTM, nn.GRU, nn.LSTMCell, nn.GRUCell, nn.RNNCell,
)
# module namespaces that hold quantized (static or dynamic) modules after convert_fx
_QUANTIZED_NAMESPACES = ("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized")
# upstream noise we silence around our own calls (one line of our own replaces the first)
_UPSTREAM_NOISE = (
    r"torch\.ao\.quantization is deprecated",
    r".*reduce_range will be deprecated",
    r".*quantized tensor creation functions",
    r"To copy construct from a tensor",
)
_deprecation_said = False


def say_fx_is_deprecated() -> None:
    """Tell the user once per process that FX graph-mode quantization is deprecated upstream."""
    global _deprecation_said
    if not _deprecation_said:
        _deprecation_said = True
        warnings.warn(
            "quantship: the FX backends use torch.ao.quantization.quantize_fx, deprecated upstream "
            "(it still works on this torch); for an exportable INT8 file use backend='pt2e'",
            UserWarning,
            stacklevel=2,
        )


@contextlib.contextmanager
def quiet_fx() -> Iterator[None]:
    """Silence the upstream deprecation/observer warnings raised inside quantize_fx calls."""
    say_fx_is_deprecated()
    with warnings.catch_warnings():
        for pattern in _UPSTREAM_NOISE:
            warnings.filterwarnings("ignore", message=pattern)
        yield


@contextlib.contextmanager
def quantized_engine(engine: str | None) -> Iterator[None]:
    """Run under ``torch.backends.quantized.engine = engine``; restore the previous engine."""
    if engine is None:
        raise ValueError("an FX spec needs spec.engine (x86, fbgemm, onednn or qnnpack); got None")
    supported = list(torch.backends.quantized.supported_engines)
    if engine not in supported:
        raise ValueError(
            f"engine={engine!r} is not available in this torch build; supported engines: {supported}. "
            "Pick a backend from that list, or backend='pt2e' (engine-independent)."
        )
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def check_layer_names(model: nn.Module, spec: QuantSpec) -> None:
    """Refuse ``weight_bits`` dict names that are not modules of the model."""
    if not spec.layer_bits:
        return
    known = {name for name, _ in model.named_modules() if name}
    unknown = [name for name, _ in spec.layer_bits if name not in known]
    if unknown:
        leaves = [n for n, m in model.named_modules() if n and not list(m.children())][:12]
        raise ValueError(
            f"weight_bits dict names {unknown}, which are not modules of {type(model).__name__}; "
            f"use names from model.named_modules(), e.g. {leaves}"
        )


def float_layers(spec: QuantSpec) -> list[str]:
    """Layer names the spec keeps in floating point (weight_bits 16)."""
    return [name for name, bits in spec.layer_bits or () if bits == FLOAT_BITS]


def _per_tensor_qconfig(qconfig: Any, qat: bool) -> Any:
    """The backend's qconfig with per-tensor weights (same activation observer)."""
    from torch.ao.quantization import QConfig
    from torch.ao.quantization.fake_quantize import default_weight_fake_quant
    from torch.ao.quantization.observer import default_weight_observer

    weight = default_weight_fake_quant if qat else default_weight_observer
    return QConfig(activation=qconfig.activation, weight=weight)


def qconfig_mapping(spec: QuantSpec, *, qat: bool = False) -> Any:
    """The backend's default (QAT) qconfig mapping, adjusted for qscheme and float layers."""
    from torch.ao.quantization import get_default_qat_qconfig_mapping, get_default_qconfig_mapping

    build = get_default_qat_qconfig_mapping if qat else get_default_qconfig_mapping
    mapping = build(spec.engine)
    per_channel_default = spec.engine != "qnnpack"
    if spec.qscheme == "per_tensor" and per_channel_default:
        mapping.set_global(_per_tensor_qconfig(mapping.global_qconfig, qat))
    for name in float_layers(spec):
        mapping.set_module_name(name, None)
    return mapping


def dynamic_qconfig_mapping(spec: QuantSpec) -> Any:
    """Int8 weights, activation scales computed per call, for the layer types that support it."""
    from torch.ao.quantization import QConfigMapping
    from torch.ao.quantization.qconfig import default_dynamic_qconfig, per_channel_dynamic_qconfig

    qconfig = per_channel_dynamic_qconfig if spec.qscheme == "per_channel" else default_dynamic_qconfig
    mapping = QConfigMapping()
    for kind in DYNAMIC_TYPES:
        mapping.set_object_type(kind, qconfig)
    for name in float_layers(spec):
        mapping.set_module_name(name, None)
    return mapping


def quantized_modules(model: nn.Module) -> list[str]:
    """Names of the quantized (static or dynamic) modules in a converted model."""
    names: list[str] = []
    for name, m in model.named_modules():  # parents come first: keep the outermost only
        if any(name.startswith(n + ".") for n in names):
            continue  # packed-parameter children of a quantized module
        if type(m).__module__.startswith(_QUANTIZED_NAMESPACES):
            names.append(name)
    return names


def check_converted(model: nn.Module, spec: QuantSpec) -> list[str]:
    """Refuse a conversion that left no quantized module, or quantized a layer kept float."""
    names = quantized_modules(model)
    if not names:
        raise ValueError(
            f"FX {spec.method} conversion with backend={spec.backend!r} produced no quantized module: "
            f"the result would be a float model under a {spec.label} label. The model needs conv or "
            "linear layers FX can trace (use backend='pt2e' for models FX cannot symbolically trace)"
        )
    kept = set(float_layers(spec))
    leaked = [n for n in names if n in kept]
    if leaked:
        raise ValueError(f"layers {leaked} were asked to stay float (weight_bits 16) but were quantized")
    return names


def _first_input(batches: list[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
    if not batches:
        raise ValueError("FX static quantization needs calibration batches; got none")
    return (batches[0],)


def _trace(step: Callable[[], GraphModule], spec: QuantSpec, model: nn.Module) -> GraphModule:
    """Run an FX prepare step; name the failure when symbolic tracing cannot follow the model."""
    try:
        return step()
    except (torch.fx.proxy.TraceError, TypeError, NotImplementedError) as exc:
        raise SpecRefused(
            f"backend={spec.backend!r} could not trace {type(model).__name__} with torch.fx "
            f"({cause(exc)}). FX needs a symbolically traceable forward: remove "
            "data-dependent control flow, or use backend='pt2e' (torch.export)."
        ) from exc


def quantize_static(model: nn.Module, spec: QuantSpec, batches: list[torch.Tensor],
                    *, log: Callable[[str], None], verbose: bool = False) -> GraphModule:
    """Post-training static INT8: observers calibrated on ``batches``, then convert_fx."""
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    example = _first_input(batches)
    work = copy.deepcopy(model).eval()
    with quiet_fx(), quantized_engine(spec.engine):
        mapping = qconfig_mapping(spec)
        log(f"{spec.backend}: preparing with the default qconfig mapping (FX, engine {spec.engine!r})")
        prepared = _trace(lambda: prepare_fx(work, mapping, example), spec, model)
        n = sum(b.shape[0] for b in batches)
        log(f"{spec.backend}: calibrating on {n} sample(s) in {len(batches)} batch(es)")
        run_batches(prepared, batches, verbose=verbose)
        converted = convert_fx(prepared)
    names = check_converted(converted, spec)
    log(f"{spec.backend}: {len(names)} quantized module(s)")
    return converted


def quantize_dynamic(model: nn.Module, spec: QuantSpec, *, log: Callable[[str], None]) -> GraphModule:
    """Dynamic INT8: int8 weights for Linear/RNN layers, activation scales computed per call."""
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    kept = set(float_layers(spec))
    candidates = [n for n, m in model.named_modules() if isinstance(m, DYNAMIC_TYPES) and n not in kept]
    if not candidates:
        kinds = ", ".join(t.__name__ for t in DYNAMIC_TYPES)
        raise ValueError(
            f"method='dynamic' with backend={spec.backend!r}: {type(model).__name__} has no layer "
            f"dynamic quantization rewrites ({kinds}), so nothing would be quantized. Use "
            "method='static' with calibration data for convolutional models."
        )
    work = copy.deepcopy(model).eval()
    example = (torch.zeros(1),)  # dynamic prepare records no shapes; any input will do
    with quiet_fx(), quantized_engine(spec.engine):
        mapping = dynamic_qconfig_mapping(spec)
        log(f"{spec.backend}: dynamic quantization of {len(candidates)} layer(s) (FX, engine {spec.engine!r})")
        prepared = _trace(lambda: prepare_fx(work, mapping, example), spec, model)
        converted = convert_fx(prepared)
    check_converted(converted, spec)
    return converted


def quantize(model: nn.Module, spec: QuantSpec, batches: list[torch.Tensor] | None,
             *, log: Callable[[str], None], verbose: bool = False) -> GraphModule:
    """Backend entry point used by ``Quantizer`` (static or dynamic)."""
    check_layer_names(model, spec)
    if spec.method == "static":
        return quantize_static(model, spec, batches or [], log=log, verbose=verbose)
    if spec.method == "dynamic":
        return quantize_dynamic(model, spec, log=log)
    raise ValueError(
        f"method={spec.method!r} is not applied by quantize() for backend={spec.backend!r}; "
        "'qat' trains inside a fit: use quantship.QuantizeCallback"
    )
