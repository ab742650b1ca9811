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

from quantship.inspect import file_size

SEQ, BATCH, SAMPLES = 16, 4, 16  # calibration: 16 sequences of 16 tokens, in batches of 4
FLOATS_PER_LAYER = 12  # x d*d: q, k, v, o projections (4) and the 4x MLP (8)


def config(size_gb: float) -> tuple[int, int]:
    """(width, layers) whose float weights come closest to ``size_gb``."""
    width = 256 if size_gb < 0.05 else 512 if size_gb < 0.3 else 1024
    layers = max(1, round(size_gb * 1e9 / (4 * FLOATS_PER_LAYER * width * width)))
    return width, layers


def build(width: int, layers: int, folder: Path, seed: int = 0) -> tuple[Path, int]:
    """A pre-norm encoder (LayerNorm, single-head attention, residual, LayerNorm, ReLU MLP, residual) written as
    ``float.onnx`` plus ``float.onnx.data``, one weight at a time (this process never holds the model); returns
    the graph's path and the float weights' bytes."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    data_path = folder / "float.onnx.data"
    written = 0

    with open(data_path, "wb") as data:
        def weight(name: str, *shape: int) -> str:
            nonlocal written
            array = rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[0]))
            data.write(b"\0" * (-data.tell() % 4096))
            offset = data.tell()
            data.write(array.tobytes())
            tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape,
                                 data_location=TensorProto.EXTERNAL)
            for key, value in (("location", data_path.name), ("offset", offset), ("length", array.nbytes)):
                tensor.external_data.add(key=key, value=str(value))
            inits.append(tensor)
            written += array.nbytes
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
            o = op("Add", [op("MatMul", [attn, weight(p + "wo", width, width)], p + "o"), weight(p + "bo", width)],
                   p + "ob")
            x = op("Add", [x, o], p + "res1")
            h = op("LayerNormalization", [x, "gamma", "beta"], p + "ln2", axis=-1)
            up = op("Add", [op("MatMul", [h, weight(p + "w1", width, 4 * width)], p + "up"),
                            weight(p + "b1", 4 * width)], p + "upb")
            down = op("MatMul", [op("Relu", [up], p + "relu"), weight(p + "w2", 4 * width, width)], p + "down")
            x = op("Add", [x, op("Add", [down, weight(p + "b2", width)], p + "downb")], p + "res2")
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "encoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", SEQ, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", SEQ, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "float.onnx"
    path.write_bytes(model.SerializeToString())
    return path, written + sum(t.ByteSize() for t in inits if not t.external_data)


def quantize_command(method: str, float_path: Path, calib: Path, out: Path, width: int = 0, layers: int = 0) -> list[str]:
    """The CLI call that quantizes ``float_path`` by ``method`` (``METHODS``; pt2e: the encoder of ``width`` and
    ``layers`` built in torch)."""
    if method in ("int8", "int8-default"):
        return [sys.executable, "-m", "quantship", "quantize-onnx", str(float_path), "--calib", str(calib), "--out",
                str(out), "--batch-size", str(BATCH), "--json", *(["--no-speed"] if method == "int8" else [])]
    if method == "int4":  # no CLI for it yet: the public API in a fresh process, its result as JSON
        code = ("import json, sys; import numpy as np; "
                "from quantship.quantize_onnx import quantize_weight_only_file; "
                "r = quantize_weight_only_file(sys.argv[1], sys.argv[2], np.load(sys.argv[3]), bits=4); "
                "print(json.dumps(r.as_dict()))")
        return [sys.executable, "-c", code, str(float_path), str(out), str(calib)]
    if method == "pt2e":  # the PyTorch path: this script's own child builds the torch encoder and quantizes it
        return [sys.executable, str(Path(__file__).resolve()), "--pt2e-child", str(width), str(layers), str(calib),
                str(out)]
    if method in ("pt2e-cli", "pt2e-cli-no-speed"):  # the PyTorch path's command, on this file's factory
        return [sys.executable, "-m", "quantship", "quantize", f"{Path(__file__).resolve()}:cli_encoder", "--calib",
                str(calib), "--batch-size", str(BATCH), "--out", str(out), "--json",
                *(["--no-speed"] if method.endswith("no-speed") else [])]
    raise ValueError(f"unknown method {method!r}; known: {list(METHODS)}")


def torch_encoder(width: int, layers: int, seed: int = 0):
    """The encoder ``build`` writes, as a torch module (its own random weights, scaled as there)."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.q, self.k, self.v = (torch.nn.Linear(width, width, bias=False) for _ in range(3))
            self.o, self.up, self.down = (torch.nn.Linear(width, width), torch.nn.Linear(width, 4 * width),
                                          torch.nn.Linear(4 * width, width))

        def forward(self, x):
            h = self.ln1(x)
            scores = self.q(h) @ self.k(h).transpose(1, 2) / math.sqrt(width)
            x = x + self.o(torch.softmax(scores, -1) @ self.v(h))
            return x + self.down(torch.relu(self.up(self.ln2(x))))

    torch.manual_seed(seed)
    with torch.no_grad():
        model = torch.nn.Sequential(*[Block() for _ in range(layers)]).eval()
        for name, value in model.named_parameters():
            if name.endswith("weight") and value.ndim == 2:
                value.normal_(0.0, 1.0 / math.sqrt(value.shape[1]))
    return model


