"""The torchao backend: weight-only INT8/INT4 and dynamic INT8 on Linear layers via ``quantize_``.

One config per method, applied to a deepcopy with ``torchao.quantization.quantize_``:

- ``int8_weight_only`` (W8A16): int8 weights per output channel or per group; a per-layer
  ``weight_bits`` dict (8 or 16) selects which Linear layers are quantized;
- ``int4_weight_only`` (W4A16): grouped int4 weights with ``IntxWeightOnlyConfig``, which has CPU
  kernels here (``Int4WeightOnlyConfig`` needs CUDA or mslk);
- ``int8_dynamic`` (W8A8): int8 weights, activation scales computed at run time.

Only ``nn.Linear`` layers are touched, and for the weight-only methods the token embedding table (a Hugging Face
model's ``get_input_embeddings()``) when ``quantize_embedding`` says so (``embedding_rule`` when it is None): with
the same config as the Linear weights, or, when the LM head is tied to it, the head's own quantized tensor (one
table, read by both). The result is checked to hold quantized weights.

``weight_algorithm='gptq'`` (int4 only): the codes and scales come from ``quantize.gptq`` on the
calibration batches; each is handed to torchao's ``IntxUnpackedToInt8Tensor.from_hp`` with GPTQ's
scales, and the integers torchao derives are checked to be GPTQ's, so the exported files hold them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from quantship.errors import DataRefused, ExportRefused, SpecRefused
from quantship.precision import FLOAT_BITS, QuantSpec, tag_model
from quantship.quantize import gptq


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` of the model, by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def selected_layers(model: nn.Module, spec: QuantSpec) -> list[str]:
    """Names of the Linear layers the spec quantizes; refuse names that are not Linear layers."""
    linears = linear_layers(model)
    if not linears:
        raise ValueError(
            f"backend='torchao' method={spec.method!r}: {type(model).__name__} has no nn.Linear layer, "
            "so nothing would be quantized (torchao's configs here apply to Linear weights). For "
            "convolutional models use backend='pt2e' (static W8A8) or an FX backend."
        )
    bits = dict(spec.layer_bits or ())
    unknown = [name for name in bits if name not in linears]
    if unknown:
        raise ValueError(
            f"weight_bits dict names {unknown}, which are not nn.Linear layers of "
            f"{type(model).__name__}; the torchao per-layer dict covers Linear layers only: "
            f"{sorted(linears)[:12]}"
        )
    chosen = [name for name in linears if bits.get(name, spec.weight_bits) != FLOAT_BITS]
    if not chosen:
        raise ValueError(
            f"weight_bits={dict(bits)} keeps every Linear layer float (16): nothing to quantize; "
            "give at least one layer 8"
        )
    return chosen


GROUP_SIZES = (128, 64, 32)  # tried in this order when no group size is given (CLI, auto_group_size)


def auto_group_size(model: nn.Module, names: list[str] | None = None) -> int | None:
    """The largest of 128/64/32 dividing the input features of every layer in ``names`` (default: every Linear)."""
    linears = linear_layers(model)
    widths = [linears[n].in_features for n in (names if names is not None else linears)]
    return next((g for g in GROUP_SIZES if widths and all(w % g == 0 for w in widths)), None)


def check_group_size(model: nn.Module, names: list[str], group_size: int | None) -> None:
    """Refuse a group size that does not divide a quantized layer's input features; name them all."""
    if group_size is None:
        return
    linears = linear_layers(model)
    bad = {n: linears[n].in_features for n in names if linears[n].in_features % group_size}
    if bad:
        fits = auto_group_size(model, names)
        hint = f"group_size={fits} divides every one" if fits else "no group of 128/64/32 divides them all"
        raise ValueError(
            f"group_size={group_size} does not divide the input features of {len(bad)} layer(s) {bad} ({hint}); "
            "choose a group size that divides every quantized layer's in_features, or leave those "
            "layers float with a weight_bits dict"
        )


