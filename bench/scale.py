"""Cost of ``quantize-onnx`` against the model's size: transformer files built from configs (random weights:
this measures cost, not accuracy), saved with external data, each quantized to INT8 static in a fresh process.

For each size: wall time, the child's CPU time and peak RSS (``os.wait4``), the INT8 output's bytes and
files, and the fidelity SQNR the command measured; between the sizes, the fitted exponent of time and
of peak RSS against the float weights' size (1.0 is linear).

    python bench/scale.py                       # 0.1 and 0.5 GB of float weights
    python bench/scale.py --sizes 0.1,0.5,2     # more sizes (2 GB and up: a machine with room for them)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _smoke
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quantship.inspect.read.loading import file_size

SEQ, BATCH, SAMPLES = 16, 4, 16  # calibration: 16 sequences of 16 tokens, in batches of 4
FLOATS_PER_LAYER = 12  # x d*d: q, k, v, o projections (4) and the 4x MLP (8)


def config(size_gb: float) -> tuple[int, int]:
    """(width, layers) whose float weights come closest to ``size_gb``."""
    width = 256 if size_gb < 0.05 else 512 if size_gb < 0.3 else 1024
    layers = max(1, round(size_gb * 1e9 / (4 * FLOATS_PER_LAYER * width * width)))
    return width, layers


def build(width: int, layers: int, seed: int = 0) -> onnx.ModelProto:
    """A pre-norm encoder: LayerNorm, single-head attention, residual, LayerNorm, ReLU MLP, residual."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def weight(name: str, *shape: int) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(shape, dtype=np.float32) / math.sqrt(shape[0])), name))
        return name

    def op(kind: str, inputs: list[str], out: str, **attrs) -> str:
        nodes.append(helper.make_node(kind, inputs, [out], name=out, **attrs))
        return out

    inits += [numpy_helper.from_array(np.ones(width, np.float32), "gamma"),
              numpy_helper.from_array(np.zeros(width, np.float32), "beta"),
              numpy_helper.from_array(np.array(math.sqrt(width), np.float32), "root_d")]
    x = "x"
    for i in range(layers):
        p = f"l{i}_"
        h = op("LayerNormalization", [x, "gamma", "beta"], p + "ln1", axis=-1)
        q, k, v = (op("MatMul", [h, weight(p + f"w{n}", width, width)], p + n) for n in "qkv")
        kt = op("Transpose", [k], p + "kt", perm=[0, 2, 1])
        scores = op("Div", [op("MatMul", [q, kt], p + "qk"), "root_d"], p + "scaled")
        attn = op("MatMul", [op("Softmax", [scores], p + "softmax", axis=-1), v], p + "attn")
        o = op("Add", [op("MatMul", [attn, weight(p + "wo", width, width)], p + "o"), weight(p + "bo", width)], p + "ob")
        x = op("Add", [x, o], p + "res1")
        h = op("LayerNormalization", [x, "gamma", "beta"], p + "ln2", axis=-1)
        up = op("Add", [op("MatMul", [h, weight(p + "w1", width, 4 * width)], p + "up"), weight(p + "b1", 4 * width)],
                p + "upb")
        down = op("MatMul", [op("Relu", [up], p + "relu"), weight(p + "w2", 4 * width, width)], p + "down")
        x = op("Add", [x, op("Add", [down, weight(p + "b2", width)], p + "downb")], p + "res2")
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "encoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", SEQ, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", SEQ, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def measure(size_gb: float, work: Path) -> dict:
    width, layers = config(size_gb)
    folder = work / f"{size_gb:g}gb"
    folder.mkdir(parents=True, exist_ok=True)
    float_path = folder / "float.onnx"
    model = build(width, layers)
    float_bytes = sum(t.ByteSize() for t in model.graph.initializer)
    onnx.save_model(model, str(float_path), save_as_external_data=True, location="float.onnx.data",
                    size_threshold=1024)
    del model
    calib = folder / "calib.npy"
    np.save(calib, np.random.default_rng(1).standard_normal((SAMPLES, SEQ, width), dtype=np.float32))
    out = folder / "int8.onnx"
    command = [sys.executable, "-m", "quantship", "quantize-onnx", str(float_path), "--calib", str(calib), "--out",
               str(out), "--batch-size", str(BATCH), "--no-speed", "--json"]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        child = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        stdout.seek(0)
        stderr.seek(0)
        report, errors = stdout.read(), stderr.read()
    if child.returncode != 0:
        raise SystemExit(f"quantize-onnx exited {child.returncode} at {size_gb:g} GB: {errors.strip()[-2000:]}")
    fidelity = json.loads(report).get("fidelity_fp32") or {}
    files = sorted(p.name for p in folder.iterdir() if p.name.startswith("int8.onnx"))
    return {"size_gb": size_gb, "width": width, "layers": layers, "float_bytes": float_bytes, "wall_s": wall,
            "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "int8_bytes": file_size(out), "int8_files": files, "sqnr_db": fidelity.get("sqnr_db")}


def exponent(rows: list[dict], key: str) -> float | None:
    """The least-squares slope of log(key) against log(float bytes): 1.0 is linear."""
    if len(rows) < 2:
        return None
    xs = np.log([r["float_bytes"] for r in rows])
    ys = np.log([r[key] for r in rows])
    return float(np.polyfit(xs, ys, 1)[0])


def render(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [*_smoke.banner(args), *_smoke.cpu_lines("quantize-onnx cost against model size (bench/scale.py)"),
             f"INT8 static (`quantize-onnx --no-speed`, fidelity measured, `check --run`), a fresh process per size; "
             f"float files with external data; calibration {SAMPLES} x {SEQ} tokens, batch {BATCH}.", "",
             "| float weights | layers x width | wall s | CPU s | peak RSS | RSS / float | INT8 bytes | INT8 files | "
             "SQNR vs FP32 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sqnr = f"{r['sqnr_db']:.1f} dB" if r["sqnr_db"] is not None else "n/a"
        lines.append(f"| {r['float_bytes'] / 1e9:.3f} GB | {r['layers']} x {r['width']} | {r['wall_s']:.1f} | "
                     f"{r['cpu_s']:.1f} | {r['peak_rss_bytes'] / 1e9:.2f} GB | "
                     f"{r['peak_rss_bytes'] / r['float_bytes']:.2f} | {r['int8_bytes']:,} | "
                     f"{', '.join(r['int8_files'])} | {sqnr} |")
    for key, what in (("cpu_s", "CPU time"), ("peak_rss_bytes", "peak RSS")):
        slope = exponent(rows, key)
        lines.append("")
        lines.append(f"Fitted exponent of {what} against float size: "
                     + (f"{slope:.2f}" if slope is not None else "n/a (one size)"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.1,0.5", help="float weights per model, GB, comma-separated")
    parser.add_argument("--work", type=Path, default=None, help="folder for the files (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this Markdown file")
    args = _smoke.parse_args(parser, argv, sizes="0.002,0.006")
    sizes = sorted(float(s) for s in args.sizes.split(","))
    with tempfile.TemporaryDirectory(prefix="quantship-scale-") as tmp:
        work = args.work or Path(tmp)
        rows = [measure(size, work) for size in sizes]
    table = render(rows, args)
    print(table)
    if args.out is not None:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
