"""What each spawned rank runs in test_distributed.py (kept free of pytest so ranks import fast).

Every rank writes what it saw into ``out`` (JSON lines, files); the test reads them after join.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch


def init(rank: int, world: int, out: Path, timeout_s: float = 60.0) -> None:
    """One thread per rank (2 shared cores), a gloo group through a file store in ``out``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ["QUANTSHIP_DIST_TIMEOUT"] = str(timeout_s)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def record(out: Path, rank: int, case: str, **fields) -> None:
    with open(out / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"case": case, **fields}) + "\n")


def attempt(out: Path, rank: int, case: str, body: Callable[[], dict]) -> None:
    """Run one case; record its result or the refusal it raised (type and message)."""
    start = time.perf_counter()
    try:
        fields = body() or {}
        record(out, rank, case, ok=True, seconds=time.perf_counter() - start, **fields)
    except Exception as exc:
        record(out, rank, case, ok=False, error=type(exc).__name__, message=str(exc),
               seconds=time.perf_counter() - start, trace=traceback.format_exc()[-2000:])


def calibrate_and_export(model: torch.nn.Module, shard: list[torch.Tensor], observer: str, sample: torch.Tensor,
                         path: Path) -> dict:
    from quantship import Quantizer, export_qdq

    quantizer = Quantizer(backend="pt2e", act_observer=observer)
    quantized = quantizer.quantize(model, shard, max_calibration_samples=10**6)
    start = time.perf_counter()
    written = export_qdq(quantized, sample, path)
    return {"path": str(written), "export_seconds": time.perf_counter() - start, "merged": quantizer.merged.as_dict()}


def _start(rank: int, world: int, out: Path, state: dict, shards: list, sample: torch.Tensor):
    from quantship.examples import digits

    init(rank, world, out)
    model = digits.build_model()
    model.load_state_dict(state)
    model.eval()
    sample = sample.clone()  # a private copy, not the shared-memory tensor spawn handed over
    shards = [[b.clone() for b in shard] for shard in shards]
    return model, shards, sample


def ptq_rank(rank: int, world: int, out: Path, state: dict, shards: list[list[torch.Tensor]],
             sample: torch.Tensor) -> None:
    """minmax and histogram calibration on this rank's shard; rank 0 writes each file."""
    import torch.distributed as dist

    model, shards, sample = _start(rank, world, out, state, shards, sample)
    for observer in ("minmax", "histogram"):
        attempt(out, rank, observer,
                lambda o=observer: calibrate_and_export(model, shards[rank], o, sample, out / f"{o}.onnx"))
    dist.destroy_process_group()


def observer_set() -> torch.nn.ModuleDict:
    """One observer of each kind quantship uses, symmetric int8 per tensor (per channel for weights)."""
    from torchao.quantization.pt2e import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver

    from quantship.quantize.observers import MSEObserver, PercentileObserver

    act = {"dtype": torch.int8, "quant_min": -128, "quant_max": 127, "qscheme": torch.per_tensor_symmetric}
    return torch.nn.ModuleDict({
        "minmax": MinMaxObserver(**act),
        "per_channel": PerChannelMinMaxObserver(ch_axis=0, dtype=torch.int8, quant_min=-127, quant_max=127,
                                                qscheme=torch.per_channel_symmetric),
        "histogram": HistogramObserver(**act),
        "percentile": PercentileObserver(**act),
        "mse": MSEObserver(**act),
    })


def observer_data(rank: int) -> list[torch.Tensor]:
    """Rank r's batches: heavy-tailed values whose range differs from rank to rank."""
    torch.manual_seed(100 + rank)
    return [torch.distributions.StudentT(3.0).sample((4, 256)) * (1 + rank) + 0.5 * rank for _ in range(4)]


def qparams_of(observers: torch.nn.ModuleDict) -> dict:
    return {name: [obs.calculate_qparams()[0].tolist(), obs.min_val.tolist(), obs.max_val.tolist()]
            for name, obs in observers.items()}


def merged_observers(rank: int, world: int) -> dict:
    from quantship.quantize.distributed import merge_observers

    observers = observer_set()
    for x in observer_data(rank):
        for obs in observers.values():
            obs(x)
    report = merge_observers(observers, n_samples=16)
    return {"qparams": qparams_of(observers), "n_floats": report.n_floats, "n_histograms": report.n_histograms}


class Feed(torch.nn.Module):
    """A "model" that shows every batch to each of its observers (what calibration does, layer by layer)."""

    def __init__(self, observers: torch.nn.ModuleDict):
        super().__init__()
        self.observers = observers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for obs in self.observers.values():
            obs(x)
        return x