def make_config(spec: QuantSpec) -> Any:
    """The torchao config that applies ``spec``."""
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup, PerRow

    if spec.method == "int8_weight_only":
        granularity = PerGroup(spec.group_size) if spec.qscheme == "per_group" else PerRow()
        return Int8WeightOnlyConfig(granularity=granularity)
    if spec.method == "int4_weight_only":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(spec.group_size or 128))
    if spec.method == "int8_dynamic":
        return Int8DynamicActivationInt8WeightConfig()
    raise ValueError(
        f"method={spec.method!r} is not a torchao method; valid: 'int8_weight_only', "
        "'int4_weight_only', 'int8_dynamic'"
    )


WEIGHT_ONLY = ("int8_weight_only", "int4_weight_only")


@dataclasses.dataclass(frozen=True)
class TokenEmbedding:
    """A model's token embedding: its qualified name, the module, and the LM head tied to it (None: untied)."""

    name: str
    module: nn.Embedding
    tied_head: str | None


def token_embedding(model: nn.Module) -> TokenEmbedding | None:
    """The token embedding of a Hugging Face model (itself, or the ``.lm`` of quantship's logits wrapper), from
    ``get_input_embeddings()``; the head is tied when ``get_output_embeddings()`` holds the same weight tensor."""
    for holder in (model, getattr(model, "lm", None)):
        get = getattr(holder, "get_input_embeddings", None)
        embedding = get() if callable(get) else None
        if not isinstance(embedding, nn.Embedding):
            continue
        names = {id(m): n for n, m in model.named_modules()}
        head = getattr(holder, "get_output_embeddings", lambda: None)()
        tied = isinstance(head, nn.Linear) and head.weight is embedding.weight and id(head) in names
        return TokenEmbedding(names[id(embedding)], embedding, names[id(head)] if tied else None)
    return None


def embedding_rule(spec: QuantSpec) -> bool:
    """Whether the token embedding is stored in the weights' bits when the request leaves it open: at 8 bits
    (which kept the reference LM's perplexity), not at 4 (which cost more than the project's INT4 budget); the
    figures: docs/decoder.md, "The token embedding"."""
    return spec.weight_bits == 8


def quantize_embedding(work: nn.Module, found: TokenEmbedding | None, spec: QuantSpec, quantized: list[str],
                       *, log: Callable[[str], None]) -> bool:
    """Store ``work``'s token embedding ``found`` (read before the Linear layers were quantized: that breaks the
    tie's identity) in the weights' bits when ``spec`` asks (None: ``embedding_rule``); whether it was. A tied
    embedding takes the LM head's quantized tensor, so the model holds (and a file stores) one table."""
    from torchao.quantization import quantize_

    asked = spec.quantize_embedding
    if found is None:
        if asked:
            raise SpecRefused(f"quantize_embedding=True: {type(work).__name__} has no token embedding "
                              "(get_input_embeddings() returns no nn.Embedding); drop quantize_embedding")
        return False
    wanted = embedding_rule(spec) if asked is None else asked
    if found.tied_head is not None and found.tied_head not in quantized:
        if asked:
            raise SpecRefused(f"quantize_embedding=True: the token embedding {found.name!r} is tied to the LM head "
                              f"{found.tied_head!r}, which stays float; quantize the head too, or drop "
                              "quantize_embedding")
        return False
    if not wanted:
        return False
    width = found.module.embedding_dim
    group = spec.group_size if spec.qscheme == "per_group" else None
    if group is not None and width % group:
        raise SpecRefused(f"quantize_embedding: group_size={group} does not divide the token embedding's width {width}; "
                          "choose a group size that divides it, or quantize_embedding=False")
    if found.tied_head is not None:
        found.module.weight = work.get_submodule(found.tied_head).weight  # one quantized table for both readers
        log(f"torchao: token embedding {found.name!r} reads the tied LM head's quantized table")
    else:
        log(f"torchao: token embedding {found.name!r} quantized as the Linear weights")
        quantize_(work, make_config(spec), filter_fn=lambda m, fqn: m is found.module)
    from torchao.utils import TorchAOBaseTensor

    if not isinstance(found.module.weight, TorchAOBaseTensor):
        raise ValueError(f"torchao {spec.method} left the token embedding {found.name!r} float; refusing a partial "
                         "result (quantize_embedding=False keeps it float)")
    return True


