"""The families of bench/zoo.py (torchvision, timm, hf, detection): which models, how each is built, its input;
and the timing hook that splits a model's quantize + export time into stages.

torchvision: its classification zoo (``list_models(module=torchvision.models)``, ``weights=None``). timm: the
architectures issue 29 tried, ``timm.create_model(name, pretrained=False, num_classes=10)``, when timm is
installed (the ones built for 224 px only built for 64 px where timm allows it: ``TIMM_SMALL_INPUT``). hf: transformers models from small configs (random weights, seed 0), each wrapped to return its main
tensor (``last_hidden_state`` or ``logits``). detection: the torchvision detectors issue 29 names
(``weights=None, weights_backbone=None``), through the same whole-model path (bench/detection.py, another
bench, quantizes their backbones and heads with the post-processing kept float).

Stages (``StageTimes``): the steps quantship marks (``quantship.progress``: capture, insert observers,
calibrating, convert, export, each export check), heard by a listener, plus the time spent inside the
histogram observers' range search (``HistogramSearchObserver._non_linear_param_search``, wrapped for the
run: the wrapper calls the method and adds its time; it changes nothing it returns).
"""

from __future__ import annotations

import collections
import importlib.util
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

FAMILIES = ("torchvision", "timm", "hf", "detection")
# issue 29's timm architectures, at their smallest variant; mobileone_s0 first (its histogram search was 349 s)
TIMM_MODELS = (
    "mobileone_s0", "resnet18d", "efficientnet_b0", "mobilenetv3_small_100", "mobilenetv4_conv_small",
    "convnext_atto", "regnetz_b16", "repvgg_a0", "hrnet_w18_small", "dla34", "cspdarknet53", "ghostnet_100",
    "rexnet_100", "mobilevit_xxs", "efficientformer_l1", "levit_128s", "fastvit_t8", "edgenext_xx_small",
    "poolformer_s12", "mixer_s16_224", "pvt_v2_b0", "tiny_vit_5m_224", "coatnet_nano_rw_224",
    "eva02_tiny_patch14_224", "gcvit_xxtiny", "swin_tiny_patch4_window7_224", "deit_tiny_patch16_224",
    "vit_tiny_patch16_224",
)
# the models built for one input size (224): built for a smaller one instead, (create_model arguments, size).
# The same blocks and weights shapes, fewer tokens; swin's window shrinks with the image (7 -> 4: 16x16 tokens
# at 64 px); eva02's patch stays 14 (5x5 patches at 70 px). efficientformer_l1 keeps 224: its attention bias
# table is sized for the 7x7 last stage whatever img_size says.
TIMM_SMALL_INPUT = {
    "levit_128s": (dict(img_size=64), 64),
    "mixer_s16_224": (dict(img_size=64), 64),
    "coatnet_nano_rw_224": (dict(img_size=64), 64),
    "eva02_tiny_patch14_224": (dict(img_size=70), 70),
    "gcvit_xxtiny": (dict(img_size=64), 64),
    "swin_tiny_patch4_window7_224": (dict(img_size=64, window_size=4), 64),
    "deit_tiny_patch16_224": (dict(img_size=64), 64),
    "vit_tiny_patch16_224": (dict(img_size=64), 64),
}
DETECTION_MODELS = ("ssdlite320_mobilenet_v3_large", "fasterrcnn_mobilenet_v3_large_320_fpn",
                    "retinanet_resnet50_fpn_v2", "fcos_resnet50_fpn")
VOCAB, SEQ = 128, 16
STAGES = ("capture", "prepare", "calibrate", "convert", "histogram search", "export", "checks")


@dataclass(frozen=True)
class Entry:
    """One model of a family: its builder and its calibration / sample input (None: the smallest square image)."""

    name: str
    build: Callable[[], torch.nn.Module]
    make_input: Callable[[torch.Generator], torch.Tensor] | None = None
    size: int | None = None  # the square image the model was built for (None: the smallest it accepts)


class Main(torch.nn.Module):
    """A transformers model returning only its main tensor."""

    def __init__(self, model: torch.nn.Module, key: str):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):
        return self.model(x)[self.key]


def _ids(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=gen)


