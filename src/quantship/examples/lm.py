"""The reference language-model task: a small Llama trained on the Python standard library's own sources.

Every Python install ships its standard library as ``.py`` files, so the corpus needs no download.
Files are split by a hash of their path (one in ten held out), text is read byte by byte (vocabulary
256, no tokenizer to fit), and the model is a Hugging Face ``LlamaForCausalLM`` from a small config.
Training is short and deterministic; the weights are cached like the digits model's.

Perplexity is measured per held-out file and summarised with a bootstrap 95% interval over files.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from quantship.examples.digits import cache_dir

VOCAB = 256  # bytes
SEQ_LEN = 128
HELD_OUT_EVERY = 10  # one file in ten, chosen by a hash of its path
_CACHE_VERSION = 1
_SKIPPED_DIRS = {"test", "tests", "site-packages", "idle_test", "__pycache__"}


def require_transformers():
    """The ``transformers`` module, or a one-line error naming the extra that installs it."""
    try:
        import transformers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "the language-model task needs Hugging Face transformers: pip install 'quantship[test]' "
            "(or pip install transformers)") from None
    return transformers


@dataclass(frozen=True)
class Corpus:
    """The standard library's ``.py`` files as byte arrays, split by file."""

    train: list[np.ndarray]
    held_out: list[np.ndarray]
    held_out_names: list[str]


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of every standard-library ``.py`` file outside test folders, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if not _SKIPPED_DIRS & set(rel.parts[:-1]):
            files.append((rel.as_posix(), p))
    return sorted(files)


def is_held_out(relative_path: str) -> bool:
    return hashlib.sha256(relative_path.encode()).digest()[0] % HELD_OUT_EVERY == 0


def load_corpus() -> Corpus:
    """Train and held-out files (held-out files shorter than one window are left out)."""
    train, held, names = [], [], []
    for rel, path in stdlib_files():
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        if is_held_out(rel):
            if len(data) > SEQ_LEN:
                held.append(data)
                names.append(rel)
        else:
            train.append(data)
    if not train or not held:
        raise RuntimeError(f"the standard library at {sysconfig.get_paths()['stdlib']} has too few .py files")
    return Corpus(train, held, names)


