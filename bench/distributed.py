"""Calibration across torch.distributed ranks: wall time with 1 and 2 ranks, and what the merge costs.

One run, on the digits task (trained TinyResNet, 32x32 inputs), 1,408 calibration samples
(44 batches of 32): one process calibrates on all of them, then two gloo ranks (spawned here,
CPU, one thread each) calibrate on half each and merge their observers. For each observer
(minmax, histogram) it prints the calibration wall time (the batches, then the merge), the merge
alone, and the floats each rank sends. The timer starts after a barrier, so both ranks begin
together; a rank's merge time includes waiting for the slower one, so the merge overhead is read
on the rank that arrived last.

Then, on paper, what N machines would take: the batches split N ways, plus one merge whose size
does not depend on N (an all-reduce of the same floats; a ring sends about 2 (N-1)/N of them per
rank). The 1-rank figure is also given with 2 threads, the fair baseline on a 2-core machine.

Run: ``PYTHONPATH=src .venv/bin/python bench/distributed.py`` (about a minute on a quiet 2-core
machine). Prints Markdown. ``--smoke``: 4 batches instead of 44, every table still printed (bench/_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
OBSERVERS = ("minmax", "histogram")
BS = 32
N_BATCHES = 44  # 1,408 samples (the digits training split holds 1,437)


CALIBRATING = "quantize: calibrating"  # the label of quantship's calibration steps (quantship.progress)


class CalibrationClock:
    """Listens to quantship's marked steps: from the first calibration step's start (after a barrier in a process
    group, so the ranks begin together) to the last one's end, wall and CPU seconds."""

    def __init__(self) -> None:
        self.start = self.cpu = None
        self.times: dict = {}

    def __call__(self, event: str, current) -> None:
        import torch.distributed as dist

        from quantship.progress import END, START

        if not current.label.startswith(CALIBRATING):
            return
        if event == START and self.start is None:
            if dist.is_initialized():
                dist.barrier()
            self.start, self.cpu = time.perf_counter(), time.process_time()
        elif event == END:
            self.times["calibrate_s"] = time.perf_counter() - self.start
            self.times["calibrate_cpu_s"] = time.process_time() - self.cpu


def timed_quantize(model: torch.nn.Module, batches: list[torch.Tensor], observer: str) -> dict:
    """Quantize with pt2e; the calibration wall and CPU times (its marked steps) and the merge
    (``Quantizer.merged``: seconds, observers, floats sent)."""
    from quantship import Quantizer
    from quantship.progress import listening

    clock = CalibrationClock()
    quantizer = Quantizer(backend="pt2e", act_observer=observer)
    with warnings.catch_warnings(), listening(clock):
        warnings.simplefilter("ignore")
        quantizer.quantize(model, batches, max_calibration_samples=10**6)
    merged = quantizer.merged
    if merged is None:
        return {**clock.times, "merge_s": 0.0, "n_floats": 0, "n_observers": 0}
    return {**clock.times, "merge_s": merged.seconds, "n_floats": merged.n_floats, "n_observers": merged.n_observers}


