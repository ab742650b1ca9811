"""Where models come from, by name: ``load_model(spec, weights)`` for the command line, bench and docs.

``torchvision:NAME``, ``timm:NAME`` (if timm is installed), ``path/to/file.py:factory`` (which RUNS that
file's Python code, with its folder on the import path so it can import its neighbours) or
``hf:reference|DIR|config.json`` (local Hugging Face files only, wrapped to take token ids and return
logits), with optional weights (a state_dict file, or a torchvision weight set from the local hub
cache). Every problem is a ``ModelRefused``: one line that says what to do.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from quantship.errors import ModelRefused, cause, one_line
from quantship.examples import lm


def load_model(spec: str, weights: str | None = None, *, trust_pickle: bool = False):
    """Build the model a ``MODEL`` argument names, in eval mode, with optional weights."""
    import torch

    kind, _, name = spec.partition(":")
    if kind == "hf" and name:
        return load_hf_model(name, weights)
    if not name:
        raise ModelRefused(f"MODEL {spec!r} must be torchvision:NAME, timm:NAME or path/to/file.py:factory")
    if kind == "torchvision":
        import torchvision

        try:
            model = torchvision.models.get_model(name, weights=None)
        except (ValueError, KeyError):
            known = torchvision.models.list_models(module=torchvision.models)
            close = [m for m in known if name.lower()[:4] in m][:6] or known[:6]
            raise ModelRefused(f"unknown torchvision model {name!r}; e.g. {', '.join(close)}") from None
    elif kind == "timm":
        if importlib.util.find_spec("timm") is None:
            raise ModelRefused("timm is not installed: pip install timm, or use torchvision:NAME")
        import timm

        try:
            model = timm.create_model(name, pretrained=False)
        except RuntimeError as exc:
            raise ModelRefused(f"unknown timm model {name!r}: {exc}") from None
    elif kind.endswith(".py"):
        path = Path(kind)
        if not path.is_file():
            raise ModelRefused(f"model file {kind} does not exist")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        folder = str(path.resolve().parent)
        if folder not in sys.path:  # the file imports its neighbours as it would when run as a script
            sys.path.insert(0, folder)
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # the user's file: any failure is bad input
            raise ModelRefused(f"importing {kind} failed: {type(exc).__name__}: {exc}") from None
        factory = getattr(module, name, None)
        if not callable(factory):
            raise ModelRefused(f"{kind} has no callable {name!r}")
        try:
            model = factory()
        except Exception as exc:  # the user's factory: its failure is bad input, not our crash
            raise ModelRefused(f"{kind}:{name}() raised {cause(exc)}") from None
        if not isinstance(model, torch.nn.Module):
            raise ModelRefused(f"{kind}:{name}() returned {type(model).__name__}, not a torch.nn.Module")
    else:
        raise ModelRefused(f"MODEL {spec!r}: unknown source {kind!r}; use torchvision:, timm: or file.py:factory")
    if weights:
        return load_weights(model, spec, weights, trust_pickle=trust_pickle).eval()
    return model.eval()


def weights_origin(spec: str, weights: str | None) -> str:
    """What the model's weights are, for the summary: a file, a named set, or random initialisation."""
    if weights:
        return weights
    kind, _, name = spec.partition(":")
    if kind == "hf" and name != "reference":
        path = Path(name)
        if not (path.is_dir() and any(p.suffix in (".safetensors", ".bin") for p in path.iterdir())):
            return "random initial weights (a config without weights: figures say nothing about a trained model)"
    if spec.startswith(("torchvision:", "timm:")):
        return "random weights (no --weights given: accuracy and agreement figures say nothing about a trained model)"
    return "as built by the factory"


def _hub_weights(name: str, weights: str):
    """A torchvision weight set (e.g. IMAGENET1K_V1, DEFAULT) read from the local torch hub cache."""
    import torch
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(name)
    except (ValueError, KeyError):
        return None
    try:
        entry = enum[weights] if weights != "DEFAULT" else enum.DEFAULT
    except KeyError:
        raise ModelRefused(f"{name} has no weights {weights!r}; its weight sets: {[w.name for w in enum]} "
                         "(or give a state_dict file)") from None
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(entry.url).name
    if not cached.is_file():
        raise ModelRefused(f"weights {entry} are not in the local torch hub cache and quantship does not download: "
                         f"put {Path(entry.url).name} (from {entry.url}) at {cached}, or give a state_dict file")
    return torch.load(cached, map_location="cpu", weights_only=True)


