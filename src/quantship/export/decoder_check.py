"""The generation check of a decoder file: greedy decoding in ONNX Runtime against the torch model's own.

ONNX Runtime side: one prefill of the left-padded prompts with an empty cache, then one token at a time,
each step feeding the previous step's ``present.*`` as ``past_key_values.*``. Torch side: Hugging Face's
``generate`` (greedy) on the same prompts, with the model the file was made from (the torchao weight-only
model for a weight-only file). Either the token sequences are equal, or the first divergence is reported
with the torch model's logit margin there (its top logit minus the logit of the token ONNX Runtime chose):
a margin near 0 is a near-tie that any rounding may flip.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from quantship.errors import DataRefused
from quantship.export.decoder import (
    ATTENTION_MASK,
    INPUT_IDS,
    PAST_KEY,
    PAST_VALUE,
    DecoderLayout,
    causal_lm_of,
    read_layout,
)

PAD_ID = 0  # left padding: masked out, its value never read


@dataclass(frozen=True)
class Divergence:
    row: int
    step: int  # index of the generated token (0 = first new token)
    onnx_token: int
    torch_token: int
    torch_margin: float  # torch's top logit minus its logit for onnx_token, at that step


@dataclass(frozen=True)
class GreedyCheck:
    onnx_tokens: list[list[int]]
    torch_tokens: list[list[int]]
    divergence: Divergence | None

    @property
    def matches(self) -> bool:
        return self.divergence is None

    def as_dict(self) -> dict:
        d = self.divergence
        return {"version": 1, "matches": self.matches, "new_tokens": len(self.onnx_tokens[0]),
                "rows": len(self.onnx_tokens),
                "divergence": None if d is None else {"row": d.row, "step": d.step, "onnx_token": d.onnx_token,
                                                      "torch_token": d.torch_token, "torch_margin": d.torch_margin}}


def left_padded(prompts: list[list[int]], layout: DecoderLayout, new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int64 [rows, longest], prompts right-aligned; refuses what the model cannot take."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DataRefused("the generation check needs at least one non-empty prompt")
    longest = max(len(p) for p in prompts)
    if longest + new_tokens > layout.context:
        raise DataRefused(f"a prompt of {longest} tokens plus {new_tokens} new ones exceeds the file's context of "
                          f"{layout.context} positions; shorten the prompt or generate fewer tokens")
    if any(not 0 <= t < layout.vocab for p in prompts for t in p):
        raise DataRefused(f"a prompt holds a token id outside the vocabulary [0, {layout.vocab})")
    ids = np.full((len(prompts), longest), PAD_ID, np.int64)
    mask = np.zeros((len(prompts), longest), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = prompt
        mask[row, longest - len(prompt):] = 1
    return ids, mask


def onnx_session(path: str | Path, *, threads: int = 1, options: dict[str, str] | None = None) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    for key, value in (options or {}).items():
        so.add_session_config_entry(key, value)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def empty_cache(layout: DecoderLayout, rows: int) -> dict[str, np.ndarray]:
    empty = np.zeros((rows, layout.kv_heads, 0, layout.head_dim), np.float32)
    return {name % i: empty for i in range(layout.layers) for name in (PAST_KEY, PAST_VALUE)}


def onnx_greedy(session: Any, layout: DecoderLayout, ids: np.ndarray, mask: np.ndarray,
                new_tokens: int) -> np.ndarray:
    """Greedy tokens [rows, new_tokens] from the file: prefill, then one token per step through the cache."""
    past = empty_cache(layout, len(ids))
    past_names = list(past)
    feed_ids, out = ids, []
    for _ in range(new_tokens):
        results = session.run(None, {INPUT_IDS: feed_ids, ATTENTION_MASK: mask, **past})
        token = results[0][:, -1].argmax(-1).astype(np.int64)
        out.append(token)
        past = dict(zip(past_names, results[1:]))
        feed_ids = token[:, None]
        mask = np.concatenate([mask, np.ones((len(ids), 1), np.int64)], axis=1)
    return np.stack(out, axis=1)


def torch_greedy(model: Any, ids: np.ndarray, mask: np.ndarray, new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [rows, new_tokens], logits [rows, new_tokens, vocab]) from Hugging Face's greedy ``generate``."""
    import copy

    import torch

    lm = causal_lm_of(model)
    config = copy.deepcopy(lm.generation_config)
    config.update(do_sample=False, num_beams=1, max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None,
                  pad_token_id=PAD_ID, bos_token_id=None, temperature=None, top_p=None, top_k=None,
                  output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = lm.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                          generation_config=config)
    tokens = out.sequences[:, ids.shape[1]:].numpy()
    logits = torch.stack(out.logits, dim=1).float().numpy()
    return tokens, logits


def check_greedy(path: str | Path, model: Any, prompts: list[list[int]], new_tokens: int, *,
                 session: Any = None) -> GreedyCheck:
    """Greedy-decode ``new_tokens`` for each prompt with the file and with ``model``; compare token for token."""
    layout = read_layout(path)
    ids, mask = left_padded(prompts, layout, new_tokens)
    got = onnx_greedy(session or onnx_session(path), layout, ids, mask, new_tokens)
    expected, logits = torch_greedy(model, ids, mask, new_tokens)
    divergence = None
    differs = np.argwhere(got != expected)
    if len(differs):
        step = int(differs[:, 1].min())
        row = int(differs[differs[:, 1] == step][0, 0])
        step_logits = logits[row, step]
        divergence = Divergence(row, step, int(got[row, step]), int(expected[row, step]),
                                float(step_logits.max() - step_logits[got[row, step]]))
    return GreedyCheck(got.tolist(), expected.tolist(), divergence)
