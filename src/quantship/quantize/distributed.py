"""Calibration and QAT across ``torch.distributed`` ranks: every rank ends with the scales of the union.

Each rank runs its own shard through its own observers; before conversion the statistics are
merged so every rank holds what one process would have seen on all the data:

- min/max (per tensor or per channel, plain or moving average): one ``all_reduce(MIN)`` over
  ``[min, -max]`` of every observer at once. Min and max are exact, so the scales are exactly
  those of one process on the union.
- histograms (``HistogramObserver`` and quantship's percentile and MSE observers): calibration
  records them in a second pass over the batches, on the range of all the data, which the ranks
  merge first (``histograms_on_common_range``). Every rank's bins are then the same bins, and one
  ``all_reduce(SUM)`` adds counts that are whole numbers: exact, so the histograms, and the
  scales chosen from them, are bit for bit those of one process on the union (in any order of the
  batches: each batch's counts are added, never re-binned), as long as no bin holds 2**24 values
  or more (16.8 M: the observer keeps float32 counts, which round beyond that). A histogram
  recorded on another range is still re-binned (``observers.rebin_histogram``) before the sum;
  then it is an approximation.
- fake-quantizers (QAT): their observed min/max are merged after every step and their scale and
  zero-point recomputed, so every rank trains and converts with the same ranges (DDP would
  otherwise broadcast rank 0's buffers, i.e. ranges from rank 0's data alone).

BatchNorm statistics are left to the user's DDP: broadcast from rank 0 before each forward by
default (``forward_sync_buffers``), so every rank converts the same model. With rank-local buffers
the ranks' BN statistics, and so their files, differ. In a pt2e graph batch-norm is an aten op,
not a module, so ``nn.SyncBatchNorm.convert_sync_batchnorm`` finds nothing to replace there.

Before anything is merged, the ranks agree on what they hold (an observer layout digest, the
number of calibration samples): different models or an empty shard are refused on every rank with
the same message. Every collective has a timeout (``quantship.ranks``), so a rank that fails
earlier cannot hang the others. Per merge a rank sends 2 floats per per-tensor observer, 2 per
channel of a per-channel one, and the bins of each histogram observer (2,048 by default).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from quantship import calibration, ranks
from quantship.quantize.observers import rebin_histogram


@dataclass(frozen=True)
class MergeReport:
    """What one merge exchanged: observers, floats sent per rank, and the wall time it took."""

    n_observers: int
    n_histograms: int
    n_floats: int
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def observers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module holding ``min_val``/``max_val`` buffers (observers, incl. those inside fake-quants)."""
    found = []
    for name, module in model.named_modules():
        buffers = dict(module.named_buffers(recurse=False))
        if "min_val" in buffers and "max_val" in buffers:
            found.append((name, module))
    return found


def _fake_quants(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules()
            if hasattr(m, "activation_post_process") and hasattr(m, "scale") and hasattr(m, "calculate_qparams")]


def _is_histogram(module: nn.Module) -> bool:
    return isinstance(getattr(module, "histogram", None), torch.Tensor)


