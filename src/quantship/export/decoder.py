"""Decoder files for generation: a causal LM with its key/value cache as inputs and outputs, any batch and length.

The layout is the one onnxruntime-genai's ``decoder`` section names (genai_config.json):

- inputs ``input_ids`` int64 [batch, sequence_length], ``attention_mask`` int64 [batch, total_sequence_length]
  (1 for a token, 0 for left padding; total = past + new), ``past_key_values.N.key`` / ``.value`` float32
  [batch, kv_heads, past_sequence_length, head_dim] for each layer N (past_sequence_length 0 at the prefill);
- outputs ``logits`` float32 [batch, sequence_length, vocab] and ``present.N.key`` / ``.value``
  [batch, kv_heads, total_sequence_length, head_dim].

Positions are computed in the graph from the mask (count of ones so far, minus one), so the file takes no
``position_ids``. A float model is exported as it is; a torchao weight-only model goes through
``export.weight_only``'s machinery: its float twin is exported with the cache, then each weight is stored
as integers (DequantizeLinear, proven byte-identical in ONNX Runtime, or MatMulNBits, checked close).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantship.errors import ExportRefused, ModelRefused
from quantship.export import artifact, capture
from quantship.export import weight_only as wo
from quantship.export.checks import check_model, check_runs_optimized
from quantship.export.metadata import strip_source_metadata, write_metadata
from quantship.precision import QuantSpec
from quantship.targets import Target

INPUT_IDS, ATTENTION_MASK, LOGITS = "input_ids", "attention_mask", "logits"
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"
LAYOUT_KEY = "quantship.decoder_layout"  # file metadata: the DecoderLayout as JSON
GENAI_CONFIG = "genai_config.json"
_TRACE = (2, 5, 3)  # batch, new tokens, past tokens of the traced sample: none of them 0 or 1 (export specialises those)


@dataclass(frozen=True)
class DecoderLayout:
    """What a runtime needs to drive the file: layer count, cache shape, vocabulary, longest context."""

    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    context: int  # the longest total sequence (past + new) the model takes

    def as_dict(self) -> dict:
        return asdict(self)

    def input_names(self) -> list[str]:
        return [INPUT_IDS, ATTENTION_MASK] + [n % i for i in range(self.layers) for n in (PAST_KEY, PAST_VALUE)]

    def output_names(self) -> list[str]:
        return [LOGITS] + [n % i for i in range(self.layers) for n in (PRESENT_KEY, PRESENT_VALUE)]


def causal_lm_of(model: Any) -> Any:
    """The Hugging Face causal LM inside ``model`` (itself, or the ``.lm`` of quantship's logits wrapper)."""
    lm = getattr(model, "lm", model)
    can_generate = getattr(lm, "can_generate", None)
    if getattr(lm, "config", None) is None or not callable(can_generate) or not can_generate():
        raise ModelRefused(f"{type(lm).__name__} is not a Hugging Face causal language model (no generation head): "
                           "a decoder file needs a *ForCausalLM / *LMHeadModel, e.g. hf:config.json of a Llama, "
                           "GPT-2 or Qwen2 config")
    return lm


def layout_of(model: Any, context: int | None = None) -> DecoderLayout:
    """The decoder layout of ``model``; ``context`` (default: the model's position limit) is refused above it."""
    lm = causal_lm_of(model)
    config = lm.config.get_text_config(decoder=True)
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        raise ModelRefused(f"{type(lm).__name__}'s config states no max_position_embeddings: the longest context "
                           "the file may take is unknown")
    if context is not None and not 1 <= context <= int(limit):
        raise ModelRefused(f"--context {context}: {type(lm).__name__} takes at most {limit} positions "
                           f"(max_position_embeddings); give a context from 1 to {limit}")
    return DecoderLayout(
        model_type=str(config.model_type), layers=int(config.num_hidden_layers), heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads), hidden=hidden,
        vocab=int(config.vocab_size), context=int(context or limit))


def cached_decoder(model: Any) -> Any:
    """``model`` as a module with the file's signature: (input_ids, attention_mask, *past) -> (logits, *present)."""
    import torch
    from transformers import DynamicCache

    lm = causal_lm_of(model)
    layers = layout_of(lm).layers

    class CachedDecoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask, *past):
            cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(layers)])
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                          past_key_values=cache, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return CachedDecoder().eval()


