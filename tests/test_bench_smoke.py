"""Every bench script runs end to end in its smoke mode (``--smoke``, bench/_smoke.py), each in a fresh process.

A bench that crashes on main while its published table stays is what these catch (``bench/latency.py``
broke that way and nobody noticed). Each run is a new interpreter, as a user runs the script: a state left
by an earlier call in the same process cannot hide a failure here. A run must exit 0, print or write its
table (rows and section headers that an empty or half-written table would lack), write only into the
test's directory, and leave the repository's published files (BENCHMARKS*.md, ZOO*.md, bench/*.json)
byte for byte and mtime for mtime as they were.

The runs are marked ``bench_smoke`` and left out of ``make test`` (pyproject's ``addopts``): the 30 of them
took 30-60 min on the 2-core machines (45-340 s each, cold cache), three times the suite's 20-minute goal,
and pushed CI past its 90-minute limit. ``make bench-smoke`` runs them; run it after changing a bench script
or before publishing a table. ``make test`` keeps the cheap checks: every script has a smoke run here, and
every quantship name a script imports is public and defined (tests/test_bench_public_api.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import quantship

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# scripts with a --smoke of their own rather than bench/_smoke.py's (real.py: smaller tasks, not other arguments)
OWN_SMOKE = {"real.py"}


@dataclass(frozen=True)
class Smoke:
    args: tuple[str, ...] = ()  # after --smoke; "{tmp}" is the test's directory
    stdout: tuple[str, ...] = ()  # each must appear in the output
    files: dict[str, tuple[str, ...]] = field(default_factory=dict)  # file in {tmp} -> text each must hold
    never: tuple[str, ...] = ()  # must appear nowhere in the output
    lines: tuple[str, ...] = ()  # regular expressions, each matching a whole line of the output
    script: str = ""  # the script, where the run's name is not it (a second run of one script)


RUNS = {
    "scale": Smoke(stdout=("| float weights | layers x width | wall s | CPU s | peak RSS |", "| 1 x 256 | ",
                           "Fitted exponent of CPU time against float size: ")),
    # the default settings and one worst-SQNR 16-bit setting, in one run (one import, one task)
    "algorithms": Smoke(("--settings", "plain,equalize,bias_correction,equalize + bias_correction,smooth_quant,"
                                       "seq_mse,bias_correction+int16_worst1"),
                        stdout=("| algorithm | accuracy | agrees with FP32 | quantize s |", "| FP32 | ", "| plain | ",
                                "| equalize | ", "| bias_correction | ", "| equalize + bias_correction | ",
                                "| smooth_quant | ", "15 conv pairs equalized", "biases corrected",
                                "layers smoothed (alpha 0.5", "| seq_mse | ", "weight scales moved",
                                "| bias_correction+int16_worst1 | ",
                                "16-bit activations for the 1 worst-SQNR node(s) of the bias_correction file's "
                                "report on 16 calibration samples", " tensors 16-bit, 0 weights left float")),
    # both paths, one preset: the fidelity row and the cost row (with and without the judgement) of each file
    "fidelity": Smoke(stdout=(
        "| model | path | target | output SQNR (dB, worst part) | each part: SQNR, agreement of decisions (rule) | "
        "default budget (margin) | task metric |",
        "| model | path | target | quantize s, --no-fidelity (wall / CPU) | default (wall / CPU) | "
        "default / --no-fidelity (CPU) |", "| mtcnn_pnet | onnx | onnxruntime-cpu | ",
        "| mtcnn_pnet | pytorch | onnxruntime-cpu | "),
        lines=(r"\| mtcnn_pnet \| onnx \| onnxruntime-cpu \| [\d.]+ / [\d.]+ \(x1\) \| [\d.]+ / [\d.]+ \| [\d.]+ \| .*",)),
    "placement": Smoke(stdout=("| model | plain | profile | search | profile / search |", "| mtcnn_pnet | ",
                               "mtcnn_pnet profile: ")),
    "int16": Smoke(stdout=("| file | accuracy | agrees with FP32 | output SQNR vs FP32, dB | ORT ms b1 |",
                           "| FP32 | ", "| plain INT8 | ", "| INT8, 3 worst in 16-bit | ", "| INT8, 3 worst in float | ",
                           "Load average")),
    "batch1_profile": Smoke(stdout=("ocr_cls_int8.onnx: graph ORT runs: ", "| op type | us per run | share |",
                                    "QLinearConv", "interleaved, median of 2: FP32 / INT8 = ")),
    "conv_speed": Smoke(stdout=("| input channels | output channels | kernel | group | input side | stride | float ms |",
                                "| 1 | 16 | 3 | 1 | 160 | 1 | ", "| QLinearConv |")),
    "mtcnn_pipeline": Smoke(stdout=("| INT8 files | threads | faces FP32 finds | reproduced by INT8 (IoU >= 0.5) |",
                                    "| quantize-onnx | 1 | ", "float (--exclude) | 1 | ", "PNet scales per image",
                                    "Quantize time (s): pnet ")),
    "accuracy_budget": Smoke(stdout=("| observer | budget (points) |", "| minmax | 0 | ", "ORT ms batch 1")),
    "distributed": Smoke(stdout=("| observer | 1 rank, 1 thread", "| minmax | ", "| histogram | ", "QAT: the per-step",
                                 "### On paper", "| histogram | 16 | ")),
    "detection": Smoke(("--out", "{tmp}/ZOO-detection.md"), files={
        "ZOO-detection.md": ("Smoke run", "| tiny_ssd | 0.0 | ", "`detection_postprocess` (float island)",
                             "not accuracy"),
        "detection_results.json": ('"model": "tiny_ssd"', '"postprocess_tensors"')}),
    "dynamic_batch": Smoke(stdout=("| model | preset | max LSB per batch", "| resnet18 | onnxruntime-cpu | ")),
    "latency": Smoke(("--out", "{tmp}/BENCHMARKS.md"), files={"BENCHMARKS.md": (
        "Smoke run", "at 32x32", "| resnet18 | 1 | FP32 |", "| resnet18 | 2 | quantship onnxruntime-cpu",
        "| resnet18 | 1 | quantship tigris", "| resnet18 | 2 | ORT quantize_static s8 |", "## BERT-style encoder",
        "| 1 | quantship onnxruntime-cpu |", "| 1 | ORT quantize_dynamic |", "## Language model, weight-only",
        "| quantship W4A16 g128 MatMulNBits |", "| ORT MatMulNBitsQuantizer 4-bit block 32 symmetric |")}),
    "latency_thread_time": Smoke(("--encoder-thread-time",), script="latency", stdout=(
        "| batch | rounds | FP32 | quantship onnxruntime-cpu | quantship quantize-onnx | ORT quantize_dynamic | "
        "quantship quantize-onnx --activations dynamic | quantize_dynamic / dynamic form, per round |", "| 1 | 1 | ")),
    "lm_perplexity": Smoke(("--out", "{tmp}/BENCHMARKS-LM.md"), files={"BENCHMARKS-LM.md": (
        "Smoke run", "Held-out: 4 files", "| FP32 (torch) |", "| W4A16 g128 (torch) |",
        "| W8A16 (DequantizeLinear file, ORT) |", "| W4A16 g32 (MatMulNBits file, ORT) |",
        "| W4A16 g128 + GPTQ (torch) |", "| W4A16 g128 + GPTQ (MatMulNBits file, ORT) |")}),
    "lm_decode": Smoke(("--order-check", "--out", "{tmp}/lm_decode_results.md"), files={"lm_decode_results.md": (
        "Smoke run", "## smoke: Llama from a config", "| FP32 | - | ", "| quantship INT8 per channel | 4 | ",
        "| quantship INT4 g32 | 0 | ", "| ORT MatMulNBitsQuantizer INT4 g32 | 4 | ", "| quantship W8A8 static | - | ",
        "decode @64, b4 ms",
        "tokens/s b1 @16 (x FP32)", "### Order check, INT4 g32, accuracy_level 4, decode @16",
        "| 1 | ORT , quantship , ORT' , quantship' | ")}),
    "lm_embedding": Smoke(("--out", "{tmp}/lm_embedding_results.md"), files={"lm_embedding_results.md": (
        "Smoke run", "| byte Llama, head untied | FP32 | float |", "| byte Llama, head tied | INT4 g128 | quantized |",
        "| INT8 | quantized |", "decode ms, DequantizeLinear (default session)")}),
    "lm_static": Smoke(("--out", "{tmp}/BENCHMARKS-LM-static.md"), files={"BENCHMARKS-LM-static.md": (
        "Smoke run", "Held-out: 4 files", "| Llama | FP32 (torch) |", "| Llama | W8A8 (QDQ file, ORT) |",
        "| GPT-2 | W8A8 (torch) |", "| GPT-2 | W8A8 (QDQ file, ORT) |", "LSB literal / fused", "GPT-2: 5 QGemm")}),
    "lsb_trace": Smoke(stdout=("## resnet18 (input 32,", "| sample | output error, LSB |", "| 0 | ",
                               "one-step change injected in torch")),
    "observers": Smoke(stdout=("| digits TinyResNet | minmax |", "| digits TinyResNet | mse |",
                               "| MobileNetV2 32px (BN-calibrated, untrained) | mse |")),
    "ort_fusion": Smoke(stdout=("## vit (input 32, batch 1)", "- INT8: LSB literal", "- FP32: median",
                                "  integer kernels: ", "x the speed of FP32")),
    "pipeline": Smoke(("--report", "{tmp}/BENCHMARKS-pipeline.md"), files={"BENCHMARKS-pipeline.md": (
        "Smoke run", "## Cold: one fresh process per run", "| capture |", "| **total** |",
        "quantship / raw, any batch:", "## Warm: export_qdq vs the raw exporter in one process, batch 1",
        "| resnet18 | onnxruntime-cpu | 1 |", "inside export_qdq (medians): exporter")}),
    "new_user": Smoke(stdout=("| issue 38's line | command | now | answered |", "4 of 4 lines answered"),
                      never=("**no**",)),
    "recurrent": Smoke(stdout=("| file | top-1 [Wilson 95%] | output SQNR vs FP32, dB | batch 1 | batch 64 |",
                                "| hidden 64: FP32 | ", "| hidden 64: INT8, default file: 1 DynamicQuantizeLSTM | ",
                                "| hidden 64: INT8, LSTM float (--exclude LSTM): 0 DynamicQuantizeLSTM | ")),
    "readings": Smoke(stdout=("| resnet18 32px | default recipe", "| resnet18 32px | onnxruntime-cpu",
                              "reference task (digits, trained)", "| tigris | ")),
    "robustness": Smoke(("--work", "{tmp}/work"), stdout=(
        "one uninterrupted run:", "Ctrl-C (1 trials)", "kill -9 (1 trials)", "two writers"),
        never=("CORRUPT", "BROKEN"), lines=(r" +next run exit 0 +1", r" +waiting: exit codes \[0, 0\] +1",
                                             r" +waiting: final file whole +1", r" +--no-wait: final file whole +1",
                                             r" +temp left after the next run +0")),
    "real": Smoke(stdout=("ocr_cls|onnx|fp32: ok", "ocr_cls|onnx|ort-defaults: ok",
                          "ocr_cls|onnx|quantship:onnxruntime-cpu: ok", "ocr_cls|pt2e|fp32: ok", "REAL.md")),
    "segmentation": Smoke(("--out", "{tmp}/ZOO-segmentation.md"), files={
        "ZOO-segmentation.md": ("Smoke run", "| lraspp_mobilenet_v3_large | 3.2 | ", "| out | 1x21x32x32 | ",
                                "| deeplabv3_mobilenet_v3_large | not run yet |"),
        "segmentation_results.json": ('"model": "lraspp_mobilenet_v3_large"', '"name": "out"')}),
    "yolo_head": Smoke(("--out", "{tmp}/ZOO-yolo.md"), files={"ZOO-yolo.md": (
        "Smoke run", "| choice | option | FP32 detections reproduced | scores = 0 |", "| default | `--target",
        "| shared scale: output Concat | `--shared-scale /model.22/Concat_25` | ", "## Reading",
        "- shared scale: output Concat: ", "INT8 / FP32 latency b1 ")}),
    "zoo": Smoke(("--out", "{tmp}/ZOO.md"), files={"ZOO.md": ("| resnet18 | 11.7 | 32 | ", "- 1 of ", "## hf"),
                                                    "zoo_results.json": ('"model": "resnet18"', '"status": "ok"')}),
    "zoo_speed": Smoke(("--out", "{tmp}/ZOO-speed.md"), files={
        "ZOO-speed.md": ("Smoke run", "| torchvision | resnet18 | 11.7 | 32 | ", "- 1 models timed; "),
        "zoo_speed_results.json": ('"model": "resnet18"', '"status": "ok"', '"default": {', '"search": {')}),
    "zoo_hf": Smoke(("--family", "hf", "--out", "{tmp}/ZOO.md"), script="zoo", files={
        "ZOO.md": ("## torchvision", "## hf", "| bert | 0.1 | 1x16 ids | - | 0 / 16 | ",
                   "quantize time per stage: slowest per stage over the 1 timed record(s): capture bert"),
        "zoo_results.json": ('"model": "bert"', '"family": "hf"', '"stages": {', '"capture": ')}),
}


def _env() -> dict[str, str]:
    """This process's environment, with the quantship it imports first on the path, bytecode off (nothing
    written into bench/) and one thread (as each xdist worker runs)."""
    path = [str(Path(quantship.__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}


def _published() -> dict[str, tuple[int, str] | None]:
    """mtime and digest of every published file (BENCHMARKS*.md, ZOO*.md, bench/*.json), and the names of
    everything else in bench/ (nothing may appear there; the scripts themselves may be edited meanwhile)."""
    published = [*ROOT.glob("BENCHMARKS*.md"), *ROOT.glob("ZOO*.md"), *BENCH.glob("*.json")]
    state: dict[str, tuple[int, str] | None] = {p.name: None for p in BENCH.iterdir()}
    state.update({str(p.relative_to(ROOT)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
                  for p in published if p.is_file()})
    return state


def test_every_bench_script_has_a_smoke_run():
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    covered = {f"{smoke.script or name}.py" for name, smoke in RUNS.items()}
    assert scripts == covered, "a bench script without a smoke run here (or a run of a script gone)"
    for name in covered:
        text = (BENCH / name).read_text()
        assert ('"--smoke"' in text) if name in OWN_SMOKE else ("_smoke.parse_args(" in text), f"bench/{name} takes no --smoke"


@pytest.mark.bench_smoke
@pytest.mark.parametrize("name", list(RUNS))
def test_bench_script_runs_in_smoke_mode(name, tmp_path):
    smoke = RUNS[name]
    script = BENCH / f"{smoke.script or name}.py"
    args = [a.replace("{tmp}", str(tmp_path)) for a in smoke.args]
    before = _published()
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, str(script), "--smoke", *args], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=3600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"bench smoke {name}: {time.perf_counter() - start:.1f} s wall, "
          f"{after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime:.1f} s CPU")
    assert done.returncode == 0, f"bench/{script.name} --smoke exited {done.returncode}:\n{done.stderr[-4000:]}"
    for text in smoke.stdout:
        assert text in done.stdout, f"{text!r} missing from the output of bench/{script.name} --smoke"
    for text in smoke.never:
        assert text not in done.stdout, f"{text!r} in the output of bench/{script.name} --smoke"
    for pattern in smoke.lines:
        assert re.search(f"^{pattern}$", done.stdout, re.M), f"no line {pattern!r} in bench/{script.name}'s output"
    for file, texts in smoke.files.items():
        content = (tmp_path / file).read_text()
        for text in texts:
            assert text in content, f"{text!r} missing from {file} written by bench/{script.name} --smoke"
    assert _published() == before, "the smoke run changed a published file (or wrote into bench/)"


def test_smoke_refuses_a_published_out(tmp_path):
    """An explicit --out naming a published file is refused before anything runs."""
    before = _published()
    done = subprocess.run([sys.executable, str(BENCH / "zoo.py"), "--smoke", "--results", str(BENCH / "zoo_results.json")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_env())
    assert done.returncode != 0 and "published file" in done.stderr
    assert _published() == before
