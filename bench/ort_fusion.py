"""What ONNX Runtime fuses in the onnxruntime-cpu preset's files, on small models.

For each model, the INT8 file quantship writes (``Quantizer.for_target("onnxruntime-cpu")`` then
``export_qdq``) and the FP32 file (``export_onnx``) from the same untrained weights (``weights=None``,
seed 0; parameters that hold one value everywhere, such as a zero classifier head or ConvNeXt's 1e-6
layer scale, are perturbed so that outputs and LSB figures are not vacuous).

Printed for the INT8 file: ONNX Runtime's integer kernels in its optimized graph (the census of
``quantship.inspect.ort_optimized_ops``), the ops it still computes in float with the reason read
off the graph, the max error vs the torch quantized model in output LSB (ORT literal / ORT default
optimizations, on 4 seeded inputs); and the median latency of both files at ORT's default
optimizations (timed in one process, interleaved round by round, with ``bench/latency.py``'s loop).
The placement before quantship's fusion-driven rewrites (Add/Mul constants, the attention scale, einsums,
Relu requantization) is no longer in the library, so it is not measured here.

    python bench/ort_fusion.py [--models vit convnext densenet maxvit_small maxvit] [--runs 50]
    python bench/ort_fusion.py --smoke   # the 2-layer ViT at 32x32, one run (bench/_smoke.py)
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))

INTEGER_KERNELS = ("QLinearConv", "QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "QAttention",
                   "QLinearAdd", "QLinearMul", "QLinearSoftmax", "QLinearConcat", "QLinearGlobalAveragePool",
                   "QLinearAveragePool", "QLinearSigmoid")
# data movement only: not counted as float compute
LAYOUT_OPS = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Shape", "Gather", "Concat", "Expand", "Split",
              "Slice", "Flatten", "Constant", "Identity", "QuantizeLinear", "DequantizeLinear", "Pad"}
# ops ORT's CPU QDQ selectors turn into an integer kernel (qdq_selector_action_transformer.cc)
QDQ_FUSABLE = {"Conv", "MatMul", "Gemm", "Add", "Mul", "Concat", "AveragePool", "GlobalAveragePool", "LeakyRelu",
               "Sigmoid", "Softmax", "Where"}


def _models() -> dict:
    import torchvision
    from torchvision.models.vision_transformer import VisionTransformer

    return {
        "vit": (lambda: VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64,
                                          mlp_dim=128, num_classes=10), 32),
        "convnext": (lambda: torchvision.models.convnext_tiny(), 32),
        "densenet": (lambda: torchvision.models.densenet121(), 32),
        "maxvit": (lambda: torchvision.models.maxvit_t(), 224),
        # maxvit_t's block kinds (MBConv, block and grid attention with einsum products) at a size that
        # quantizes in seconds: one stage of one layer, 32x32 input
        "maxvit_small": (lambda: torchvision.models.maxvit.MaxVit(
            input_size=(32, 32), stem_channels=16, partition_size=4, block_channels=[32], block_layers=[1],
            head_dim=16, stochastic_depth_prob=0.0, num_classes=10), 32),
    }


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter holding a single value everywhere gets seeded noise (std 0.1) added."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and float(p.std()) == 0:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def float_leftovers(path: Path) -> collections.Counter:
    """(op, reason) -> count, for every node ONNX Runtime's optimized graph computes in float."""
    from quantship.inspect import ort_session

    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "optimized.onnx"
        ort_session(path, optimized=True, optimized_model_filepath=saved)
        graph = onnx.load(str(saved)).graph
    producer = {out: n for n in graph.node for out in n.output}
    consumers: dict[str, list] = collections.defaultdict(list)
    for n in graph.node:
        for name in n.input:
            consumers[name].append(n)
    initializers = {i.name: i for i in graph.initializer}

    def dq_dtype(name: str) -> str | None:
        node = producer.get(name)
        if node is None or node.op_type != "DequantizeLinear":
            return None
        zp = initializers.get(node.input[2]) if len(node.input) > 2 else None
        return "?" if zp is None else onnx.helper.tensor_dtype_to_np_dtype(zp.data_type).name

    def integer_input(name: str) -> bool:  # ORT dropped the Q/DQ around it (MaxPool): it reads integers
        node = producer.get(name)
        return node is not None and (node.op_type == "QuantizeLinear" or node.op_type.startswith(("QLinear", "QGemm")))

    found: collections.Counter = collections.Counter()
    for n in graph.node:
        if n.op_type in LAYOUT_OPS or n.op_type in INTEGER_KERNELS or n.op_type.startswith("QLinear"):
            continue
        if n.input and integer_input(n.input[0]):
            continue
        activation = next((a.s.decode() for a in n.attribute if a.name == "activation"), None)
        if n.op_type.startswith("Fused") and activation == "Relu":
            reason = ("fused in float with its Relu: the Relu's QuantizeLinear zero-point is not the type's "
                      "minimum, so ORT's ReluQuantFusion keeps the Relu and the QDQ selector never sees Conv -> Q")
        elif n.op_type not in QDQ_FUSABLE:
            reason = "no QDQ fusion for this op in ORT's CPU selectors"
        else:
            data = [i for i in n.input[:2] if i]
            dtypes = [dq_dtype(i) for i in data]
            outs = [c.op_type for c in consumers[n.output[0]]]
            if any(d is None for d in dtypes):
                reason = "an input is not a DequantizeLinear (" + ", ".join(
                    "initializer" if i in initializers else (producer[i].op_type if i in producer else "graph input")
                    for i, d in zip(data, dtypes) if d is None) + ")"
            elif len(set(dtypes)) > 1:
                reason = f"input dtypes differ ({' vs '.join(dtypes)})"
            elif outs != ["QuantizeLinear"]:
                reason = f"output read by {outs or 'the graph output'}, not one QuantizeLinear"
            else:
                reason = "QDQ group present but not fused"
        found[(n.op_type, reason)] += 1
    return found