def layout(model: nn.Module) -> str:
    """A digest of the observer layout: names, kinds, buffer sizes and bins, in module order."""
    parts = []
    for name, obs in observers(model):
        bins = obs.histogram.numel() if _is_histogram(obs) else 0
        parts.append(f"{name}:{type(obs).__name__}:{obs.min_val.numel()}:{bins}:{getattr(obs, 'qscheme', '')}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def agree(model: nn.Module, n_samples: int, *, what: str, timeout: float | None = None) -> None:
    """Refuse, on every rank with one message, ranks holding different models or no data."""
    found = observers(model)
    mine = f"{layout(model)} {len(found)} {n_samples}"
    rows = [row.split() for row in ranks.gather_texts(mine, f"{what}: comparing the ranks' models", timeout)]
    if len({row[0] for row in rows}) > 1:
        held = "; ".join(f"rank {r}: {row[1]} observers (layout {row[0]})" for r, row in enumerate(rows))
        raise ValueError(
            f"{what}: the ranks hold different models ({held}); every rank must quantize the same model "
            "with the same Quantizer, each on its own shard of the data"
        )
    empty = [r for r, row in enumerate(rows) if int(row[2]) == 0]
    if empty:
        raise ValueError(
            f"{what}: rank(s) {empty} saw no calibration sample; give every rank a non-empty shard "
            "(e.g. DistributedSampler(dataset, drop_last=False) over a dataset of at least world_size batches)"
        )


def agree_on_batches(collect: Callable[[], list[torch.Tensor]], backend: str,
                     timeout: float | None = None) -> list[torch.Tensor]:
    """Read this rank's calibration batches; refuse on every rank if any rank's shard is unusable.

    ``collect`` is the one-process reader (``calibration.collect_batches``). Outside a process
    group it is simply called.
    """
    me = ranks.world()
    if me is None:
        return collect()
    if backend != "pt2e":
        raise ValueError(
            f"calibration inside a process group merges observers for backend='pt2e' only, not "
            f"backend={backend!r}: use Quantizer(backend='pt2e'), or quantize in one process"
        )
    try:
        batches, status = collect(), ""
    except (ValueError, TypeError) as exc:
        batches, status = [], f"{type(exc).__name__}: {exc}"
    shape = "x".join(map(str, calibration.sample_shape(batches[0]))) if batches else "-"
    n = calibration.total_samples(batches)
    rows = ranks.gather_texts(f"{n} {shape} {status}", "calibration: comparing the ranks' shards", timeout)
    fields = [row.split(" ", 2) for row in rows]
    bad = [(r, f[2]) for r, f in enumerate(fields) if len(f) > 2 and f[2]]
    if bad:
        said = "; ".join(f"rank {r}: {text}" for r, text in bad)
        raise ValueError(f"calibration refused on every rank because of rank(s) {[r for r, _ in bad]}: {said}")
    shapes = {f[1] for f in fields}
    if len(shapes) > 1:
        raise ValueError(
            f"calibration: the ranks' samples have different shapes ({', '.join(f[1] for f in fields)} "
            "by rank); every rank must feed the same sample shape"
        )
    return batches


def _min_max_merge(found: list[tuple[str, nn.Module]], what: str, timeout: float | None) -> int:
    """One all_reduce(MIN) over [mins, -maxs] of every observer; returns the number of floats sent."""
    mins = [obs.min_val.detach().reshape(-1).double() for _, obs in found]
    maxs = [obs.max_val.detach().reshape(-1).double() for _, obs in found]
    packed = torch.cat(mins + [-m for m in maxs]) if found else torch.zeros(0, dtype=torch.float64)
    ranks.all_reduce(packed, _op("MIN"), f"{what}: merging observed min/max", timeout)
    half = packed.numel() // 2
    offset = 0
    for _, obs in found:
        k = obs.min_val.numel()
        obs.min_val.copy_(packed[offset:offset + k].reshape(obs.min_val.shape))
        obs.max_val.copy_((-packed[half + offset:half + offset + k]).reshape(obs.max_val.shape))
        offset += k
    return packed.numel()


def histogram_observers(model: nn.Module) -> list[nn.Module]:
    """The observers of ``model`` that keep a histogram (torchao's, percentile, MSE), in module order."""
    return [obs for _, obs in observers(model) if _is_histogram(obs)]


@contextlib.contextmanager
def histograms_track_range_only(model: nn.Module) -> Iterator[None]:
    """Inside: the histogram observers of ``model`` only track min/max (the first calibration pass),
    as torchao's observer does, ignoring infinite values; every other observer works as usual."""
    hist = histogram_observers(model)
    for obs in hist:
        obs.forward = _range_tracker(obs)
    try:
        yield
    finally:
        for obs in hist:
            del obs.forward


def _range_tracker(obs: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x_orig: torch.Tensor) -> torch.Tensor:
        x = x_orig.detach()
        if x.numel() == 0:
            return x_orig
        lo, hi = torch.aminmax(x)
        if bool(torch.isinf(lo)) or bool(torch.isinf(hi)):  # torchao leaves infinite values out of the range
            x = x[x.abs() != torch.inf]
            if x.numel() == 0:
                return x_orig
            lo, hi = torch.aminmax(x)
        obs.min_val.resize_(lo.shape).copy_(torch.minimum(obs.min_val.reshape(lo.shape), lo))
        obs.max_val.resize_(hi.shape).copy_(torch.maximum(obs.max_val.reshape(hi.shape), hi))
        return x_orig

    return forward


def histograms_on_common_range(model: nn.Module, n_samples: int, *, timeout: float | None = None) -> None:
    """Merge every observer's min/max across the ranks, then empty the histograms on that range.

    Called between the two calibration passes: in a process group the ranks first agree on the
    model and their data. The second pass then records every batch's counts on that one range
    (torchao's observer re-bins what it holds only when a batch widens its range, which a batch
    inside the range never does), so the counts are exact whole numbers on shared bins.
    """
    found = observers(model)
    if ranks.world() is not None:
        agree(model, n_samples, what="calibration", timeout=timeout)
        _min_max_merge(found, "calibration", timeout)
    for obs in histogram_observers(model):
        obs.histogram.zero_()


@contextlib.contextmanager
def only_histograms_observe(model: nn.Module) -> Iterator[None]:
    """Inside: every observer of ``model`` but the histogram ones passes its input through untouched
    (the second calibration pass must not feed a moving average twice, nor redo min/max work), and each
    histogram observer counts what ``calibration.counted_sample`` takes of its input, the values the ONNX
    path's second pass counts (one rule for both paths)."""
    hist = histogram_observers(model)
    others = [obs for _, obs in observers(model) if not _is_histogram(obs)]
    for obs in others:
        obs.forward = _pass_through
    for obs in hist:
        obs.forward = _counting(obs)
    try:
        yield
    finally:
        for obs in (*others, *hist):
            del obs.forward


def _counting(obs: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    counts = type(obs).forward

    def forward(x_orig: torch.Tensor) -> torch.Tensor:
        x = x_orig.detach()
        if x.numel():
            counts(obs, calibration.counted_sample(x, tuple(x.shape)).contiguous())
        return x_orig

    return forward


def _pass_through(x: torch.Tensor) -> torch.Tensor:
    return x


def _op(name: str):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name)


def merge_observers(model: nn.Module, *, n_samples: int | None = None, what: str = "calibration",
                    timeout: float | None = None) -> MergeReport | None:
    """Merge every observer of ``model`` across the ranks (in place); None outside a process group.

    ``n_samples`` (this rank's calibration samples) turns on the agreement first: the ranks'
    models must match and no shard may be empty. The QAT per-step sync passes None (the
    agreement was made once, before training).
    """
    if ranks.world() is None:
        return None

    start = time.perf_counter()
    if n_samples is not None:
        agree(model, n_samples, what=what, timeout=timeout)
    found = observers(model)
    hist = [obs for _, obs in found if _is_histogram(obs)]
    local = [(float(obs.min_val), float(obs.max_val)) for obs in hist]
    n_floats = _min_max_merge(found, what, timeout)
    if hist:
        packed = torch.cat([rebin_histogram(obs.histogram, lo, hi, float(obs.min_val), float(obs.max_val))
                            for obs, (lo, hi) in zip(hist, local)])
        ranks.all_reduce(packed, _op("SUM"), f"{what}: adding histograms", timeout)
        offset = 0
        for obs in hist:
            k = obs.histogram.numel()
            obs.histogram.copy_(packed[offset:offset + k])
            offset += k
        n_floats += packed.numel()
    _refresh_fake_quants(model)
    return MergeReport(len(found), len(hist), n_floats, time.perf_counter() - start)


def _refresh_fake_quants(model: nn.Module) -> None:
    """Recompute each fake-quantizer's scale and zero-point from its (merged) observer."""
    for fq in _fake_quants(model):
        obs = fq.activation_post_process
        if obs.min_val.numel() == 0 or bool(torch.isinf(obs.min_val).any()):
            continue  # nothing observed yet: keep the initial qparams
        scale, zero_point = fq.calculate_qparams()
        fq.scale.resize_(scale.shape).copy_(scale)
        fq.zero_point.resize_(zero_point.shape).copy_(zero_point)


def sync_fake_quant(model: nn.Module, timeout: float | None = None) -> MergeReport | None:
    """QAT: merge the fake-quantizers' observed min/max across ranks (call after every step)."""
    return merge_observers(model, what="QAT fake-quant sync", timeout=timeout)


# -- QAT under DDP (QuantizeCallback) -------------------------------------------------------------
def unwrap_ddp(model: nn.Module) -> tuple[nn.Module | None, nn.Module]:
    """``(the DDP wrapper or None, the module to prepare)``: fake-quantizers go inside the wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model, model.module
    return None, model


def rewrap_ddp(wrapper: nn.Module | None, prepared: nn.Module) -> nn.Module:
    """The prepared model in a new DDP with the old wrapper's settings (the model itself without one).

    A new wrapper is needed: DDP registered gradient hooks on the old parameters, and the prepared
    graph has new ones. Buffers keep DDP's choice (``forward_sync_buffers``): with the per-step merge
    below, rank 0's broadcast observer buffers already equal every rank's.
    """
    if wrapper is None:
        return prepared
    from torch.nn.parallel import DistributedDataParallel

    sync_buffers = getattr(wrapper, "forward_sync_buffers", None)
    extra = {} if sync_buffers is None else {"forward_sync_buffers": sync_buffers}
    return DistributedDataParallel(
        prepared, device_ids=wrapper.device_ids, output_device=wrapper.output_device, dim=wrapper.dim,
        process_group=wrapper.process_group, find_unused_parameters=wrapper.find_unused_parameters,
        gradient_as_bucket_view=wrapper.gradient_as_bucket_view,
        bucket_cap_mb=wrapper.bucket_bytes_cap / 2**20, **extra,
    )


def start_qat_sync(prepared: nn.Module, timeout: float | None = None) -> bool:
    """True inside a process group, once the ranks agreed they train the same prepared model."""
    if ranks.world() is None:
        return False
    agree(prepared, 1, what="QAT", timeout=timeout)
    return True


def place_converted(current: nn.Module, converted: nn.Module, *, user_wrapper: nn.Module | None) -> nn.Module:
    """What goes on ``learn.model`` after conversion.

    A DDP the user wrapped is dropped (an INT8 graph has nothing to train). A DDP that appeared
    after ``before_fit`` is fastai's ``DistributedTrainer`` (``distrib_ctx``), which unwraps
    ``.module`` after us: the converted model goes inside it.
    """
    wrapper, _ = unwrap_ddp(current)
    if wrapper is not None and user_wrapper is None:
        wrapper.module = converted
        return wrapper
    return converted
