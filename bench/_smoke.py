"""``--smoke``, shared by the bench scripts: the smallest run that still goes through a script's whole table.

A smoke run takes the script's smallest model and input, one repetition and the fewest batches or trials,
and still quantizes, exports, times and renders every part of the table, so that a test can run each
script end to end (tests/test_bench_smoke.py) and a bench cannot break while its published table stays.
Its figures mean nothing, and it never writes a file the repository publishes: without an ``--out`` it
writes into a fresh temporary directory, and it refuses an ``--out`` that names a published file.

Each script passes its smallest values to ``parse_args``; they replace the script's defaults only, so an
argument given on the command line still wins (``--smoke --out somewhere.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what the bench scripts publish: a smoke run writes none of them
PUBLISHED = tuple(ROOT / name for name in ("BENCHMARKS.md", "BENCHMARKS-LM.md", "BENCHMARKS-LM-static.md",
                                           "BENCHMARKS-LM-latency.md", "BENCHMARKS-pipeline.md", "ZOO.md",
                                           "bench/zoo_results.json", "ZOO-segmentation.md", "ZOO-yolo.md", "ZOO-speed.md",
                                           "bench/zoo_speed_results.json",
                                           "bench/segmentation_results.json", "ZOO-detection.md",
                                           "bench/detection_results.json", "bench/placement_results.md",
                                           "bench/lm_decode_results.md", "bench/lm_embedding_results.md"))
HELP = ("smallest run that goes through the whole table (tiny model, one repetition; figures meaningless), "
        "for the test suite; writes no published file")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None, **smallest) -> argparse.Namespace:
    """``parser``'s arguments plus ``--smoke``; with ``--smoke``, ``smallest`` replaces the defaults it names."""
    parser.add_argument("--smoke", action="store_true", help=HELP)
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--smoke" in argv:
        unknown = set(smallest) - {a.dest for a in parser._actions}
        if unknown:
            raise TypeError(f"smoke values for arguments the parser does not have: {sorted(unknown)}")
        parser.set_defaults(**smallest)
    return parser.parse_args(argv)


def banner(args: argparse.Namespace) -> list[str]:
    """The first lines of a file a smoke run writes (none otherwise)."""
    return ["**Smoke run** (`--smoke`: tiny models, one repetition): these figures mean nothing.", ""] if args.smoke else []


LM_TOKENS = 16  # tokens per window of the smoke LM


def cpu_lines(title: str) -> list[str]:
    """A table's heading and the CPU line under it: model, int8 extensions, cores, load at the start."""
    import os

    from quantship.inspect import cpu_info

    cpu, flags = cpu_info()
    int8 = ", ".join(f for f in ("avx2", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags) or "no int8 extension"
    return [f"# {title}", "", f"CPU: {cpu} ({int8}), {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at "
            "the start (a shared machine: times are indicative).", ""]


def tiny_lm():
    """The reference LM's architecture (``quantship.examples.lm``) at its smallest useful size, untrained:
    one layer, hidden 128 (every Linear's input a multiple of the 128-wide weight-only groups)."""
    import torch

    from quantship.examples import lm

    torch.manual_seed(0)
    return lm.build_model(hidden=128, layers=1, heads=2, intermediate=256)


def scratch(name: str) -> Path:
    """A path named ``name`` in a new temporary directory (left behind for the reader)."""
    return Path(tempfile.mkdtemp(prefix="quantship-smoke-")) / name


def output(args: argparse.Namespace, path: Path | None, published: Path) -> Path:
    """Where the script writes: ``path`` if given, else ``published``; in a smoke run a temporary file
    instead of ``published``, and never a published file."""
    if path is None:
        path = scratch(published.name) if args.smoke else published
    if args.smoke and Path(path).resolve() in {p.resolve() for p in PUBLISHED}:
        raise SystemExit(f"--smoke does not write {path}: it is a published file (give an --out elsewhere)")
    return Path(path)


def stamp(script: str) -> tuple[str, str]:
    """(commit, CPU) for a bench record: HEAD, ``+dirty`` when src/ or ``script`` (bench/NAME.py) differ from
    it (what this process runs); the CPU's name and which of its int8 extensions it has."""
    import subprocess

    from quantship.inspect import cpu_info

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short=7", "HEAD") + ("+dirty" if git("status", "--porcelain", "--", "src", script)
                                                      else "")
    name, flags = cpu_info()
    return commit, f"{name} ({', '.join(sorted({'avx512_vnni', 'amx_int8', 'avx2'} & flags)) or 'no VNNI'})"


def record_models(args: argparse.Namespace, script: str, table: Path, results: Path, run_model, render) -> None:
    """A records bench's main loop: ``--out`` / ``--results`` resolved (a smoke run's records beside its
    table), each of ``args.models`` measured by ``run_model(model, tmp_dir)`` unless ``--render``, stamped
    (``stamp``) and merged into the records file as it finishes, then ``render(records, banner)`` written."""
    args.out = output(args, args.out, table)
    if args.smoke and args.results is None:
        args.results = args.out.with_name(results.name)
    args.results = output(args, args.results, results)
    records = json.loads(args.results.read_text()) if args.results.exists() else {}
    if not args.render:
        commit, cpu = stamp(script)
        with tempfile.TemporaryDirectory() as tmp:
            for model in args.models:
                row = run_model(model, Path(tmp))
                row.update(commit=commit, cpu=cpu)
                records[model] = row
                args.results.write_text(json.dumps(records, indent=1) + "\n")
                print(json.dumps(row), flush=True)
    text = render(records, banner(args))
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")