CONFIG_VARIABLE = "QUANTSHIP_SCALE_CONFIG"  # "<width>x<layers>": the encoder cli_encoder builds


def cli_encoder():
    """The encoder of the size the bench names in ``CONFIG_VARIABLE``: the factory ``quantship quantize`` loads."""
    width, layers = (int(v) for v in os.environ[CONFIG_VARIABLE].split("x"))
    return torch_encoder(width, layers)


def weighted_census(path: Path) -> dict:
    """The file's MatMul/Gemm nodes whose weight is stored: how many read it through a DequantizeLinear (low-bit)
    and how many read it in float."""
    graph = onnx.load(str(path), load_external_data=False).graph
    stored, dequantized = {t.name for t in graph.initializer}, set()
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in stored:
            dequantized.add(node.output[0])
    weighted = [n for n in graph.node if n.op_type in ("MatMul", "Gemm")
                and (n.input[1] in stored or n.input[1] in dequantized)]
    low_bit = sum(1 for n in weighted if n.input[1] in dequantized)
    return {"n_integer": low_bit, "n_float": len(weighted) - low_bit}


def file_speedup(path: Path) -> dict | None:
    """The speed reading the command stored in the file's metadata: FP32 ms / INT8 ms per batch (None: not timed)."""
    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    reading = json.loads(props.get("quantship.speed", "null")) or {}
    if not reading.get("int8_ms"):
        return None
    return {b: reading["fp32_ms"][b] / reading["int8_ms"][b] for b in reading["int8_ms"]}


