"""Where a zoo model's file parts from the torch quantized model, layer by layer; and how much one step costs.

Same recipe as bench/zoo.py's run_model (weights=None, seed 0, 2 random calibration batches, one
sample, the onnxruntime-cpu preset). For each model it prints:

- the per-layer divergence table of ``quantship.inspect.run.divergence.trace_divergence``: propagated
  error (file and torch each run end to end) and local error (torch fed the file's quantized inputs);
- the output error in output LSB over ``--samples`` random inputs, with the local flips behind it;
- ``--inject``: torch against itself with one quantized activation moved by one step (a random
  non-saturated element of a random layer): the output error a single one-step rounding flip causes
  in this network, with no file involved.

    python bench/lsb_trace.py --models inception_v3 regnet_x_32gf --samples 8 --inject 12
    python bench/lsb_trace.py --smoke   # resnet18 at 32x32, one sample, one injection (bench/_smoke.py)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))
qd = torch.ops.quantized_decomposed


def build(name: str, size: int, workdir: Path, observer: str):
    import torchvision

    from quantship import Quantizer, export_qdq

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).eval()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(1, 3, size, size, generator=gen) for _ in range(2)]
    sample = torch.randn(1, 3, size, size, generator=gen)
    quantized = Quantizer.for_target("onnxruntime-cpu", act_observer=observer).quantize(model, calib)
    path = export_qdq(quantized, sample, workdir / f"{name}.onnx", target="onnxruntime-cpu")
    return quantized, path, sample


def torch_output(model, x: torch.Tensor, inject: tuple | None = None) -> np.ndarray:
    """The model's first output; ``inject=(quantize node, flat index, +-1)`` moves one quantized value one step."""

    class Injector(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            if inject is not None and node is inject[0]:
                result = result.clone()
                flat = result.view(-1)
                flat[inject[1]] = int(flat[inject[1]]) + inject[2]
            return result

    with torch.no_grad():
        out = Injector(model).run(x)
    return (out[0] if isinstance(out, (tuple, list)) else out).numpy()


def file_output(path: Path, x: torch.Tensor) -> np.ndarray:
    from quantship.inspect import ort_session, run_session

    return run_session(ort_session(path), [x.numpy()])[0]


def injections(model, x: torch.Tensor, scale: float, n: int, rng: np.random.Generator) -> list[tuple[int, float]]:
    """(layer position, output LSB) for ``n`` single one-step changes inside the torch model."""
    quantizers = [nd for nd in model.graph.nodes if nd.op == "call_function" and nd.target == qd.quantize_per_tensor.default]
    values = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            if node in quantizers:
                values[node] = result.numpy().reshape(-1)
            return result

    with torch.no_grad():
        Recorder(model).run(x)
    reference = torch_output(model, x)
    found = []
    while len(found) < n:
        position = int(rng.integers(len(quantizers) - 1))  # never the output's own quantizer
        node = quantizers[position]
        lo, hi = int(node.args[3]), int(node.args[4])
        inside = np.flatnonzero((values[node] > lo) & (values[node] < hi))
        if inside.size:
            moved = torch_output(model, x, (node, int(rng.choice(inside)), int(rng.choice([-1, 1]))))
            found.append((position, float(np.abs(moved - reference).max() / scale)))
    return found


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import _smoke

    from quantship.inspect import output_scales, trace_divergence

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["inception_v3", "regnet_x_32gf"])
    parser.add_argument("--sizes", nargs="*", type=int, help="input size per model (default: 96 for inception_v3, "
                                                              "else 32, as bench/zoo.py picks them)")
    parser.add_argument("--observer", default="minmax")
    parser.add_argument("--samples", type=int, default=4, help="random inputs for the output-error distribution")
    parser.add_argument("--inject", type=int, default=8, help="single one-step changes injected in torch")
    args = _smoke.parse_args(parser, argv, models=["resnet18"], sizes=[32], samples=1, inject=1)
    sizes = args.sizes or [96 if m == "inception_v3" else 32 for m in args.models]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in zip(args.models, sizes):
            quantized, path, sample = build(name, size, Path(tmp), args.observer)
            scale = next(iter(output_scales(path).values()))
            report = trace_divergence(quantized, path, sample)
            print(f"## {name} (input {size}, output scale {scale:.6g})\n\n{report}\n\n{report.table()}\n")
            gen = torch.Generator().manual_seed(100)
            print("| sample | output error, LSB | local flips (max step) | first local flip at |\n|---|---|---|---|")
            for k in range(args.samples):
                x = sample if k == 0 else torch.randn(sample.shape, generator=gen)
                err = np.abs(torch_output(quantized, x) - file_output(path, x)).max() / scale
                r = trace_divergence(quantized, path, x)
                first = r.first_local
                print(f"| {k} | {err:.0f} | {r.n_local} ({r.max_local}) | "
                      f"{f'#{first.order} of {len(r.rows)}' if first else '-'} |")
            if args.inject:
                found = injections(quantized, sample, scale, args.inject, rng)
                print("\none-step change injected in torch (no file): layer -> output LSB: "
                      + ", ".join(f"#{p}: {e:.0f}" for p, e in sorted(found)))
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