def quantized_layers(model: nn.Module) -> list[str]:
    """Linear layers whose weight is a torchao quantized tensor."""
    from torchao.utils import TorchAOBaseTensor

    return [n for n, m in linear_layers(model).items() if isinstance(m.weight, TorchAOBaseTensor)]


def quantize(model: nn.Module, spec: QuantSpec, batches: list[torch.Tensor] | None,
             *, log: Callable[[str], None], verbose: bool = False) -> nn.Module:
    """Backend entry point used by ``Quantizer``: a quantized copy of ``model`` (no calibration)."""
    from torchao.quantization import quantize_

    names = selected_layers(model, spec)
    if spec.qscheme == "per_group" and spec.group_size is None:  # a spec that leaves the choice to the model
        chosen = auto_group_size(model, names)
        if chosen is None:
            widths = sorted({linear_layers(model)[n].in_features for n in names})
            raise ValueError(f"no group size of 128/64/32 divides every quantized layer's input features {widths}; "
                             "give group_size explicitly")
        log(f"torchao: group_size={chosen}, the largest of 128/64/32 dividing every quantized layer")
        spec = dataclasses.replace(spec, group_size=chosen)
    group_size = spec.group_size if spec.qscheme == "per_group" else None
    check_group_size(model, names, group_size)
    work = copy.deepcopy(model).eval()
    embedding = token_embedding(work) if spec.method in WEIGHT_ONLY else None
    wanted = set(names)
    if spec.weight_algorithm == "gptq":
        apply_gptq(work, names, spec, batches, log=log)
    else:
        config = make_config(spec)
        log(f"torchao: {type(config).__name__} on {len(names)} Linear layer(s)")
        quantize_(work, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn in wanted)
    done = set(quantized_layers(work))
    if done != wanted:
        raise ValueError(
            f"torchao {spec.method} quantized {sorted(done)} but {sorted(wanted)} were asked; "
            "refusing a partial result"
        )
    if spec.method in WEIGHT_ONLY:
        spec = dataclasses.replace(spec, quantize_embedding=quantize_embedding(work, embedding, spec, names, log=log))
    return tag_model(work, spec)  # the spec as applied (a group size and the embedding's choice included)


def gptq_tensor(result: gptq.GptqWeight, dtype: torch.dtype) -> Any:
    """GPTQ's weight as torchao's int4 tensor, re-quantized by torchao with GPTQ's scales; refused unless
    torchao's integers, scales and dequantized weight are GPTQ's exactly."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    zero_point = torch.zeros_like(result.scale, dtype=torch.int8)
    tensor = IntxUnpackedToInt8Tensor.from_hp(
        result.dequantized.to(dtype), (1, result.group), torch.int4, intx_choose_qparams_algorithm=None,
        custom_scale=result.scale.clone(), custom_zero_point=zero_point)
    exact = (torch.equal(tensor.qdata, result.codes) and torch.equal(tensor.scale, result.scale)
             and torch.equal(tensor.dequantize(), result.dequantized.to(dtype)))
    if not exact:
        raise ExportRefused("gptq: torchao's int4 tensor does not reproduce GPTQ's integers and scales exactly; "
                          "refusing a file that would not hold the GPTQ weights")
    return tensor


def apply_gptq(work: nn.Module, names: list[str], spec: QuantSpec, batches: list[torch.Tensor] | None,
               *, log: Callable[[str], None]) -> None:
    """GPTQ on ``work``'s layers ``names`` (in place), each weight then stored as torchao's int4 tensor."""
    if spec.method != "int4_weight_only":
        raise SpecRefused(f"weight_algorithm='gptq' applies to method='int4_weight_only', not {spec.method!r}")
    if not batches:
        raise DataRefused("weight_algorithm='gptq' needs calibration batches: quantize(model, calibration_dl)")
    linears = linear_layers(work)
    results = gptq.quantize_layers(work, names, spec.group_size, batches, log=log)
    for name, result in results.items():
        layer = linears[name]
        layer.weight = nn.Parameter(gptq_tensor(result, layer.weight.dtype), requires_grad=False)