def _peak_rss_bytes() -> int | None:
    """This process's peak resident size so far (``VmHWM``; None where the kernel does not say: not Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def pt2e_child(width: int, layers: int, calib: Path, out: Path) -> dict:
    """What a user of the PyTorch path runs on a model held in memory: ``Quantizer.for_target`` and ``export_qdq``,
    then the file in ONNX Runtime against the torch model on one calibration batch."""
    import onnxruntime as ort
    import torch

    from quantship import Quantizer, export_qdq

    model = torch_encoder(width, layers)
    x = np.load(calib)
    batches = [torch.from_numpy(x[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    qmodel = Quantizer.for_target("onnxruntime-cpu").quantize(model, batches)
    path = export_qdq(qmodel, batches[0][:1], out, target="onnxruntime-cpu")
    quantship_peak = _peak_rss_bytes()  # the process's peak so far: the model, quantize and export, not the check below
    del qmodel
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x[:BATCH]})[0].astype(np.float64)
    with torch.no_grad():
        ref = model(batches[0]).numpy().astype(np.float64)
    sqnr = float(10 * np.log10((ref ** 2).sum() / max(((ref - got) ** 2).sum(), 1e-30)))
    return {"fidelity_fp32": {"sqnr_db": sqnr}, "verdict": "export_qdq's post-conditions held",
            "quantship_peak_rss_bytes": quantship_peak, "census": weighted_census(path)}


METHODS = {"int8": "INT8 static (`quantize-onnx --no-speed`: normalise, calibrate, write, post-conditions, both ORT "
                   "readings, fidelity to FP32, `check --run`)",
           "int8-default": "INT8 static (`quantize-onnx` with its defaults: as the row above, and the placement by "
                           "profile, the speed reading against the float file at batch 1 and the calibration batch)",
           "int4": "INT4 weight-only (`quantize_onnx.weight_only_file`: each weighted MatMul as MatMulNBits, 4 bits, "
                   "group 128, symmetric; run in ORT against FP32; no QDQ check applies)",
           "pt2e": "INT8 static, PyTorch path (the same encoder built in torch in the process, its weights held there as "
                   "a user's are; `Quantizer.for_target('onnxruntime-cpu')` and `export_qdq` with its post-conditions "
                   "and both ORT readings, then the file in ORT against the torch model on one batch)",
           "pt2e-cli": "INT8 static, PyTorch path's command (`quantship quantize scale.py:cli_encoder`, its defaults: "
                       "fidelity to FP32 on 3 held-out samples judged and repaired, the float reference exported, "
                       "placement by profile, speed against FP32 at batch 1 and the calibration batch, the target's check --run)",
           "pt2e-cli-no-speed": "INT8 static, PyTorch path's command with `--no-speed` (as the row above, without the "
                                "float reference, the placement by profile and the speed reading: no float ONNX "
                                "Runtime session beside the user's model)"}


def build_size(size_gb: float, work: Path) -> dict:
    """The float file and calibration data of one size, written once and reused by every method."""
    width, layers = config(size_gb)
    folder = work / f"{size_gb:g}gb"
    folder.mkdir(parents=True, exist_ok=True)
    float_path, calib = folder / "float.onnx", folder / "calib.npy"
    if float_path.is_file() and calib.is_file():
        float_bytes = sum(t.ByteSize() if not t.external_data else int(t.external_data[2].value)
                          for t in onnx.load(str(float_path), load_external_data=False).graph.initializer)
    else:
        float_path, float_bytes = build(width, layers, folder)
        np.save(calib, np.random.default_rng(1).standard_normal((SAMPLES, SEQ, width), dtype=np.float32))
    return {"size_gb": size_gb, "width": width, "layers": layers, "float_bytes": float_bytes, "folder": folder,
            "float_path": float_path, "calib": calib}


def measure(size_gb: float, work: Path, method: str = "int8") -> dict:
    built = build_size(size_gb, work)
    folder = built["folder"]
    out = folder / f"{method}.onnx"
    command = quantize_command(method, built["float_path"], built["calib"], out, built["width"], built["layers"])
    env = {**os.environ, CONFIG_VARIABLE: f"{built['width']}x{built['layers']}"}
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        child = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        stdout.seek(0)
        stderr.seek(0)
        report, errors = stdout.read(), stderr.read()
    if child.returncode != 0:
        raise SystemExit(f"{method} exited {child.returncode} at {size_gb:g} GB: {errors.strip()[-2000:]}")
    result = json.loads(report)
    if method.startswith("pt2e-cli"):
        result["census"] = weighted_census(out)
    fidelity = result.get("fidelity_fp32") or {}
    census = result.get("census") or {}
    files = sorted(p.name for p in folder.iterdir() if p.name.startswith(out.name))
    return {"method": method, "size_gb": size_gb, "width": built["width"], "layers": built["layers"],
            "float_bytes": built["float_bytes"], "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            # the PyTorch row's child reads its own peak before the bench's check of the file (an ORT session and a
            # torch forward of the float model, the user's own check, not quantship's cost); the process's in the record
            "peak_rss_bytes": result.get("quantship_peak_rss_bytes") or usage.ru_maxrss * 1024,
            "process_peak_rss_bytes": usage.ru_maxrss * 1024, "out_bytes": file_size(out), "out_files": files,
            "sqnr_db": fidelity.get("sqnr_db"), "speedup": file_speedup(out),
            "verdict": result.get("verdict", "runs in ORT" if method == "int4" else None),
            "integer_kernels": census.get("n_integer", result.get("n_matmul_nbits")),
            "float_kernels": census.get("n_float", len(result.get("kept_float", [])))}


def goal_bytes(float_bytes: int) -> float:
    """Issue 40's goal for peak RSS: 1.5 x the float weights plus 2 GB."""
    return 1.5 * float_bytes + 2e9


def exponent(rows: list[dict], key: str) -> float | None:
    """The least-squares slope of log(key) against log(float bytes): 1.0 is linear."""
    if len(rows) < 2:
        return None
    xs = np.log([r["float_bytes"] for r in rows])
    ys = np.log([r[key] for r in rows])
    return float(np.polyfit(xs, ys, 1)[0])


def line_fit(rows: list[dict], key: str) -> tuple[float, float]:
    """(intercept, slope) of ``key`` against the float bytes: what does not grow with the model, and what does."""
    slope, intercept = np.polyfit([r["float_bytes"] for r in rows], [r[key] for r in rows], 1)
    return float(intercept), float(slope)