def histograms_of(observers: torch.nn.ModuleDict) -> dict:
    return {name: obs.histogram.tolist() for name, obs in observers.items() if hasattr(obs, "histogram")}


def calibrated_observers(rank: int, world: int) -> dict:
    """The calibration protocol (ranges, then histograms on the merged range), then the merge."""
    from quantship.quantize.calibration import run_batches
    from quantship.quantize.distributed import merge_observers

    observers = observer_set()
    batches = observer_data(rank)
    run_batches(Feed(observers), batches)
    merge_observers(observers, n_samples=sum(len(b) for b in batches))
    return {"qparams": qparams_of(observers), "histograms": histograms_of(observers)}


def bad_input_rank(rank: int, world: int, out: Path, state: dict, shards: list[list[torch.Tensor]],
                   sample: torch.Tensor) -> None:
    """Different models, an empty shard, then export_qdq called on rank 1 alone."""
    from quantship import Quantizer, export_qdq
    from quantship.examples.models import TinyResNet

    model, shards, sample = _start(rank, world, out, state, shards, sample)
    attempt(out, rank, "observers", lambda: merged_observers(rank, world))
    attempt(out, rank, "calibrated_observers", lambda: calibrated_observers(rank, world))
    # rank 1 quantizes a narrower model: refused on both ranks, after calibration, without a hang
    other = model if rank == 0 else TinyResNet(in_channels=1, classes=10, width=8).eval()
    attempt(out, rank, "structure", lambda: calibrate_and_export(other, shards[rank], "minmax", sample,
                                                                  out / "structure.onnx"))
    # rank 1 has an empty shard: refused on both ranks before any model work
    shard = shards[rank] if rank == 0 else []
    attempt(out, rank, "empty", lambda: calibrate_and_export(model, shard, "minmax", sample, out / "empty.onnx"))
    quantized = Quantizer(backend="pt2e", act_observer="minmax").quantize(model, shards[rank])
    # export_qdq called on rank 1 only: refused there after the (short) timeout; rank 0 waits for that
    if rank == 1:
        os.environ["QUANTSHIP_DIST_TIMEOUT"] = "3"
        attempt(out, rank, "export_one_rank", lambda: {"path": str(export_qdq(quantized, sample, out / "one.onnx"))})
        (out / "rank1_done").touch()
    else:
        while not (out / "rank1_done").exists():
            time.sleep(0.1)
    # rank 1 left a collective in flight: leave without destroy_process_group (it would wait for it)
    os._exit(0)


def qat_fit(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, x_valid: torch.Tensor, y_valid: torch.Tensor,
            bs: int) -> torch.nn.Module:
    """One epoch of pt2e QAT with fastai on (x, y); ``model`` may be wrapped in DDP. Returns the INT8 model."""
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.torch_core import set_seed
    from torch.nn import CrossEntropyLoss

    from quantship import QuantizeCallback

    set_seed(0)
    dls = DataLoaders.from_dsets(list(zip(x, y)), list(zip(x_valid, y_valid)), bs=bs, device="cpu", num_workers=0)
    learn = Learner(dls, model, loss_func=CrossEntropyLoss())
    with learn.no_logging():
        learn.fit(1, lr=1e-3, cbs=[QuantizeCallback(backend="pt2e")])
    return learn.model


def qat_rank(rank: int, world: int, out: Path, state: dict, data: dict, bs: int) -> None:
    """pt2e QAT under DDP on this rank's shard; the file rank 0 writes, then each rank's own file."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from quantship import export_qdq
    from quantship.examples import digits

    init(rank, world, out, timeout_s=120.0)
    data = {k: v.clone() for k, v in data.items()}
    model = digits.build_model()
    model.load_state_dict(state)
    x, y = data["x_train"][rank::world], data["y_train"][rank::world]

    def fit() -> dict:
        start = time.perf_counter()
        quantized = qat_fit(DistributedDataParallel(model.train()), x, y, data["x_valid"], data["y_valid"], bs)
        fit_s = time.perf_counter() - start
        k, n = digits.evaluate(quantized, data["x_test"], data["y_test"], batch_size=bs)
        shared = export_qdq(quantized, data["sample"], out / "qat.onnx")  # rank 0 writes, rank 1 waits
        dist.destroy_process_group()
        own = export_qdq(quantized, data["sample"], out / f"qat_rank{rank}.onnx")  # one process each
        return {"k": k, "n": n, "fit_seconds": fit_s, "shared": str(shared), "own": str(own),
                "type": type(quantized).__name__}

    attempt(out, rank, "qat", fit)
    os._exit(0)
