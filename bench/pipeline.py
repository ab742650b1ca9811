"""Cold pipeline cost: quantship (quantize + export_qdq) next to the raw torchao + dynamo exporter path.

Both paths quantize the same untrained torchvision model with the same annotator
(``QuantshipQuantizer`` of the preset's spec) on the same batches. The raw path is what a user
writes by hand: ``torch.export`` -> ``prepare_pt2e`` -> calibrate -> ``convert_pt2e`` ->
``torch.onnx.export(dynamo=True)`` -> save, with no checks, once at the sample's static batch ("raw")
and once writing the same kind of file as quantship when the target's preset serves any batch ("raw,
any batch": the batch symbolic at capture and export, which costs the exporter more). quantship's path
adds its own checks (each rewrite byte-identical in ONNX Runtime, post-conditions on the file, the
target's rules, the file's two readings against torch).

Every run is a fresh process, so imports and first-call costs count and the peak RSS is its own.
Runs alternate between the paths; the table gives medians (wall and CPU seconds, CPU being
less sensitive to other processes on a shared machine) and the ratios quantship / raw.

    python bench/pipeline.py [--models resnet18] [--batch 8] [--size 224] [--repeat 3]

``--warm``: in one process, after one warm-up call of each, ``export_qdq`` of a converted model next
to the raw ``torch.onnx.export(dynamo=True)`` + save of the same converted model (same batch dimension:
symbolic when the target's preset asks for it), repetitions interleaved, for every ``--targets``. The raw
call is ``torch.onnx.export`` as is, which builds its table of ONNX translations on every call (0.36 s
warm); ``export_qdq`` builds it once per process (``quantship.export.capture.one_registry``);
``--profile`` adds the cProfile of one ``export_qdq`` call (cumulative time).

    python bench/pipeline.py --warm [--targets onnxruntime-cpu tensorrt] [--batch 8] [--repeat 5] [--profile]

``--report FILE`` runs the cold table, then the warm one at ``--batch`` and at batch 1, and writes the three
to FILE (BENCHMARKS-pipeline.md is ``--report BENCHMARKS-pipeline.md --repeat 5``); with ``--batch 1`` the
two warm tables would be the same one, and it is written once.

``--smoke``: ``--report`` into a temporary file (or the ``--report`` given) for resnet18 at 32x32, batch 1,
one repetition, the onnxruntime-cpu target only (bench/_smoke.py); with ``--warm``, that warm table only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent

# The raw path at the sample's static batch, the raw path writing what quantship writes for a preset that
# serves any batch (batch symbolic at capture and export), and quantship.
PATHS = ("raw", "raw, any batch", "quantship")
STAGES = ("imports", "capture", "prepare", "calibrate", "convert", "export", "checks")


class Clock:
    """Wall and CPU seconds per stage, and the peak RSS when each stage ended."""

    def __init__(self) -> None:
        self.stages: dict[str, dict[str, float]] = {}
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def lap(self, stage: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        entry = self.stages.setdefault(stage, {"wall_s": 0.0, "cpu_s": 0.0})
        entry["wall_s"] += wall - self._wall
        entry["cpu_s"] += cpu - self._cpu
        entry["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        self._wall, self._cpu = wall, cpu


def _float_model(model_name: str, batch: int, size: int):
    """The untrained torchvision model (seed 0) and 4 calibration batches, the same for every path."""
    import torch
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(weights=None).eval()
    g = torch.Generator().manual_seed(1)
    return model, [torch.randn(batch, 3, size, size, generator=g) for _ in range(4)]


def run_raw(model_name: str, batch: int, size: int, target: str, clock: Clock, dynamic: bool = False) -> None:
    """The hand-written torchao + exporter path, one stage at a time; ``dynamic``: the batch dimension
    symbolic at capture and export, as in the file quantship writes when the preset serves any batch."""
    import torch
    import torchvision  # noqa: F401  (imported here, so that the "imports" stage times it)
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from quantship import resolve_spec
    from quantship.quantize import QuantshipQuantizer
    from quantship.targets import get as preset

    clock.lap("imports")
    model, calib = _float_model(model_name, batch, size)
    clock.lap("model")
    shapes = ({0: torch.export.Dim("batch")},) if dynamic else None
    example = _example(calib[0], dynamic)
    graph = torch.export.export(model, (example,), dynamic_shapes=shapes, strict=False).module()
    clock.lap("capture")
    prepared = prepare_pt2e(graph, QuantshipQuantizer(resolve_spec(**preset(target).spec_kwargs)))
    clock.lap("prepare")
    with torch.no_grad():
        for x in calib:
            prepared(x)
    clock.lap("calibrate")
    converted = convert_pt2e(prepared)
    clock.lap("convert")
    with tempfile.TemporaryDirectory() as tmp:
        shapes = ({0: torch.export.Dim.DYNAMIC},) if dynamic else None
        program = torch.onnx.export(converted, (example,), None, dynamo=True, opset_version=18, verbose=False,
                                    dynamic_shapes=shapes)
        program.save(str(Path(tmp) / "model.onnx"))
        clock.lap("export")


def _example(sample, dynamic: bool):
    """The example a symbolic batch is captured with: a batch of 1 is doubled (torch.export specialises a
    size-1 dimension to the constant 1 and refuses to keep it symbolic)."""
    import torch

    return torch.cat([sample, sample]) if dynamic and sample.shape[0] == 1 else sample


# the steps quantship marks (quantship.progress) that are a stage of the raw path, by the start of their label
STEP_STAGES = (("quantize: capture", "capture"), ("quantize: insert observers", "prepare"),
               ("quantize: calibrating", "calibrate"), ("quantize: convert", "convert"),
               ("export: torch.onnx.export", "export"))


class StageListener:
    """Listens to quantship's marked steps: a step's start closes ``gap`` on the clock, its end closes its stage."""

    def __init__(self, clock: Clock, gap: str) -> None:
        self.clock, self.gap = clock, gap

    def __call__(self, event: str, current) -> None:
        from quantship.progress import END, START

        stage = next((s for prefix, s in STEP_STAGES if current.label.startswith(prefix)), None)
        if stage is not None and event in (START, END):
            self.clock.lap(self.gap if event == START else stage)


def run_quantship(model_name: str, batch: int, size: int, target: str, clock: Clock) -> None:
    """``Quantizer.for_target(target).quantize`` then ``export_qdq``; stages read at their boundaries."""
    import torch  # noqa: F401  (imported here, so that the "imports" stage times it, as on the raw path)
    import torchvision  # noqa: F401

    from quantship import Quantizer, export_qdq

    clock.lap("imports")
    model, calib = _float_model(model_name, batch, size)
    clock.lap("model")
    from quantship.progress import listening

    listener = StageListener(clock, "quantize: copy, checks")
    with listening(listener):
        qmodel = Quantizer.for_target(target).quantize(model, calib, max_calibration_samples=len(calib) * batch)
    clock.lap("quantize: copy, checks")
    listener.gap = "checks"
    with tempfile.TemporaryDirectory() as tmp, listening(listener):
        export_qdq(qmodel, calib[0], Path(tmp) / "model.onnx")
        clock.lap("checks")


def run_one(path: str, model_name: str, batch: int, size: int, target: str) -> dict:
    warnings.filterwarnings("ignore")
    clock = Clock()
    if path == "quantship":
        run_quantship(model_name, batch, size, target, clock)
    else:
        run_raw(model_name, batch, size, target, clock, dynamic=path == "raw, any batch")
    stages = clock.stages
    work = [s for s in stages if s != "model"]  # building the float model and data is not the pipeline's
    return {"path": path, "stages": stages,
            "wall_s": sum(stages[s]["wall_s"] for s in work), "cpu_s": sum(stages[s]["cpu_s"] for s in work),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _fresh(path: str, args: argparse.Namespace, model_name: str) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, __file__, "--one", path, "--models", model_name, "--batch", str(args.batch),
                          "--size", str(args.size), "--target", args.target],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"the {path!r} run of {model_name} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _raw_export(converted, sample, path: Path, dynamic: bool) -> None:
    """What a user writes by hand: the dynamo exporter, then save; no checks."""
    import torch

    x = _example(sample, dynamic)
    shapes = ({0: torch.export.Dim.DYNAMIC},) if dynamic else None
    program = torch.onnx.export(converted, (x,), None, dynamo=True, opset_version=18, verbose=False,
                                dynamic_shapes=shapes)
    program.save(str(path))


class Spent:
    """Wall and CPU seconds spent inside chosen functions during export_qdq, by part."""

    PARTS = {"exporter": [("quantship.export.qdq", "produce")],
             "torch reference": [("quantship.export.qdq", "reference_outputs")],
             "ORT sessions + runs": [(m, f) for m in ("quantship.export.checks", "quantship.export.qdq",
                                                     "quantship.inspect.run.verify") for f in ("ort_session", "run_session")]}

    def __init__(self) -> None:
        import importlib

        self.seconds = {part: [0.0, 0.0] for part in self.PARTS}
        self._depth = 0
        for part, names in self.PARTS.items():
            for module_name, name in names:
                module = importlib.import_module(module_name)
                if not hasattr(module, name):  # a renamed function would time nothing, silently
                    raise RuntimeError(f"bench/pipeline.py times {module_name}.{name}, which no longer exists: "
                                       "name the function that now does that part")
                setattr(module, name, self._wrap(part, getattr(module, name)))

    def _wrap(self, part: str, real):
        def wrapper(*args, **kwargs):
            self._depth += 1
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return real(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:  # the outermost call only (verify's helpers call each other)
                    self.seconds[part][0] += time.perf_counter() - wall
                    self.seconds[part][1] += time.process_time() - cpu
        return wrapper

    def take(self) -> dict[str, tuple[float, float]]:
        out = {part: (w, c) for part, (w, c) in self.seconds.items()}
        self.seconds = {part: [0.0, 0.0] for part in self.PARTS}
        return out


def warm(args: argparse.Namespace) -> int:
    """Warm export_qdq vs the raw exporter of the same converted model, one process, interleaved."""
    import cProfile
    import pstats

    from quantship import Quantizer, export_qdq
    from quantship.targets import get as preset

    warnings.filterwarnings("ignore")
    spent = Spent()
    parts: list[str] = []
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; warm (one process, one "
          f"warm-up call each), medians of {args.repeat} interleaved repetitions; wall and CPU seconds\n")
    print("| model | target | batch | raw wall s | export_qdq wall s | ratio wall | raw CPU s | export_qdq CPU s "
          "| ratio CPU | ratio wall, every rep |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    profiles = []
    for name in args.models:
        model, calib = _float_model(name, args.batch, args.size)
        for target in args.targets:
            converted = Quantizer.for_target(target).quantize(model, calib, max_calibration_samples=len(calib) * args.batch)
            dynamic = preset(target).dynamic_batch
            with tempfile.TemporaryDirectory() as tmp:
                paths = {"raw": Path(tmp) / "raw.onnx", "quantship": Path(tmp) / "quantship.onnx"}
                calls = {"raw": functools.partial(_raw_export, converted, calib[0], paths["raw"], dynamic),
                         "quantship": functools.partial(export_qdq, converted, calib[0], paths["quantship"],
                                                        target=target)}
                times: dict[str, list[tuple[float, float]]] = {"raw": [], "quantship": []}
                inside: list[dict[str, tuple[float, float]]] = []
                for call in calls.values():  # warm-up
                    call()
                spent.take()
                for rep in range(args.repeat):
                    order = list(calls) if rep % 2 == 0 else list(calls)[::-1]
                    for key in order:
                        wall, cpu = time.perf_counter(), time.process_time()
                        calls[key]()
                        times[key].append((time.perf_counter() - wall, time.process_time() - cpu))
                        if key == "quantship":
                            inside.append(spent.take())
                if args.profile:
                    profiler = cProfile.Profile()
                    profiler.runcall(calls["quantship"])
                    out = io.StringIO()
                    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats("quantship|onnxruntime|onnx_ir|/onnx/", args.profile)
                    profiles.append((f"{name} {target}", out.getvalue()))
            med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
            (rw, rc), (qw, qc) = med["raw"], med["quantship"]
            each = [round(q[0] / r[0], 2) for r, q in zip(times["raw"], times["quantship"])]
            print(f"| {name} | {target} | {args.batch} | {rw:.2f} | {qw:.2f} | **{qw / rw:.2f}x** | {rc:.2f} | {qc:.2f} "
                  f"| {qc / rc:.2f}x | {each} |", flush=True)
            cells = []
            for part in Spent.PARTS:
                w, c = (statistics.median(d[part][i] for d in inside) for i in (0, 1))
                cells.append(f"{part} {w:.2f} s wall ({w / rw:.2f}x raw), {c:.2f} s CPU ({c / rc:.2f}x raw)")
            rest = [statistics.median(t[i] - sum(d[p][i] for p in Spent.PARTS) for t, d in zip(times["quantship"], inside))
                    for i in (0, 1)]
            cells.append(f"the rest (passes, post-conditions, save) {rest[0]:.2f} s wall ({rest[0] / rw:.2f}x raw), "
                         f"{rest[1]:.2f} s CPU ({rest[1] / rc:.2f}x raw)")
            parts.append(f"- {name} {target} batch {args.batch}, inside export_qdq (medians): " + "; ".join(cells))
    print("\n" + "\n".join(parts))
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")
    for title, text in profiles:
        print(f"\n### cProfile, one export_qdq call: {title}\n\n```\n{text.strip()}\n```")
    return 0


def _median(runs: list[dict], *keys: str) -> float:
    values = []
    for r in runs:
        value = r
        for k in keys:
            value = value.get(k, {}) if isinstance(value, dict) else {}
        values.append(value if isinstance(value, float) else 0.0)
    return statistics.median(values)


class _Tee(io.TextIOBase):
    """Standard output that also goes to a list of lines."""

    def __init__(self, out) -> None:
        self.out, self.text = out, []

    def write(self, text: str) -> int:
        self.text.append(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def report(args: argparse.Namespace, path: Path) -> int:
    """The cold table, then the warm one at ``--batch`` and at batch 1 (once if ``--batch`` is 1), written to ``path``."""
    import _smoke

    tee = _Tee(sys.stdout)
    runs = [("Cold: one fresh process per run, quantize + export", {"warm": False}),
            (f"Warm: export_qdq vs the raw exporter in one process, batch {args.batch}", {"warm": True}),
            ("Warm: export_qdq vs the raw exporter in one process, batch 1", {"warm": True, "batch": 1})]
    if args.batch == 1:
        runs.pop()  # the warm table at --batch is the one at batch 1
    with contextlib.redirect_stdout(tee):
        print("\n".join(["# Pipeline cost", "", *_smoke.banner(args)]))
        print(f"Generated by `python bench/pipeline.py --report {path.name} --repeat {args.repeat}`; "
              "do not edit by hand. What each table compares is in the script's docstring.")
        for title, change in runs:
            print(f"\n## {title}\n")
            (warm if change.get("warm") else cold)(argparse.Namespace(**{**vars(args), **change}))
    path.write_text("".join(tee.text))
    return 0


def main(argv: list[str] | None = None) -> int:
    import _smoke

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--target", default="onnxruntime-cpu")
    parser.add_argument("--repeat", type=int, default=3, help="fresh runs per path (medians are reported)")
    parser.add_argument("--warm", action="store_true", help="warm export_qdq vs the raw exporter, one process")
    parser.add_argument("--targets", nargs="+", default=["onnxruntime-cpu", "tensorrt"], help="--warm: targets")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="--warm: print the N costliest functions of quantship, onnx and ORT in one export_qdq call "
                             "(cProfile, cumulative)")
    parser.add_argument("--report", metavar="FILE",
                        help="run the cold table, then --warm at --batch and at batch 1, and write all three to FILE")
    parser.add_argument("--one", choices=PATHS, help=argparse.SUPPRESS)
    args = _smoke.parse_args(parser, argv, batch=1, size=32, repeat=1, targets=["onnxruntime-cpu"])
    if args.smoke and not (args.warm or args.one):
        args.report = _smoke.output(args, args.report and Path(args.report), ROOT / "BENCHMARKS-pipeline.md")
    if args.report:
        return report(args, Path(args.report))
    if args.warm:
        return warm(args)
    if args.one:
        print(json.dumps(run_one(args.one, args.models[0], args.batch, args.size, args.target)))
        return 0
    return cold(args)


def cold(args: argparse.Namespace) -> int:
    """Fresh processes per path, alternating; medians per stage, and the ratios quantship / raw."""
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"medians of {args.repeat} fresh run(s) per path, runs alternating")
    from quantship.targets import get as preset

    paths = [p for p in PATHS if p != "raw, any batch" or preset(args.target).dynamic_batch]
    for name in args.models:
        runs: dict[str, list[dict]] = {p: [] for p in paths}
        for _ in range(args.repeat):
            for path in runs:
                runs[path].append(_fresh(path, args, name))
        print(f"\n{name}, batch {args.batch}, {args.size}x{args.size}, target {args.target}\n")
        print("| stage | " + " | ".join(f"{p} wall s | {p} CPU s" for p in paths) + " | peak RSS MB " + " / ".join(paths) + " |")
        print("|---|" + "---|---|" * len(paths) + "---|")
        stages = [s for s in (*STAGES, "quantize: copy, checks") if any(s in r["stages"] for rs in runs.values() for r in rs)]
        for stage in stages:
            cells = [f"{_median(runs[p], 'stages', stage, k):.2f}" for p in runs for k in ("wall_s", "cpu_s")]
            rss = " / ".join(f"{_median(runs[p], 'stages', stage, 'peak_rss_mb'):.0f}" for p in runs)
            print(f"| {stage} | {' | '.join(cells)} | {rss} |")
        total = {p: (_median(rs, "wall_s"), _median(rs, "cpu_s"), _median(rs, "peak_rss_mb")) for p, rs in runs.items()}
        cells = " | ".join(f"{w:.2f} | {c:.2f}" for w, c, _ in total.values())
        print(f"| **total** | {cells} | {' / '.join(f'{m:.0f}' for _, _, m in total.values())} |\n")
        qw, qc, qm = total["quantship"]
        for p in paths[:-1]:
            rw, rc, rm = total[p]
            print(f"quantship / {p}: wall {qw / rw:.2f}x, CPU {qc / rc:.2f}x, peak RSS {qm / rm:.2f}x")
        print("every wall run: " + "; ".join(f"{p} {[round(r['wall_s'], 1) for r in runs[p]]}" for p in paths)
              + "; every peak RSS: " + "; ".join(f"{p} {[round(r['peak_rss_mb']) for r in runs[p]]}" for p in paths),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