def rank_main(rank: int, world: int, out: str, state: dict, batches: list[torch.Tensor]) -> None:
    import datetime

    import torch.distributed as dist

    from quantship.examples import digits

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    model = digits.build_model()
    model.load_state_dict(state)
    model.eval()
    shard = [b.clone() for b in batches[rank::world]]
    results = {observer: timed_quantize(model, shard, observer) for observer in OBSERVERS}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def two_ranks(state: dict, batches: list[torch.Tensor]) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_main, args=(2, out, state, batches), nprocs=2, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def qat_floats_per_step(model: torch.nn.Module, example: torch.Tensor) -> tuple[int, int]:
    """Observers in the pt2e QAT graph and the floats one per-step sync sends (2 per observed value)."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

    from quantship import Quantizer
    from quantship.quantize import QuantshipQuantizer

    spec = Quantizer(backend="pt2e").spec
    graph = torch.export.export(model.train(), (example,), strict=False).module()  # a pt2e QAT capture
    prepared = prepare_qat_pt2e(graph, QuantshipQuantizer(spec, is_qat=True))
    prepared(example)  # per-channel observers size their buffers on the first batch
    # what the per-step sync merges: every module with min_val / max_val buffers (observers, inside fake-quants too)
    found = [m for m in prepared.modules()
             if {"min_val", "max_val"} <= {name for name, _ in m.named_buffers(recurse=False)}]
    return len(found), 2 * sum(obs.min_val.numel() for obs in found)


def main(argv: list[str] | None = None) -> None:
    import _smoke

    from quantship.examples import digits
    from quantship.inspect import cpu_info

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=N_BATCHES, help=f"calibration batches of {BS} (default {N_BATCHES})")
    args = _smoke.parse_args(parser, argv, batches=4)
    split = digits.load_split()
    model = digits.trained_model()
    batches = list(split.x_train[: args.batches * BS].split(BS))
    n = sum(b.shape[0] for b in batches)

    single: dict[int, dict] = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        single[threads] = {observer: timed_quantize(model, batches, observer) for observer in OBSERVERS}
    torch.set_num_threads(1)
    ranked = two_ranks(model.state_dict(), batches)

    print(f"## Distributed calibration, digits TinyResNet, {n} samples ({len(batches)} batches of {BS})\n")
    name, flags = cpu_info()
    print(f"CPU: {name} (AVX-512 VNNI: {'yes' if 'avx512_vnni' in flags else 'no'}), {os.cpu_count()} logical "
          f"cores; load average at the end {os.getloadavg()[0]:.1f}. On a loaded machine the wall times measure "
          "the scheduler as much as the code; the CPU seconds (time.process_time) do not: with a core per rank, "
          "the wall time would be the slower rank's CPU time plus the merge.\n")
    print("| observer | 1 rank, 1 thread: wall (CPU) s | 1 rank, 2 threads: wall s | 2 ranks, 1 thread each: "
          "wall, batches + merge (s) | CPU s per rank | merge overhead (s) | 2 ranks / 1 rank: wall, CPU-based "
          "| floats sent per rank |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    paper = {}
    for observer in OBSERVERS:
        one, two_threads = single[1][observer]["calibrate_s"], single[2][observer]["calibrate_s"]
        walls = [r[observer]["calibrate_s"] + r[observer]["merge_s"] for r in ranked]
        last = max(range(2), key=lambda r: ranked[r][observer]["calibrate_s"])  # arrived last: no waiting
        overhead = ranked[last][observer]["merge_s"]
        floats = ranked[0][observer]["n_floats"]
        one_cpu = single[1][observer]["calibrate_cpu_s"]
        cpus = [r[observer]["calibrate_cpu_s"] for r in ranked]
        paper[observer] = (one_cpu, overhead, floats)
        print(f"| {observer} | {one:.2f} ({one_cpu:.2f}) | {two_threads:.2f} | {max(walls):.2f} "
              f"| {' / '.join(f'{c:.2f}' for c in cpus)} | {overhead:.3f} | {max(walls) / one:.2f}x, "
              f"{(max(cpus) + overhead) / one_cpu:.2f}x | {floats:,} ({ranked[0][observer]['n_observers']} observers) |")

    n_obs, qat_floats = qat_floats_per_step(digits.trained_model(), batches[0])
    print(f"\nQAT: the per-step sync all-reduces {qat_floats} floats ({n_obs} observers: 2 per per-tensor "
          "observer, 2 per channel of a per-channel one), once per batch.\n")
    print("### On paper: N machines, one process each (from the 1-rank CPU time and the merge measured above)\n")
    print("Each rank runs 1/N of the batches; the merge sends the same floats whatever N (an all-reduce; a ring "
          "moves about 2 (N-1)/N of them per rank), plus two 2 KiB agreements. Merge time is taken as measured "
          "on 2 ranks (latency-bound at these sizes; a network adds its round trips).\n")
    print("| observer | N | batches (s) | + merge (s) | expected wall (s) | speed-up | bytes per rank per merge |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for observer, (one, overhead, floats) in paper.items():
        for machines in (1, 2, 4, 8, 16):
            merge_s = 0.0 if machines == 1 else overhead
            wall = one / machines + merge_s
            sent = 0 if machines == 1 else int(2 * (machines - 1) / machines * floats * 8)
            print(f"| {observer} | {machines} | {one / machines:.2f} | {merge_s:.3f} | {wall:.2f} "
                  f"| {one / wall:.2f}x | {sent:,} |")


if __name__ == "__main__":
    main()