class CausalLMLogits(nn.Module):
    """A causal LM called with token ids only, returning logits (what the ONNX file computes)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def build_model(hidden: int = 256, layers: int = 4, heads: int = 4, intermediate: int = 768,
                tied: bool = False) -> CausalLMLogits:
    """The reference architecture: a byte-level Llama, about 3.5 M parameters, 98% of them in Linear layers.
    ``tied``: the LM head reads the token embedding's table (one tensor, as in GPT-2's config)."""
    transformers = require_transformers()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4 * SEQ_LEN,
        tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return CausalLMLogits(transformers.LlamaForCausalLM(config)).eval()


def build_tied_model() -> CausalLMLogits:
    """The reference Llama with its LM head tied to the token embedding (what ``llama_tied`` trains)."""
    return build_model(tied=True)


def build_gpt2(hidden: int = 128, layers: int = 2, heads: int = 4, intermediate: int = 512) -> CausalLMLogits:
    """A byte-level GPT-2 (its ``Conv1D`` layers are ``addmm`` products), smaller than the reference Llama so
    that a short training fits a few minutes on shared cores."""
    transformers = require_transformers()
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate,
        n_positions=4 * SEQ_LEN, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return CausalLMLogits(transformers.GPT2LMHeadModel(config)).eval()


# name -> builder; "llama" is the reference
ARCHITECTURES = {"llama": build_model, "gpt2": build_gpt2, "llama_tied": build_tied_model}


def _windows(data: np.ndarray, n: int, gen: np.random.Generator) -> np.ndarray:
    starts = gen.integers(0, len(data) - SEQ_LEN - 1, size=n)
    return np.stack([data[s:s + SEQ_LEN + 1] for s in starts])


def train(corpus: Corpus, steps: int = 400, batch: int = 16, seed: int = 0,
          log: Callable[[str], None] | None = None, architecture: str = "llama") -> CausalLMLogits:
    """Next-byte training on random windows of the training files (3-4 minutes on 2 idle cores)."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[architecture]()
    stream = np.concatenate(corpus.train)
    gen = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        chunk = torch.from_numpy(_windows(stream, batch, gen).astype(np.int64))
        logits = model(chunk[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), chunk[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log and (step % 50 == 0 or step == steps - 1):
            log(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    return model.eval()


def cache_path(architecture: str = "llama", steps: int = 400) -> Path:
    version = f"py{sys.version_info.major}{sys.version_info.minor}"  # the corpus is this Python's stdlib
    trained = "" if steps == 400 else f"_{steps}steps"
    return cache_dir() / f"lm_{architecture}_bytes_{version}{trained}_v{_CACHE_VERSION}.pt"


def trained_model(*, retrain: bool = False, log: Callable[[str], None] | None = None, architecture: str = "llama",
                  steps: int = 400) -> CausalLMLogits:
    """A trained LM (the reference Llama by default), loaded from the cache or trained (and cached) on first use."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r}: the LM task trains {sorted(ARCHITECTURES)}")
    path = cache_path(architecture, steps)
    if path.exists() and not retrain:
        model = ARCHITECTURES[architecture]()
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()
    model = train(load_corpus(), steps=steps, log=log, architecture=architecture)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two processes training at once never share a temp file
    torch.save(model.state_dict(), tmp)
    tmp.replace(path)
    return model


def eval_windows(corpus: Corpus, per_file: int = 2) -> list[np.ndarray]:
    """Up to ``per_file`` non-overlapping windows of SEQ_LEN + 1 bytes from each held-out file (fixed)."""
    out = []
    for data in corpus.held_out:
        n = min(per_file, (len(data) - 1) // SEQ_LEN)
        step = (len(data) - 1 - SEQ_LEN) // max(n - 1, 1) if n > 1 else 0
        out.append(np.stack([data[i * step:i * step + SEQ_LEN + 1] for i in range(n)]).astype(np.int64))
    return out


def file_nll(logits_fn: Callable[[np.ndarray], np.ndarray], windows: list[np.ndarray]) -> np.ndarray:
    """Per file: (summed negative log-likelihood in nats, predicted bytes). ``logits_fn``: ids [1, T] -> logits."""
    rows = []
    for per_file in windows:
        total, count = 0.0, 0
        for w in per_file:
            logits = np.asarray(logits_fn(w[None, :-1]), dtype=np.float64)[0]
            logits -= logits.max(-1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            total -= float(logp[np.arange(SEQ_LEN), w[1:]].sum())
            count += SEQ_LEN
        rows.append((total, count))
    return np.array(rows)


def torch_logits(model: nn.Module) -> Callable[[np.ndarray], np.ndarray]:
    def run(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(ids)).float().numpy()
    return run


def onnx_logits(path: str | Path) -> Callable[[np.ndarray], np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda ids: session.run(None, {name: ids})[0]


@dataclass(frozen=True)
class Perplexity:
    """Held-out perplexity with a bootstrap 95% interval over files; ``ratio`` vs a reference, paired."""

    value: float
    low: float
    high: float
    ratio: float | None = None
    ratio_low: float | None = None
    ratio_high: float | None = None

    def __str__(self) -> str:
        text = f"{self.value:.4f} [{self.low:.4f}, {self.high:.4f}]"
        if self.ratio is not None:
            text += f", {100 * (self.ratio - 1):+.2f}% [{100 * (self.ratio_low - 1):+.2f}, {100 * (self.ratio_high - 1):+.2f}]"
        return text


def perplexity(rows: np.ndarray, reference: np.ndarray | None = None, n_boot: int = 2000, seed: int = 0) -> Perplexity:
    """Perplexity of per-file ``rows`` (nll, count); the interval resamples files with replacement.

    With ``reference`` (the same files under another model) the ratio's interval uses the same
    resampled files for both (a paired bootstrap), so it is much tighter than the two intervals.
    """
    gen = np.random.default_rng(seed)
    idx = gen.integers(0, len(rows), size=(n_boot, len(rows)))
    boot = np.exp(rows[idx, 0].sum(1) / rows[idx, 1].sum(1))
    value = math.exp(rows[:, 0].sum() / rows[:, 1].sum())
    low, high = np.percentile(boot, [2.5, 97.5])
    if reference is None:
        return Perplexity(value, float(low), float(high))
    ref_boot = np.exp(reference[idx, 0].sum(1) / reference[idx, 1].sum(1))
    ratio = value / math.exp(reference[:, 0].sum() / reference[:, 1].sum())
    r_low, r_high = np.percentile(boot / ref_boot, [2.5, 97.5])
    return Perplexity(value, float(low), float(high), ratio, float(r_low), float(r_high))
