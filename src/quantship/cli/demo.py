"""``quantship demo``: the main job on a built-in example."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import json

    import torch

    from quantship import Quantizer, quant_spec
    from quantship.examples.models import TinyResNet
    from quantship.precision import precision_table

    torch.manual_seed(0)
    model = TinyResNet().eval()
    calibration = [torch.randn(8, 1, 32, 32) for _ in range(4)]
    quantizer = Quantizer(backend="pt2e", verbose=not args.json)
    qmodel = quantizer.quantize(model, calibration)
    spec = quant_spec(qmodel)
    names = {str(n.target).split(".")[-2] for n in qmodel.graph.nodes if n.op == "call_function"}
    quantized = {
        "per_channel_weights": sum(1 for n in qmodel.graph.nodes if "dequantize_per_channel" in str(n.target)),
        "activation_quantize_ops": sum(1 for n in qmodel.graph.nodes if "quantize_per_tensor" in str(n.target)
                                       and "dequantize" not in str(n.target)),
        "ops": sorted(names),
    }
    if args.json:
        print(json.dumps({"version": 1, "spec": spec.as_dict(), "label": spec.label, "quantized": quantized}))
        return 0
    row = [line for line in precision_table().splitlines() if line.startswith(f"| `{spec.backend}` | {spec.method} ")]
    print(f"\nresolved spec ({spec.label}, exports={spec.exports}):\n  {spec.as_dict()}")
    print("\nsupport-matrix row:\n  " + row[0])
    print(f"\nquantized: {quantized['per_channel_weights']} weight tensor(s) per channel, "
          f"{quantized['activation_quantize_ops']} activation quantize op(s)")
    return 0