def probe_cache(model: Any, layout: DecoderLayout) -> None:
    """Run the torch model once with a cache as the file will: refused if it returns no cache of the layout's shape."""
    import torch

    batch, new, past = _TRACE
    name = type(causal_lm_of(model)).__name__
    try:
        with torch.no_grad():
            out = cached_decoder(model)(*trace_sample(layout))
    except Exception as exc:  # the model's own code: any failure means it cannot run with a cache
        raise ModelRefused(f"{name} does not run with a key/value cache ({type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0][:200]}): it cannot be a decoder file") from None
    expected = (batch, layout.kv_heads, past + new, layout.head_dim)
    shapes = [tuple(t.shape) for t in out[1:]]
    if len(shapes) != 2 * layout.layers or any(s != expected for s in shapes):
        raise ModelRefused(f"{name} returns a key/value cache of shapes {sorted(set(shapes))[:2]}, not {expected} "
                           f"per layer: its attention is not a decoder's with a cache")


def trace_sample(layout: DecoderLayout, batch: int = _TRACE[0], new: int = _TRACE[1], past: int = _TRACE[2],
                 seed: int = 0) -> tuple:
    """Token ids, a mask with left padding in the first row, and random past keys/values, as torch tensors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, layout.vocab, (batch, new), generator=g)
    mask = torch.ones(batch, past + new, dtype=torch.long)
    mask[0, :1] = 0
    cache = [torch.randn(batch, layout.kv_heads, past, layout.head_dim, generator=g) for _ in range(2 * layout.layers)]
    return (ids, mask, *cache)


def prefill_feed(ids: np.ndarray, layout: DecoderLayout) -> dict[str, np.ndarray]:
    """The file's feed for a prefill of token ids [batch, tokens] from an empty cache: every token attended,
    each past key/value of length 0 (calibration windows, a perplexity window)."""
    ids = np.asarray(ids, dtype=np.int64)
    empty = np.zeros((len(ids), layout.kv_heads, 0, layout.head_dim), np.float32)
    return {INPUT_IDS: ids, ATTENTION_MASK: np.ones_like(ids),
            **{name % i: empty for i in range(layout.layers) for name in (PAST_KEY, PAST_VALUE)}}


def _dynamo_export(decoder: Any, layout: DecoderLayout) -> onnx.ModelProto:
    import warnings

    import torch

    batch, new = torch.export.Dim("batch"), torch.export.Dim("sequence_length")
    past, total = torch.export.Dim("past_sequence_length"), torch.export.Dim("total_sequence_length")
    shapes = ({0: batch, 1: new}, {0: batch, 1: total}, tuple({0: batch, 2: past} for _ in range(2 * layout.layers)))
    with warnings.catch_warnings(), capture.one_registry():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(decoder, trace_sample(layout), None, dynamo=True, verbose=False,
                                    opset_version=capture.EXPORTER_OPSET, dynamic_shapes=shapes,
                                    input_names=layout.input_names(), output_names=layout.output_names())
    proto = program.model_proto
    for value in proto.graph.output[1:]:  # "past_sequence_length + sequence_length": the name the mask's axis has
        dim = value.type.tensor_type.shape.dim[2]
        if dim.dim_param:
            dim.dim_param = "total_sequence_length"
    return proto


def _torch_outputs(decoder: Any, sample: tuple) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        return [t.detach().float().numpy() for t in decoder(*sample)]


def holds_quantized_weights(model: Any) -> bool:
    """Whether any parameter of ``model`` is a torchao tensor (a weight-only model), rather than plain float."""
    from torchao.utils import TorchAOBaseTensor

    return any(isinstance(p, TorchAOBaseTensor) for p in model.parameters())


def export_decoder(
    model: Any,
    path: str | Path,
    *,
    spec: QuantSpec | None = None,
    target: Target | None = None,
    context: int | None = None,
    accuracy_level: int | None = None,
) -> Path:
    """Write ``model`` (a float or torchao weight-only causal LM) at ``path`` as a decoder file with a KV cache.

    A weight-only model is written in the standard DequantizeLinear form, or with ``target`` (whose weight-only
    form is MatMulNBits) as com.microsoft MatMulNBits; ``accuracy_level`` is written on those nodes.
    Refusals raise ``ValueError`` subclasses and leave nothing at ``path``.
    """
    artifact.refuse_unsafe_destination(path)
    layout = layout_of(model, context)
    weights = wo.read_weights(model) if holds_quantized_weights(model) or wo.is_weight_only(spec) else None
    wo.check_targets(target)
    if target is not None and weights is None:
        raise ExportRefused("export_decoder: target= writes MatMulNBits, which needs a torchao weight-only model")
    if accuracy_level is not None and target is None:
        raise ExportRefused("export_decoder: accuracy_level applies to MatMulNBits nodes (give target='onnxruntime-cpu')")
    if target is not None:
        for w in weights:
            wo.nbits_block(w)
    probe_cache(model, layout)
    reference_decoder = cached_decoder(model)
    sample = trace_sample(layout)
    inputs = [t.numpy() for t in sample]
    names = layout.output_names()
    torch_out = _torch_outputs(reference_decoder, sample)
    twin = wo.float_twin(model, weights) if weights else model
    with artifact.atomic_destination(path) as staged:
        try:
            produced = _dynamo_export(cached_decoder(twin), layout)
        except Exception as exc:  # the exporter raises many types; name the step and keep the cause
            raise ExportRefused(f"the dynamo ONNX exporter failed on {type(causal_lm_of(model)).__name__} with a "
                                f"key/value cache: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}") from exc
        reference = wo.run_literal(produced, inputs)
        wo.check_close(reference, torch_out, "the float export", "the torch model", names)
        fmt = "float"
        final = ir.from_proto(produced)
        if weights:
            standard = ir.from_proto(produced)
            wo.to_dequantize_linear(standard, wo.locate(standard, weights))
            standard_proto = ir.to_proto(standard)
            check_model(standard_proto, "storing the weights as integers with DequantizeLinear")
            got = wo.run_literal(standard_proto, inputs)
            for name, g, r in zip(names, got, reference):
                if g.tobytes() != r.tobytes():
                    raise ExportRefused(f"storing the weights as integers with DequantizeLinear: output {name} is not "
                                        "byte-identical to the float export; refused")
            final, fmt = standard, "DequantizeLinear"
            if target is not None:
                final, fmt = ir.from_proto(produced), "MatMulNBits"
                wo.to_matmul_nbits(final, wo.locate(final, weights))
                if accuracy_level is not None:
                    wo.set_accuracy_level(final, accuracy_level)
                proto = ir.to_proto(final)
                check_model(proto, "replacing MatMul/Gemm by MatMulNBits")
                if accuracy_level in (None, 0):  # float activations: as close as the standard form
                    wo.check_close(wo.run_literal(proto, inputs), torch_out, "the MatMulNBits form", "the torch model", names)
        strip_source_metadata(final)
        if spec is not None:
            write_metadata(final, spec, activation_dtype="float32", target=target.target if target else None)
        final.metadata_props[wo.FORMAT_KEY] = fmt
        final.metadata_props[LAYOUT_KEY] = json.dumps(layout.as_dict(), sort_keys=True)
        artifact.save_model(ir.to_proto(final), staged)
        if weights:
            wo.check_written(staged, weights, fmt)
        check_runs_optimized(staged, inputs, "the written file")
    return Path(path).expanduser().resolve()


def read_layout(path: str | Path) -> DecoderLayout:
    """The layout a decoder file states in its metadata; refused for a file this module did not write."""
    model = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    if LAYOUT_KEY not in props:
        raise ExportRefused(f"{path} states no {LAYOUT_KEY}: it is not a decoder file written by quantship")
    return DecoderLayout(**json.loads(props[LAYOUT_KEY]))


def genai_config(layout: DecoderLayout, filename: str, *, eos_token_id: int | None = None,
                 pad_token_id: int = 0, max_length: int | None = None) -> dict:
    """onnxruntime-genai's genai_config.json for the file: its decoder section and greedy search."""
    eos = pad_token_id if eos_token_id is None else eos_token_id  # genai needs one inside the vocabulary
    return {
        "model": {
            "type": layout.model_type, "context_length": layout.context, "vocab_size": layout.vocab,
            "bos_token_id": pad_token_id, "eos_token_id": eos, "pad_token_id": pad_token_id,
            "decoder": {
                "filename": filename, "session_options": {"log_id": "quantship", "provider_options": []},
                "head_size": layout.head_dim, "hidden_size": layout.hidden,
                "num_attention_heads": layout.heads, "num_key_value_heads": layout.kv_heads,
                "num_hidden_layers": layout.layers,
                "inputs": {"input_ids": INPUT_IDS, "attention_mask": ATTENTION_MASK,
                           "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE},
                "outputs": {"logits": LOGITS, "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE},
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "max_length": max_length or layout.context,
                   "min_length": 0, "past_present_share_buffer": False, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0, "num_return_sequences": 1,
                   "early_stopping": True, "length_penalty": 1.0, "no_repeat_ngram_size": 0,
                   "diversity_penalty": 0.0},
    }


def write_genai_config(path: str | Path, **kwargs: Any) -> Path:
    """Write genai_config.json beside the decoder file at ``path`` (atomically), so the folder is what
    onnxruntime-genai loads."""
    import os

    model_path = Path(path).expanduser().resolve()
    config = genai_config(read_layout(model_path), model_path.name, **kwargs)
    out = model_path.parent / GENAI_CONFIG
    tmp = out.with_name(f".{GENAI_CONFIG}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out)
    return out
