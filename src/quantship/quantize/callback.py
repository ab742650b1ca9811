"""``QuantizeCallback``: quantization-aware training inside a fastai ``fit``.

``before_fit`` swaps ``learn.model`` for a model carrying fake-quantizers (FX ``prepare_qat_fx``
for x86/fbgemm/onednn/qnnpack, or pt2e ``prepare_qat_pt2e`` on a ``torch.export`` capture) and
rebuilds the optimizer so learning rates, weight decay and fastai's per-parameter flags survive.
``after_fit`` converts, tags the result with its ``QuantSpec`` (method ``'qat'``) and puts it on
``learn.model``.

fastai is imported only when this module is (``import quantship`` does not import it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

try:
    from fastai.callback.core import Callback
except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "QuantizeCallback needs fastai, which is not installed: pip install 'quantship[fastai]'"
    ) from exc

from quantship.errors import DataRefused
from quantship.heap import forget_module_caches
from quantship.precision import QuantSpec, resolve_spec, tag_model
from quantship.quantize import distributed, fx, pt2e
from quantship.quantize.annotator import QuantshipQuantizer
from quantship.quantize.capture import capture, carry_static_batch
from quantship.quantize.conv_bn_fold import fold_what_can_match, fuse_what_can_match

_FLAG_KEYS = ("do_wd", "force_train")  # fastai's per-parameter optimizer flags


def qat_spec(quantizer: Any, backend: str) -> QuantSpec:
    """The QAT spec: ``resolve_spec(backend, 'qat')``, or the quantizer's spec switched to 'qat'.

    A quantizer whose backend has no QAT cell in the support matrix is refused (never replaced).
    """
    if quantizer is None:
        return resolve_spec(backend, "qat")
    spec = quantizer if isinstance(quantizer, QuantSpec) else getattr(quantizer, "spec", None)
    if not isinstance(spec, QuantSpec):
        raise TypeError(
            f"quantizer={quantizer!r} must be a quantship Quantizer (or a QuantSpec); build one with "
            "Quantizer(backend='x86') or pass backend= alone"
        )
    if backend not in ("x86", spec.backend):  # 'x86' is the default: only an explicit clash is refused
        raise ValueError(
            f"backend={backend!r} contradicts the quantizer's backend={spec.backend!r}; pass one of them"
        )
    if spec.method == "qat":
        return spec
    static_default = resolve_spec(spec.backend, spec.method).act_observer if spec.method == "static" else None
    observer = None if spec.act_observer in (None, static_default) else spec.act_observer
    try:
        return resolve_spec(
            spec.backend, "qat",
            weight_bits=dict(spec.layer_bits) if spec.layer_bits else spec.weight_bits,
            act_bits=spec.act_bits, qscheme=spec.qscheme, symmetric=spec.symmetric,
            group_size=spec.group_size, qdq_placement=spec.qdq_placement,
            skip_activations=spec.skip_activations, act_observer=observer,
        )
    except ValueError as err:
        raise ValueError(
            f"QuantizeCallback trains with method='qat', but the quantizer's request "
            f"({spec.backend} {spec.label} {spec.method}) has no QAT cell: {err}"
        ) from err


def loader_batch_sizes(dl: Any) -> set[int]:
    """The batch sizes a (fastai or torch) DataLoader will yield, from its length and settings."""
    n = getattr(dl, "n", None)
    if n is None:
        n = len(dl.dataset) if hasattr(dl, "dataset") else None
    bs = getattr(dl, "bs", None) or getattr(dl, "batch_size", None)
    if n is None or not bs:
        raise ValueError(
            f"cannot tell the batch sizes of {type(dl).__name__} (no dataset length or batch size); "
            "pt2e QAT needs loaders with a fixed batch size"
        )
    if n == 0:
        return set()
    full, rest = divmod(n, bs)
    sizes = {bs} if full else set()
    if rest and not getattr(dl, "drop_last", False):
        sizes.add(rest)
    return sizes


class QuantizeCallback(Callback):
    """Quantization-aware training in ``fit``: the converted INT8 model ends up on ``learn.model``.

    ``backend`` is one of x86, fbgemm, onednn, qnnpack (FX graph mode) or pt2e (torch.export,
    symmetric INT8 that ``export_qdq`` writes); a ``quantizer`` fixes the precision instead.
    """

    order = 0  # after TrainEvalCallback (moves the model), before ParamScheduler (sets hypers)

    def __init__(self, quantizer: Any = None, backend: str = "x86", verbose: bool = False):
        super().__init__()
        self.spec = qat_spec(quantizer, backend)
        self.preset = getattr(quantizer, "preset", None)  # a for_target preset travels to the model
        self.verbose = verbose
        self.prepared: nn.Module | None = None

    def _log(self, message: str) -> None:
        if self.verbose:
            print(message, flush=True)

    # -- fastai events -----------------------------------------------------------------------
    def before_fit(self) -> None:
        """Insert fake-quantizers and rebuild the optimizer on the prepared model."""
        example = self._example_batch()
        self._ddp, model = distributed.unwrap_ddp(self.learn.model)  # DDP: prepare inside, wrap again
        if self.spec.backend == "pt2e":
            self.prepared = self._prepare_pt2e(model, example)
        else:
            self.prepared = self._prepare_fx(model, example)
        self.learn.model = distributed.rewrap_ddp(self._ddp, self.prepared)
        self._rebuild_optimizer()
        self._sync_ranks = distributed.start_qat_sync(self.prepared)  # False outside torch.distributed

    def after_batch(self) -> None:
        """Under torch.distributed: every rank's fake-quant ranges merged after each batch."""
        if self.prepared is not None and getattr(self, "_sync_ranks", False):
            distributed.sync_fake_quant(self.prepared)

    def after_fit(self) -> None:
        """Convert the trained model, tag it, and put it on ``learn.model``."""
        if self.prepared is None:
            return
        if self.spec.backend == "pt2e":
            converted = self._convert_pt2e(self.prepared)
        else:
            converted = self._convert_fx(self.prepared)
        self.learn.model = distributed.place_converted(self.learn.model, tag_model(converted, self.spec, self.preset),
                                                       user_wrapper=getattr(self, "_ddp", None))
        self.prepared = None

    # -- preparation -------------------------------------------------------------------------
    def _check_one_batch_size(self, static_batch: int, reason: str) -> None:
        """A graph captured at a static batch runs one batch size: refuse loaders that yield several,
        before any batch. A symbolic capture takes every batch size (a shorter last batch included)."""
        seen: dict[str, set[int]] = {}
        for name in ("train", "valid"):
            dl = getattr(self.learn.dls, name, None)
            if dl is not None:
                seen[name] = loader_batch_sizes(dl)
        sizes = sorted(set().union(*seen.values()))
        if len(sizes) > 1:
            per = ", ".join(f"{k}: {sorted(v)}" for k, v in seen.items())
            raise ValueError(
                f"pt2e QAT captured the model at a static batch of {static_batch} ({reason}), but these "
                f"dataloaders yield batch sizes {sizes} ({per}): such a graph only runs the batch size it was "
                "captured with. Make the model's batch symbolic, or drop the last batch of each loader "
                "(drop_last=True, e.g. dls.valid.drop_last = True), or use one batch size that divides both "
                "dataset sizes."
            )

    def _example_batch(self) -> torch.Tensor:
        """One training input (shapes only), read without disturbing the random streams."""
        dl = self.learn.dls.train
        rng = getattr(dl, "rng", None)
        state = rng.getstate() if rng is not None else None
        with torch.random.fork_rng(devices=[]):
            # a fastai DataLoader has one_batch(); a plain torch DataLoader (fastai accepts those
            # inside DataLoaders too) is read through its iterator
            batch = dl.one_batch() if hasattr(dl, "one_batch") else next(iter(dl), None)
        if state is not None:
            rng.setstate(state)
        if batch is None:
            raise DataRefused("QuantizeCallback: the training loader yields no batch; give it data before fit")
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"QuantizeCallback needs a single tensor input per batch, got {type(x).__name__}")
        return x.as_subclass(torch.Tensor).detach() if type(x) is not torch.Tensor else x.detach()

    def _prepare_fx(self, model: nn.Module, example: torch.Tensor) -> nn.Module:
        from torch.ao.quantization.quantize_fx import prepare_qat_fx


        fx.check_layer_names(model, self.spec)
        with fx.quiet_fx(), fx.quantized_engine(self.spec.engine):
            mapping = fx.qconfig_mapping(self.spec, qat=True)
            prepared = prepare_qat_fx(model.train(), mapping, (example,))
        self._log(f"{self.spec.backend}: prepared for QAT (FX, {self.spec.label}, {self.spec.qscheme})")
        return prepared

    def _prepare_pt2e(self, model: nn.Module, example: torch.Tensor) -> nn.Module:
        from torchao.quantization.pt2e import allow_exported_model_train_eval
        from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

        self._log("pt2e: capturing the model with torch.export (symbolic batch dimension)")
        captured = capture(model.train(), example, log=self._log)
        if not captured.symbolic:
            self._check_one_batch_size(captured.static_batch, captured.reason)
        quantizer = QuantshipQuantizer(self.spec, is_qat=True, modules=pt2e.module_names(model))
        with fuse_what_can_match(captured.graph):
            prepared = prepare_qat_pt2e(captured.graph, quantizer)
        carry_static_batch(captured.graph, prepared)
        pt2e.report_placement(quantizer, self.spec, self._log)
        allow_exported_model_train_eval(prepared)  # fastai switches train/eval every epoch
        self._log(f"pt2e: prepared for QAT ({self.spec.label}, {self.spec.qscheme}, "
                  f"qdq_placement={self.spec.qdq_placement})")
        return prepared

    def _rebuild_optimizer(self) -> None:
        """New optimizer on the prepared model, with the old one's hypers and per-parameter flags."""
        old = self.learn.opt
        hypers = [dict(h) for h in old.hypers] if old is not None else None
        state = getattr(old, "state", {}) if old is not None else {}
        flags = {id(p): {k: s[k] for k in _FLAG_KEYS if k in s} for p, s in state.items()}
        self.learn.create_opt()
        new = self.learn.opt
        if hypers is not None:
            if len(new.hypers) != len(hypers):
                raise ValueError(
                    f"the learner's splitter gives {len(new.hypers)} parameter group(s) on the prepared "
                    f"model but {len(hypers)} on the original, so learning rates cannot be carried over; "
                    "use a splitter that works on a torch.fx GraphModule (e.g. the default trainable_params)"
                )
            for key in set().union(*hypers):
                if all(key in h for h in hypers):
                    new.set_hyper(key, [h[key] for h in hypers])
        new_state = getattr(new, "state", None)
        if new_state is not None:
            for group in new.param_lists:
                for p in group:
                    if id(p) in flags:
                        entry = new_state[p]
                        for key in _FLAG_KEYS:
                            entry.pop(key, None)
                        entry.update(flags[id(p)])
        self._log("QuantizeCallback: optimizer rebuilt on the prepared model (hypers and flags kept)")

    # -- conversion --------------------------------------------------------------------------
    def _convert_fx(self, prepared: nn.Module) -> nn.Module:
        from torch.ao.quantization.quantize_fx import convert_fx


        self._log(f"{self.spec.backend}: converting the QAT model to INT8 (FX)")
        with fx.quiet_fx(), fx.quantized_engine(self.spec.engine):
            converted = convert_fx(prepared.cpu().eval())
        fx.check_converted(converted, self.spec)
        return converted

    def _convert_pt2e(self, prepared: nn.Module) -> nn.Module:
        from torchao.quantization.pt2e import allow_exported_model_train_eval, move_exported_model_to_eval
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e


        self._log("pt2e: converting the trained graph to a quantized one")
        move_exported_model_to_eval(prepared)
        with fold_what_can_match(prepared, qat=True):
            converted = convert_pt2e(prepared)
        carry_static_batch(prepared, converted)
        pt2e.drop_unread_tensors(converted)
        pt2e.weights_read_where_used(converted)
        pt2e.check_converted(converted)
        forget_module_caches()  # the trained float graph, converted in place, is not kept alive by torchao
        allow_exported_model_train_eval(converted)
        return converted