def load_weights(model, spec: str, weights: str, *, trust_pickle: bool = False):
    """Load ``weights`` into ``model``: a state_dict file, a torchvision weight set name (local hub
    cache only), or a whole pickled model (only with ``trust_pickle``: unpickling runs code)."""
    import pickle

    import torch

    wpath = Path(weights)
    kind, _, name = spec.partition(":")
    if not wpath.is_file():
        state = _hub_weights(name, weights) if kind == "torchvision" and "/" not in weights else None
        if state is None:
            raise ModelRefused(f"weights file {weights} does not exist")
    else:
        try:
            state = torch.load(wpath, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            if "Unsupported global" not in str(exc):  # no pickled class in it: garbage or truncated
                raise ModelRefused(f"cannot read {weights} with torch.load: {one_line(exc)}") from None
            if not trust_pickle:
                raise ModelRefused(f"{weights} is not a plain state_dict (it holds pickled objects, e.g. a whole "
                                 "model); unpickling it runs its code: pass --trust-pickle if you trust the file, "
                                 "or save model.state_dict() instead") from None
            state = torch.load(wpath, map_location="cpu", weights_only=False)
        except Exception as exc:  # torch raises RuntimeError/EOFError/... for a file it cannot read
            raise ModelRefused(f"cannot read {weights} with torch.load: {one_line(exc)}") from None
    if isinstance(state, torch.nn.Module):
        return state  # a whole pickled model (trusted): it replaces the factory's
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a training checkpoint that wraps the state_dict
    if not isinstance(state, dict):
        raise ModelRefused(f"{weights} holds a {type(state).__name__}, not a state_dict")
    try:
        model.load_state_dict(state)
    except Exception as exc:  # torch raises RuntimeError for missing/unexpected keys or shapes
        raise ModelRefused(f"cannot load {weights} into {spec}: {one_line(exc)}") from None
    return model


def load_hf_model(name: str, weights: str | None = None):
    """``hf:reference`` (the trained byte-level Llama of quantship.examples.lm), ``hf:DIR`` (a local
    Hugging Face checkpoint, or a folder with only config.json: random weights) or ``hf:config.json``.
    Local files only; the model is wrapped to take token ids and return logits."""
    import torch

    try:
        transformers = lm.require_transformers()
    except ModuleNotFoundError as exc:
        raise ModelRefused(str(exc)) from None
    if name == "reference":
        model = lm.trained_model(log=lambda m: print(f"training the reference LM (once, cached): {m}", file=sys.stderr))
    else:
        path = Path(name)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise ModelRefused(f"hf:{name}: give 'reference', a checkpoint folder, or a config.json (local files only)")
        try:
            config = transformers.AutoConfig.from_pretrained(str(config_file.parent), local_files_only=True)
            has_weights = path.is_dir() and any(p.suffix in (".safetensors", ".bin") for p in path.iterdir())
            auto = transformers.AutoModelForCausalLM
            if has_weights:
                inner = auto.from_pretrained(str(path), local_files_only=True)
            else:
                with torch.random.fork_rng():  # seeded: two runs on one config give the same model and file
                    torch.manual_seed(0)
                    inner = auto.from_config(config)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelRefused(f"hf:{name}: {str(exc).strip().splitlines()[0]}") from None
        if not has_weights:
            print(f"hf:{name}: no weights beside the config: random initial weights (seed 0)", file=sys.stderr)
        model = lm.CausalLMLogits(inner)
    if weights:
        try:
            model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        except Exception as exc:  # torch raises RuntimeError/UnpicklingError for mismatches
            raise ModelRefused(f"cannot load {weights} into hf:{name}: {str(exc).strip().splitlines()[0]}") from None
    return model.eval()