def build_files(name: str, workdir: Path) -> tuple[Path, Path, object, int]:
    """The FP32 file, the INT8 file, the INT8 file's readings against the torch quantized model, the input size."""
    from quantship import Quantizer, export_onnx, export_qdq
    from quantship.inspect import measure_readings, torch_outputs

    make, size = _models()[name]
    torch.manual_seed(0)
    model = perturbed(make().eval())
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(1, 3, size, size, generator=gen) for _ in range(2)]
    sample = torch.randn(1, 3, size, size, generator=gen)
    check = torch.randn(4, 3, size, size, generator=gen)
    fp32 = export_onnx(model, sample, workdir / f"{name}_fp32.onnx")
    qmodel = Quantizer.for_target("onnxruntime-cpu", act_observer="minmax").quantize(model, calib)
    int8 = export_qdq(qmodel, sample, workdir / f"{name}_int8.onnx", target="onnxruntime-cpu")
    readings = measure_readings(int8, [[check.numpy()]], torch_outputs(qmodel, [check]))
    return fp32, int8, readings, size


def main(argv: list[str] | None = None) -> int:
    import _smoke
    from latency import _time

    from quantship.inspect import cpu_info, ort_optimized_ops

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["vit", "convnext", "densenet"], choices=sorted(_models()))
    parser.add_argument("--runs", type=int, default=50)
    args = _smoke.parse_args(parser, argv, models=["vit"], runs=1)
    cpu, flags = cpu_info()
    print(f"CPU: {cpu} ({'VNNI' if {'avx512_vnni', 'avx_vnni'} & flags else 'no VNNI'})")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            fp32, int8, readings, size = build_files(name, Path(tmp))
            times = _time({"FP32": fp32, "INT8": int8}, 1, args.runs, 5, size=size)
            print(f"\n## {name} (input {size}, batch 1)")
            ops = ort_optimized_ops(int8)
            kernels = ", ".join(f"{k} {ops[k]}" for k in INTEGER_KERNELS if ops[k])
            print(f"- INT8: LSB literal {readings.literal_lsb:.0f} / fused {readings.fused_lsb:.0f}; "
                  f"median {statistics.median(times['INT8']):.3f} ms ({args.runs} interleaved runs)")
            print(f"  integer kernels: {kernels}")
            for (op, reason), n in sorted(float_leftovers(int8).items()):
                print(f"  float: {n} x {op}: {reason}")
            print(f"- FP32: median {statistics.median(times['FP32']):.3f} ms")
            ratio = np.median(times["FP32"]) / np.median(times["INT8"])
            print(f"- INT8 is {ratio:.3f}x the speed of FP32")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
