"""Issue 38's list, walked as a new user walks it: each line of the issue, the command that showed it, and
what the command does now (exit code, the first line it printed, and whether the line is answered).

    python bench/new_user.py [--out-dir DIR] [--markdown FILE]

Builds what the issue used (a torchvision-style CNN, a DistilBERT with two integer inputs exported with
``torch.onnx.export``, a two-input PyTorch model, a tiny Llama config; random weights, nothing downloaded),
runs every command in a fresh process (``python -m quantship``), and prints one table row per line of the
issue. A row says ``answered`` only when the check written beside it held on what the command did.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _smoke
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/text_models.py: the DistilBERT every command must take

ROWS: list[tuple[str, str, str, bool]] = []  # (issue line, command, what happened, answered)


def qs(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``quantship ARGS`` in a fresh process, as a user types it."""
    return subprocess.run([sys.executable, "-m", "quantship", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def first_line(done: subprocess.CompletedProcess) -> str:
    text = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return text[0][:140] if text else ""


def row(line: str, command: str, check: Callable[[], tuple[bool, str]]) -> None:
    try:
        ok, said = check()
    except Exception as exc:  # a check that cannot run is a line not answered, said as such
        ok, said = False, f"the check failed: {type(exc).__name__}: {exc}"[:160]
    ok = bool(ok)
    ROWS.append((line, command, said, ok))
    print(f"{'answered' if ok else 'OPEN    '} | {line} | {said}", flush=True)


def build(d: Path, smoke: bool = False) -> None:
    """The files the issue's commands read (``smoke``: the data-loss rows' only)."""
    import torch
    from tests.text_models import export_distilbert, token_data

    from quantship import export_onnx

    torch.manual_seed(0)
    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3),
                              torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(16, 10)).eval()
    export_onnx(cnn, torch.randn(1, 3, 32, 32), d / "model.onnx")
    np.save(d / "cal.npy", np.random.default_rng(0).standard_normal((48, 3, 32, 32)).astype(np.float32))
    (d / "net.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(16, 8)\n")
    if smoke:
        return
    _, bert = export_distilbert(d)
    bert.rename(d / "bert.onnx")
    np.savez(d / "bert_cal.npz", **token_data(48))
    (d / "net.py").write_text(
        "import torch\n\n"
        "class Two(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)\n\n"
        "    def forward(self, left, right):\n"
        "        return torch.relu(self.a(left)) + self.b(right)\n\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return Two()\n")
    rng = np.random.default_rng(1)
    np.savez(d / "two.npz", left=rng.standard_normal((48, 16)).astype(np.float32),
             right=rng.standard_normal((48, 16)).astype(np.float32))
    import transformers

    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False).save_pretrained(d / "llama")
    np.save(d / "ids.npy", rng.integers(0, 256, (32, 16)).astype(np.int64))
    import onnx

    half = onnx.load(d / "model.onnx")
    from onnx import numpy_helper

    for init in half.graph.initializer:  # an fp16 copy of the CNN's weights and interface
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for v in (*half.graph.input, *half.graph.output):
        v.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    onnx.save(half, d / "half.onnx")


def refused_untouched(d: Path, args: list[str], victim: Path) -> Callable[[], tuple[bool, str]]:
    def check() -> tuple[bool, str]:
        before = victim.read_bytes() if victim.is_file() else None
        kind = victim.stat().st_mode if victim.exists() else None
        done = qs(*args, cwd=d)
        after = victim.read_bytes() if victim.is_file() else None
        same = before == after and (kind is None or victim.stat().st_mode == kind)
        return done.returncode == 2 and same, f"exit {done.returncode}, input untouched: {same}; {first_line(done)}"
    return check


