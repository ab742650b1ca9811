"""Calibration data for ``Quantizer``: whatever the user has, turned into a list of contiguous input batches.

The cap and the batch arithmetic are ``quantship.calibration``'s (one reading for every path); this
module adds what only torch models need: tensors from any loader, validated, made contiguous.

Accepted: one tensor (a single batch), an iterable of tensors, of ``(x, y)`` tuples or lists, a
torch ``DataLoader``, or fastai ``DataLoaders`` (its training loader) / ``DataLoader``. Batches may
differ in size (8, 8, 5); every batch is made contiguous, so a channels-last loader gives the same
graph and the same file as a contiguous one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from quantship import calibration
from quantship.errors import DataRefused
from quantship.progress import active, step
from quantship.quantize import distributed


def _as_plain_tensor(x: torch.Tensor) -> torch.Tensor:
    # fastai yields TensorImage & co.; a plain tensor keeps torch.export away from subclasses
    if type(x) is not torch.Tensor:
        x = x.as_subclass(torch.Tensor)
    # strides and memory format (channels-last images) must never reach a captured graph
    return x.detach().cpu().contiguous(memory_format=torch.contiguous_format)


class Inputs(tuple):
    """One batch of a model with several inputs: its tensors in the forward's order (a plain tuple is read as
    ``(x, y)``). ``shape`` and ``dim()`` are the first tensor's, whose first dim is the batch of all."""

    @property
    def shape(self) -> torch.Size:
        return self[0].shape

    def dim(self) -> int:
        return self[0].dim()


def call(model: torch.nn.Module, x: torch.Tensor | Inputs):
    """``model`` on one batch's input: one tensor, or the tensors of ``Inputs`` as positional arguments."""
    return model(*x) if isinstance(x, Inputs) else model(x)


def input_of(batch: object) -> torch.Tensor | Inputs:
    """The model input of one batch: the tensor itself, ``Inputs`` (several), or the first item of ``(x, y)``."""
    if isinstance(batch, Inputs):
        return Inputs(_as_plain_tensor(x) for x in batch)
    if isinstance(batch, torch.Tensor):
        return _as_plain_tensor(batch)
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return _as_plain_tensor(batch[0])
    raise TypeError(
        f"a calibration batch must be a tensor or an (x, y) tuple whose x is a tensor, got "
        f"{type(batch).__name__}; pass an iterable of tensors, a DataLoader, or fastai DataLoaders"
    )


def validate_batch(x: torch.Tensor, index: int) -> torch.Tensor:
    """Refuse a calibration batch no observer can use: empty, complex, or holding NaN/inf values.

    Called on every batch as it is read, before any model work (observers would fail deep inside
    torch, e.g. ``torch.histc ... not finite``, or silently drop the imaginary part).
    """
    if isinstance(x, Inputs):
        for each in x:
            validate_batch(each, index)
        return x
    if x.is_complex():
        raise DataRefused(f"calibration batch {index} is complex ({x.dtype}); give real-valued inputs")
    if x.numel() == 0:
        raise DataRefused(f"calibration batch {index} is empty (shape {list(x.shape)}); give at least one value")
    if x.is_floating_point():
        bad = int((~torch.isfinite(x)).sum())
        if bad:
            raise DataRefused(f"calibration batch {index} holds {bad} NaN or infinite value(s); clean or drop "
                              "those inputs before calibrating")
    return x


def _loader_of(data: object) -> Iterable:
    # fastai DataLoaders: calibrate on the training loader (fastai drops its last batch there)
    if hasattr(data, "train") and hasattr(data, "valid") and not isinstance(data, torch.Tensor):
        return data.train
    return data


def collect_batches(data: object, max_samples: int) -> list[torch.Tensor]:
    """Read whole batches until ``max_samples`` would be exceeded; batch sizes may differ.

    Everything is read before any model work, so a bad loader fails fast.
    """
    if data is None:
        raise ValueError(
            "calibration_dl is required for static quantization: pass an iterable of input batches "
            "(tensors or (x, y) tuples), a DataLoader, or fastai DataLoaders"
        )
    calibration.check_max_samples(max_samples, "max_calibration_samples")
    if isinstance(data, torch.Tensor):
        data = [data]
    loader = _loader_of(data)
    if not isinstance(loader, Iterable):
        raise TypeError(
            f"calibration_dl of type {type(data).__name__} is not iterable; pass a list of tensors, "
            "a DataLoader, or fastai DataLoaders"
        )

    def read() -> Iterable[torch.Tensor]:
        for index, batch in enumerate(loader):
            x = validate_batch(input_of(batch), index)
            if x.dim() == 0:
                raise ValueError("a calibration batch is a 0-d tensor; batches need a leading batch dimension")
            yield x

    batches = list(calibration.take(read(), max_samples, cap_name="max_calibration_samples"))
    if not batches:
        raise ValueError("calibration_dl yielded no batch: give it at least one input batch")
    shapes = {tuple(b.shape[1:]) for b in batches}
    if len(shapes) > 1:
        raise ValueError(f"calibration batches have different sample shapes {sorted(shapes)}; use one shape")
    return batches


def run_batches(model: torch.nn.Module, batches: list[torch.Tensor], *, verbose: bool = False,
                description: str = "calibrating") -> None:
    """Feed every batch through ``model``'s observers; with histogram observers, twice.

    The first pass finds each observer's range (merged across ranks in a process group); the
    second records the histograms on it, so a histogram holds the counts of every value on one
    set of bins, whatever the order of the batches or how they are split across ranks. Histogram
    observers only track min/max in the first pass, and only they see the second.
    """
    if not distributed.histogram_observers(model):
        _feed(model, batches, verbose=verbose, description=description)
        return
    with distributed.histograms_track_range_only(model):
        _feed(model, batches, verbose=verbose, description=description)
    distributed.histograms_on_common_range(model, sum(b.shape[0] for b in batches))
    with distributed.only_histograms_observe(model):
        _feed(model, batches, verbose=verbose, description=f"{description}: histograms on the observed ranges")


def _feed(model: torch.nn.Module, batches: list[torch.Tensor], *, verbose: bool, description: str) -> None:
    """Every batch through ``model`` without gradients: a marked step (``quantship.progress``), and
    a progress bar on a terminal stdout when verbose and no listener shows the step."""
    import sys


    with torch.no_grad():
        if not verbose or active() or not sys.stdout.isatty():
            with step(f"quantize: {description}", total=sum(b.shape[0] for b in batches)) as current:
                for x in batches:
                    call(model, x)
                    current.advance(x.shape[0])
            return
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task(description, total=sum(b.shape[0] for b in batches))
            for x in batches:
                call(model, x)
                bar.advance(task, x.shape[0])