def render(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [*_smoke.banner(args), *_smoke.cpu_lines("quantize-onnx cost against model size (bench/scale.py)"),
             "A fresh process per size and method, measured by `os.wait4` (wall time, the child's user + system CPU "
             "time, its peak RSS); random-weight pre-norm encoders written with external data; calibration "
             f"{SAMPLES} x {SEQ} tokens, batch {BATCH}. Goal (issue 40): peak RSS <= 1.5 x float weights + 2 GB.",
             "The machine was shared with other jobs while this ran."]
    for method, what in METHODS.items():
        mine = sorted((r for r in rows if r.get("method", "int8") == method), key=lambda r: r["float_bytes"])
        if not mine:
            continue
        lines += ["", f"## {what}", "",
                  "| float weights | layers x width | wall s | CPU s | peak RSS | RSS / float | goal | output bytes | "
                  "output files | low-bit / float weighted ops | SQNR vs FP32 | check --run |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            sqnr = f"{r['sqnr_db']:.1f} dB" if r.get("sqnr_db") is not None else "n/a"
            goal = goal_bytes(r["float_bytes"])
            met = "met" if r["peak_rss_bytes"] <= goal else "missed"
            lines.append(f"| {r['float_bytes'] / 1e9:.3f} GB | {r['layers']} x {r['width']} | {r['wall_s']:.1f} | "
                         f"{r['cpu_s']:.1f} | {r['peak_rss_bytes'] / 1e9:.2f} GB | "
                         f"{r['peak_rss_bytes'] / r['float_bytes']:.2f} | {goal / 1e9:.2f} GB {met} | "
                         f"{r['out_bytes']:,} | {', '.join(r['out_files'])} | {r.get('integer_kernels')} / "
                         f"{r.get('float_kernels')} | {sqnr} | {r.get('verdict')} |")
        lines.append("")
        timed = [r for r in mine if r.get("speedup")]
        if timed:
            lines.append("- Speed against FP32 the command measured (its file's metadata; FP32 ms / INT8 ms, batch "
                         "1 / the calibration batch, 1 thread): " + ", ".join(
                             f"{' / '.join(f'{v:.2f}x' for v in r['speedup'].values())} ({r['float_bytes'] / 1e9:.1f} GB)"
                             for r in timed))
        for key, what_of in (("cpu_s", "CPU time"), ("wall_s", "wall time"), ("peak_rss_bytes", "peak RSS")):
            slope = exponent(mine, key)
            lines.append(f"- Fitted exponent of {what_of} against float size: "
                         + (f"{slope:.2f}" if slope is not None else "n/a (one size)"))
        if len(mine) >= 2:
            fixed, per_byte = line_fit(mine, "peak_rss_bytes")
            seconds, per_gb = line_fit(mine, "cpu_s")
            lines.append(f"- Least-squares line: peak RSS = {fixed / 1e9:.2f} GB + {per_byte:.2f} x float weights; "
                         f"CPU time = {seconds:.1f} s + {per_gb * 1e9:.1f} s per GB of float weights")
        whole = [r for r in mine if r.get("process_peak_rss_bytes", r["peak_rss_bytes"]) != r["peak_rss_bytes"]]
        if whole:
            lines.append("- Peak RSS above: read by the process itself when `export_qdq` returned (`VmHWM`). With the "
                         "bench's own check after it (an ONNX Runtime session of the file, a torch forward of the "
                         "float model), the process peaked at "
                         + ", ".join(f"{r['process_peak_rss_bytes'] / 1e9:.2f} GB ({r['float_bytes'] / 1e9:.1f} GB)"
                                     for r in whole))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--pt2e-child"]:  # quantize_command's PyTorch row, in its own process
        width, layers, calib, out = argv[1:5]
        print(json.dumps(pt2e_child(int(width), int(layers), Path(calib), Path(out))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.1,0.5", help="float weights per model, GB, comma-separated")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {list(METHODS)}")
    parser.add_argument("--work", type=Path, default=None, help="folder for the files (default: a temporary one)")
    parser.add_argument("--records", type=Path, default=None,
                        help="JSON-lines file each measurement is appended to as it ends; the table covers every "
                             "record in it (sizes measured by earlier runs included)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this Markdown file")
    args = _smoke.parse_args(parser, argv, sizes="0.002,0.006")
    sizes = sorted(float(s) for s in args.sizes.split(",") if s)  # none: only render --records
    methods = [m for m in args.methods.split(",") if m]
    rows = []
    with tempfile.TemporaryDirectory(prefix="quantship-scale-") as tmp:
        work = args.work or Path(tmp)
        for size in sizes:
            for method in methods:
                row = measure(size, work, method)
                rows.append(row)
                if args.records is not None:
                    with open(args.records, "a") as records:
                        records.write(json.dumps(row) + "\n")
    if args.records is not None:
        rows = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
    table = render(rows, args)
    print(table)
    if args.out is not None:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