def walk(d: Path, smoke: bool = False) -> None:
    m, cal, bert, bcal = "model.onnx", "cal.npy", "bert.onnx", "bert_cal.npz"
    row("--out equal to the input replaces the float model", f"quantize-onnx {m} --calib {cal} --out {m}",
        refused_untouched(d, ["quantize-onnx", m, "--calib", cal, "--out", m], d / m))
    row("--out cal.npy overwrites the calibration data", f"quantize-onnx {m} --calib {cal} --out {cal}",
        refused_untouched(d, ["quantize-onnx", m, "--calib", cal, "--out", cal], d / cal))
    row("export-onnx --out net.py overwrites the model's source", "export-onnx net.py:build --shape 1,16 --out net.py",
        refused_untouched(d, ["export-onnx", "net.py:build", "--shape", "1,16", "--out", "net.py"], d / "net.py"))
    row("--out /dev/null replaces a device", f"quantize-onnx {m} --calib {cal} --out /dev/null",
        refused_untouched(d, ["quantize-onnx", m, "--calib", cal, "--out", "/dev/null"], Path("/dev/null")))

    if smoke:  # the data-loss rows: every command refused before any heavy work
        return

    def api_py() -> tuple[bool, str]:
        import torch

        from quantship import Quantizer, export_qdq
        net = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
        q = Quantizer.for_target("onnxruntime-cpu").quantize(net, [torch.randn(8, 8)])
        try:
            export_qdq(q, torch.randn(2, 8), d / "x.py")
        except Exception as exc:
            return not (d / "x.py").exists(), f"{type(exc).__name__}: {str(exc)[:100]}"
        return False, "written"
    row("export_qdq(..., 'x.py') writes a Python file", "export_qdq(qmodel, sample, 'x.py')", api_py)

    def weight_input() -> tuple[bool, str]:
        import onnx

        w = onnx.load(d / m)
        w.graph.input.extend([onnx.helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                              for i in w.graph.initializer[:1]])
        onnx.save(w, d / "w_in.onnx")
        done = qs("quantize-onnx", "w_in.onnx", "--calib", cal, "--out", "w8.onnx", cwd=d)
        if done.returncode == 0:
            kept = {i.name for i in onnx.load(d / "w8.onnx").graph.input} >= {i.name for i in w.graph.input}
            return kept, f"exit 0, every declared input kept: {kept}"
        return done.returncode == 2 and not (d / "w8.onnx").exists(), f"exit {done.returncode}; {first_line(done)}"
    row("a weight declared as a graph input is lost silently", "quantize-onnx w_in.onnx ...", weight_input)

    def text_runs(cmd: list[str]) -> Callable[[], tuple[bool, str]]:
        def check() -> tuple[bool, str]:
            done = qs(*cmd, cwd=d)
            ran = re.search(r"(?<![a-z])not run", done.stdout) is None  # "cannot run" in a rule's text is not it
            return done.returncode == 0 and ran, f"exit {done.returncode}; {first_line(done)}"
        return check

    row("quantize-onnx on a DistilBERT (token ids, masks)", f"quantize-onnx {bert} --calib {bcal} --out bert_int8.onnx",
        text_runs(["quantize-onnx", bert, "--calib", bcal, "--out", "bert_int8.onnx", "--json"]))

    def json_runs() -> tuple[bool, str]:
        report = json.loads(qs("check", "bert_int8.onnx", "--target", "onnxruntime-cpu", "--run", "--json",
                               cwd=d).stdout)
        runs = report.get("runs") or report.get("check", {}).get("runs")
        return bool(runs), f"runs: {len(runs or [])}"
    row("check --run of the DistilBERT file with no data (was: int64 refused)",
        "check bert_int8.onnx --target onnxruntime-cpu --run", text_runs(["check", "bert_int8.onnx", "--target",
                                                                           "onnxruntime-cpu", "--run"]))
    row("check --run says accepted while nothing ran", "check bert_int8.onnx --run --json", json_runs)
    row("check --inputs bert_cal.npz (was: choose one with --key)", "check bert_int8.onnx --run --inputs bert_cal.npz",
        text_runs(["check", "bert_int8.onnx", "--target", "onnxruntime-cpu", "--run", "--inputs", bcal]))
    row("compare float vs INT8 DistilBERT", f"compare {bert} bert_int8.onnx --inputs {bcal}",
        text_runs(["compare", bert, "bert_int8.onnx", "--target", "onnxruntime-cpu", "--inputs", bcal]))
    row("sensitivity on the DistilBERT file", f"sensitivity {bert} --calib {bcal}",
        text_runs(["sensitivity", bert, "--calib", bcal, "--out-dir", "sens"]))

    def inspect_made_by() -> tuple[bool, str]:
        qs("quantize-onnx", m, "--calib", cal, "--out", "m8.onnx", cwd=d)
        done = qs("inspect", "m8.onnx", cwd=d)
        bad = "'backend': 'pt2e'" in done.stdout
        made = next((ln.strip() for ln in done.stdout.splitlines() if "made by" in ln), "no 'made by' line")
        return done.returncode == 0 and not bad, made[:140]
    row("inspect of a quantize-onnx file says spec {'backend': 'pt2e'}", "inspect m8.onnx", inspect_made_by)

    def no_static_peak() -> tuple[bool, str]:
        done = qs("inspect", "bert_int8.onnx", cwd=d)
        return "naive peak" not in done.stdout or "tensors left out" not in done.stdout, \
            f"exit {done.returncode}; naive peak printed: {'naive peak' in done.stdout}"
    row("inspect prints a static peak for a dynamic-shape transformer", "inspect bert_int8.onnx", no_static_peak)

    def no_cut_names() -> tuple[bool, str]:
        done = qs("quantize-onnx", bert, "--calib", bcal, "--out", "bert8b.onnx", cwd=d)
        return done.returncode == 0 and "…" not in done.stdout, f"'…' in the table: {'…' in done.stdout}"
    row("node names cut with '…' in the quantize-onnx table", f"quantize-onnx {bert} ...", no_cut_names)

    def sensitivity_pastes() -> tuple[bool, str]:
        done = qs("sensitivity", m, "--calib", cal, "--out-dir", "sens2", cwd=d)
        line = next((ln.split("suggested:", 1)[1].strip() for ln in done.stdout.splitlines() if "suggested:" in ln), "")
        if not line:
            return done.returncode == 0, "no suggestion printed (nothing to exclude)"
        argv = line.split()[1:] if line.startswith("quantship") else line.split()
        argv = [a if a != "OUT.onnx" else "sugg.onnx" for a in argv]
        pasted = qs(*argv, cwd=d)
        return pasted.returncode == 0, f"pasted `{line[:80]}`: exit {pasted.returncode}"
    row("sensitivity's suggested command cannot be pasted", "sensitivity model.onnx --calib cal.npy", sensitivity_pastes)

    def helps() -> tuple[bool, str]:
        texts = {c: " ".join(qs(c, "--help", cwd=d).stdout.split()) for c in ("quantize", "export-onnx", "quantize-onnx")}
        said = [t.split("--opset OPSET", 2)[-1][:60] for c, t in texts.items() if c != "quantize-onnx"]
        explained = all("INT8 file" in s or "float file" in s for s in said)
        default = "default: onnxruntime-cpu" in texts["quantize-onnx"] or "(default onnxruntime-cpu" in texts[
            "quantize-onnx"]
        return default and explained, f"opset: {' / '.join(s.strip() for s in said)}; default target stated: {default}"
    row("--help: --opset stated twice differently; quantize-onnx's default target unstated", "--help", helps)

    row("quantize hf:llama/config.json asks for --calib, then refuses token ids",
        "quantize hf:llama/config.json --calib ids.npy --out x.onnx",
        text_runs(["quantize", "hf:llama/config.json", "--calib", "ids.npy", "--out", "x.onnx"]))
    row("a two-input net.py:build cannot be quantized from the command line",
        "quantize net.py:build --calib two.npz --out two.onnx",
        text_runs(["quantize", "net.py:build", "--calib", "two.npz", "--out", "two.onnx"]))

    def fp16() -> tuple[bool, str]:
        done = qs("quantize-onnx", "half.onnx", "--calib", cal, "--out", "h8.onnx", cwd=d)
        said = first_line(done)
        return done.returncode == 2 and "float32" in said and "16" in said, f"exit {done.returncode}; {said}"
    row("an fp16 model: 'nothing to run as an integer kernel'", "quantize-onnx half.onnx ...", fp16)

    def progress_on_stderr() -> tuple[bool, str]:
        done = qs("quantize-onnx", m, "--calib", cal, "--out", "p8.onnx", "--json", cwd=d)
        try:
            json.loads(done.stdout)
            return True, "stdout is the JSON report alone; progress on stderr"
        except json.JSONDecodeError:
            return False, f"stdout is not JSON: {done.stdout[:80]!r}"
    row("progress lines go to stdout", "quantize-onnx ... --json", progress_on_stderr)

    def api_verify() -> tuple[bool, str]:
        import torch

        from quantship import Quantizer, export_qdq, verify_qdq
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
        batches = [torch.randn(8, 8) for _ in range(4)]
        q = Quantizer.for_target("onnxruntime-cpu").quantize(net, batches)
        path = export_qdq(q, batches[0], d / "v.onnx")
        a = verify_qdq(q, path, batches)  # a list of batches
        b = verify_qdq(q, path, np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32))
        names = [o.name for o in __import__("onnx").load(path).graph.output]
        return True, f"list and numpy probes verified; outputs {names}; {str(a)[:40]}, {str(b)[:30]}"
    row("verify_qdq(probe as a list / numpy) ends in a traceback", "verify_qdq(q, path, [batches])", api_verify)

    def nan_sample() -> tuple[bool, str]:
        import torch

        from quantship import Quantizer, export_qdq
        net = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
        q = Quantizer.for_target("onnxruntime-cpu").quantize(net, [torch.randn(8, 8)])
        try:
            export_qdq(q, torch.full((2, 8), float("nan")), d / "nan.onnx")
        except Exception as exc:
            return not (d / "nan.onnx").exists(), f"{type(exc).__name__}: {str(exc)[:90]}"
        return False, "written"
    row("export_qdq with an all-NaN sample writes a file", "export_qdq(q, nan_sample, path)", nan_sample)

    def names_and_batch() -> tuple[bool, str]:
        import onnx
        import torch

        from quantship import Quantizer, export_qdq
        net = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
        plain = Quantizer(backend="pt2e").quantize(net, [torch.randn(8, 8)])
        g = onnx.load(export_qdq(plain, torch.randn(3, 8), d / "n.onnx")).graph
        preset = Quantizer.for_target("onnxruntime-cpu").quantize(net, [torch.randn(8, 8)])
        h = onnx.load(export_qdq(preset, torch.randn(3, 8), d / "n2.onnx")).graph
        out = [o.name for o in g.output]
        plain_batch = g.input[0].type.tensor_type.shape.dim[0].dim_value
        preset_batch = h.input[0].type.tensor_type.shape.dim[0].dim_param
        ok = not any(n.startswith("dequantize_per_tensor") for n in out) and plain_batch == 3 and preset_batch
        return ok, (f"outputs {out}; no target: batch {plain_batch} (the sample's); for_target('onnxruntime-cpu'): "
                    f"batch '{preset_batch}' (the preset serves any batch, as docs/pytorch.md says)")
    row("output named after a torch node; for_target then export_qdq writes a symbolic batch",
        "export_qdq(Quantizer.for_target(...).quantize(...), sample, path)", names_and_batch)

    def fast_refusal() -> tuple[bool, str]:
        start = time.perf_counter()
        done = qs("quantize-onnx", "missing.onnx", "--calib", cal, "--out", "z.onnx", cwd=d)
        took = time.perf_counter() - start
        return done.returncode == 2 and took < 2.0, f"exit {done.returncode} in {took:.2f} s; {first_line(done)}"
    row("quantize-onnx missing.onnx takes 32 s to say the file is missing", "quantize-onnx missing.onnx ...",
        fast_refusal)

    def readme() -> tuple[bool, str]:
        size = (ROOT / "README.md").stat().st_size
        return size < 12_000, f"README.md {size} bytes"
    row("README.md is 65 kB", "wc -c README.md", readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None, help="keep the files here (default: a temp folder)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    args = _smoke.parse_args(parser)  # --smoke: the four data-loss rows only, on a small CNN (the suite)
    with tempfile.TemporaryDirectory() as tmp:
        d = args.out_dir or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("PYTHONPATH", str(ROOT / "src"))
        build(d, args.smoke)
        walk(d, args.smoke)
    lines = ["| issue 38's line | command | now | answered |", "|---|---|---|---|"]
    lines += [f"| {a} | `{b}` | {c.replace('|', '/')} | {'yes' if ok else '**no**'} |" for a, b, c, ok in ROWS]
    table = "\n".join(lines)
    print("\n" + table)
    print(f"\n{sum(ok for *_, ok in ROWS)} of {len(ROWS)} lines answered")
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
