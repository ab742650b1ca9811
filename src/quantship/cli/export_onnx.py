"""``quantship export-onnx MODEL --out FLOAT.onnx``: the float file that ``compare`` and
``quantize-onnx`` start from, exported by the same dynamo exporter as the INT8 path."""

from __future__ import annotations

import argparse

from quantship import __version__
from quantship.cli import common
from quantship.cli.usage import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser)
    parser.add_argument("--out", required=True, help="the float ONNX file to write")
    parser.add_argument("--shape", required=True, metavar="N,C,H,W",
                        help="the example input's shape, e.g. 1,3,224,224 (the batch dimension stays symbolic "
                             "unless --static-batch)")
    parser.add_argument("--static-batch", action="store_true", help="keep the batch dimension fixed at N")
    parser.add_argument("--opset", type=int, default=18, help="ONNX opset of the float file: 17 or higher (default 18; an INT8 file from quantize is 17 or 18)")
    common.add_output_arguments(parser)


def parse_shape(text: str) -> tuple[int, ...]:

    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(","))
    except ValueError:
        raise UsageError(f"--shape {text!r}: give integers separated by commas, e.g. 1,3,224,224") from None
    if not dims or any(d < 1 for d in dims) or any(d > 1 << 16 for d in dims):
        raise UsageError(f"--shape {text!r}: every dimension must be between 1 and 65536")
    return dims


def run(args: argparse.Namespace) -> int:
    common.output_path(args.out, common.input_files(args))  # before any import or the model's code runs
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    import torch

    from quantship.export import export_onnx
    from quantship.inspect.read.loading import file_size
    from quantship.sources import load_model, weights_origin

    ui = common.Output(args)
    shape = parse_shape(args.shape)
    model = load_model(args.model, args.weights, trust_pickle=args.trust_pickle)
    dynamic = not args.static_batch
    if dynamic and shape[0] == 1:
        shape = (2, *shape[1:])  # torch.export specialises a batch of 1; any other size stays symbolic
    sample = torch.zeros(shape).normal_(generator=torch.Generator().manual_seed(0))
    ui.say(f"exporting {args.model} at input {'x'.join(map(str, shape))} ({'any' if dynamic else 'fixed'} batch)")
    path = export_onnx(model, sample, args.out, opset_version=args.opset, dynamic_batch=dynamic)
    size = file_size(path)
    result = {"version": __version__, "command": "export-onnx", "model": args.model,
              "weights": weights_origin(args.model, args.weights), "path": args.out, "size_bytes": size,
              "dynamic_batch": dynamic, "opset": args.opset}
    ui.report(result, [("file", f"{args.out} ({size / 1e6:.2f} MB)"), ("weights", result["weights"]),
                       ("batch", "any (symbolic)" if dynamic else f"fixed at {shape[0]}"), ("opset", str(args.opset))],
              title="quantship export-onnx")
    return 0