def _shape(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda gen: torch.randn(*shape, generator=gen)


def _hf_entries() -> list[Entry]:
    import transformers as t

    text = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                max_position_embeddings=40)
    decoder = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)

    def hf(name, build, key, make_input=_ids):
        def built():
            torch.manual_seed(0)
            return Main(build(), key).eval()
        return Entry(name, built, make_input)

    return [
        hf("bert", lambda: t.BertModel(t.BertConfig(**text)), "last_hidden_state"),
        hf("distilbert", lambda: t.DistilBertModel(t.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=2,
                                                                      hidden_dim=128)), "last_hidden_state"),
        hf("roberta", lambda: t.RobertaModel(t.RobertaConfig(**text)), "last_hidden_state"),
        hf("deberta_v2", lambda: t.DebertaV2Model(t.DebertaV2Config(**text)), "last_hidden_state"),
        hf("t5_encoder", lambda: t.T5EncoderModel(t.T5Config(vocab_size=VOCAB, d_model=64, d_kv=32, d_ff=128,
                                                             num_layers=2, num_heads=2)), "last_hidden_state"),
        hf("whisper_encoder", lambda: t.models.whisper.modeling_whisper.WhisperEncoder(t.WhisperConfig(
            d_model=64, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=16, vocab_size=VOCAB,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
            begin_suppress_tokens=None)), "last_hidden_state", _shape(1, 16, 32)),
        hf("wav2vec2", lambda: t.Wav2Vec2Model(t.Wav2Vec2Config(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, conv_dim=(32, 32),
            conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)),
            "last_hidden_state", _shape(1, 1600)),
        hf("clip_vision", lambda: t.CLIPVisionModel(t.CLIPVisionConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=8)), "last_hidden_state", _shape(1, 3, 32, 32)),
        hf("segformer", lambda: t.SegformerForSemanticSegmentation(t.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
            strides=[4, 2], patch_sizes=[7, 3], mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=4)),
            "logits", _shape(1, 3, 64, 64)),
        hf("mobilevit", lambda: t.MobileViTForImageClassification(t.MobileViTConfig(
            image_size=64, hidden_sizes=[32, 40, 48], neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 96],
            num_attention_heads=2, num_labels=10)), "logits", _shape(1, 3, 64, 64)),
        hf("gpt2", lambda: t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_inner=128, n_positions=32,
                                                          **decoder)), "logits"),
        hf("llama", lambda: t.LlamaForCausalLM(t.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=32, **decoder)), "logits"),
    ]


def available(family: str) -> str | None:
    """Why ``family`` cannot run here (None: it can)."""
    needs = {"timm": "timm", "hf": "transformers"}.get(family)
    if needs and importlib.util.find_spec(needs) is None:
        return f"{needs} is not installed in this environment (pip install {needs})"
    return None


def entries(family: str) -> list[Entry]:
    """The models of ``family``, in table order (names only are needed for an unavailable family)."""
    import torchvision

    if family == "torchvision":
        return [Entry(m, lambda m=m: torchvision.models.get_model(m, weights=None).eval())
                for m in torchvision.models.list_models(module=torchvision.models)]
    if family == "detection":
        return [Entry(m, lambda m=m: torchvision.models.get_model(m, weights=None, weights_backbone=None).eval())
                for m in DETECTION_MODELS]
    if family == "timm":
        def timm_model(name: str) -> torch.nn.Module:
            import timm

            kwargs = TIMM_SMALL_INPUT.get(name, ({}, None))[0]
            return timm.create_model(name, pretrained=False, num_classes=10, **kwargs).eval()
        return [Entry(m, lambda m=m: timm_model(m), size=TIMM_SMALL_INPUT.get(m, ({}, None))[1]) for m in TIMM_MODELS]
    if family == "hf":
        return _hf_entries() if available("hf") is None else []
    raise ValueError(f"family {family!r}: not one of {FAMILIES}")


class StageTimes:
    """Seconds per stage of one quantize + export, from quantship's marked steps (the histogram search among them,
    inside convert)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def listener(self, event: str, current) -> None:
        from quantship.progress import END

        if event != END or current.seconds is None:
            return
        label = current.label
        stage = ("capture" if label.startswith("quantize: capture") else
                 "prepare" if label.startswith("quantize: insert observers") else
                 "calibrate" if label.startswith("quantize: calibrating") else
                 "convert" if label.startswith("quantize: convert") else
                 "histogram search" if label.startswith("quantize: histogram range search") else
                 "checks" if label.startswith("export check:") else
                 "export" if label.startswith("export:") else "other")
        self.seconds[stage] += current.seconds

    @contextmanager
    def hooked(self):
        """Listen to the marked steps, for the block."""
        from quantship.progress import listening

        with listening(self.listener):
            yield self

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.seconds.items()}
