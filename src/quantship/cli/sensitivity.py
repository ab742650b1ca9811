"""``quantship sensitivity MODEL --calib DATA --out-dir DIR``: where a quantized model loses its
signal, layer by layer (SQNR against float), as a table, a PNG, a self-contained HTML report and a
suggested exclusion list for ``quantize --exclude``.

``MODEL`` may be a float ``.onnx`` file: quantship's ONNX quantizer (``quantize-onnx``) then
quantizes it and ``quantize_onnx.sensitivity.node_sqnr`` measures every node its plan quantizes,
in ONNX Runtime; the suggestion is for ``quantize-onnx --exclude``. Both figures are accumulated
up to the layer or node (upstream error included), not that layer's error alone."""

from __future__ import annotations

import argparse

from quantship import targets
from quantship.cli import common, options
from quantship.cli.usage import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser, onnx=True)
    parser.add_argument("--out-dir", required=True, help="where sensitivity.png and sensitivity.html are written")
    parser.add_argument("--k", type=int, default=3, help="how many of the worst layers to suggest excluding")
    common.add_target_argument(parser, default="onnxruntime-cpu", help="deployment preset to quantize with (default onnxruntime-cpu)")
    options.add_quantizer_arguments(parser)
    common.add_calibration_arguments(parser, required=False,
                                     help="a PyTorch model: .npy/.npz array (N x C x H x W) or a folder of images "
                                          "(required); an ONNX model: .npy (one input), .npz keyed by the file's input "
                                          "names, or images (default: seeded data generated per input)")
    common.add_output_arguments(parser)


TORCH_HEADERS = ("#", "node", "module", "op", "SQNR (dB)")
ONNX_HEADERS = ("#", "node", "op", "tensor", "SQNR (dB, accumulated up to the node)")


def html_report(title: str, table_rows: list[tuple], png: bytes, suggested: list[str], summary: str, *,
                command: str = "quantship quantize", headers: tuple[str, ...] = TORCH_HEADERS) -> str:
    """One HTML page with everything inline (the PNG as a data URI): it opens anywhere, offline."""
    import base64
    import html

    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)

    rows = "\n".join(
        "<tr{cls}><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td style='text-align:right'>{}</td></tr>".format(
            *(html.escape(str(c)) for c in row[:5]), cls=" class='worst'" if row[5] else "")
        for row in table_rows)
    image = base64.b64encode(png).decode("ascii")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:70em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px}}tr.worst{{background:#fdd}}</style></head>
<body><h1>{html.escape(title)}</h1><p>{html.escape(summary)}</p>
<p>Suggested exclusions (<code>{html.escape(command)} --exclude {html.escape(' '.join(suggested))}</code>)</p>
<img alt="per-layer SQNR" src="data:image/png;base64,{image}">
<table><tr>{head}</tr>
{rows}</table></body></html>
"""


def suggestion(command: str, args: argparse.Namespace, suggested: list[str], calib: str, target: str) -> str:
    """The command that writes the file with the suggested exclusions, as it can be pasted: every argument it
    needs (the data the report ran on, the target, an ``--out`` beside the model)."""
    import shlex

    stem = args.model.rsplit(":", 1)[0].rsplit("/", 1)[-1].rsplit(".", 1)[0] or "model"
    weights = ["--weights", args.weights] if args.weights and command == "quantize" else []
    return shlex.join(["quantship", command, args.model, *weights, "--calib", calib, "--target", target,
                       "--out", f"{stem}_int8.onnx", "--exclude", *suggested])


def run(args: argparse.Namespace) -> int:
    # imported when the command runs (torch, onnx, numpy behind these), so --help answers at once
    import warnings
    from pathlib import Path

    import torch

    # late: --help answers before numpy, onnx and onnxruntime load
    from quantship import Quantizer, __version__
    from quantship.quantize.layer_error import layer_error, suggest_skip
    from quantship.sources import load_model, weights_origin

    ui = common.Output(args)
    if args.k < 1:
        raise UsageError(f"--k {args.k}: suggest at least one layer")
    out_dir = Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out-dir {args.out_dir} is a file; give a folder")
    if args.model.lower().endswith(".onnx"):
        return _run_onnx(args, ui, out_dir)
    if not args.calib:
        raise UsageError("--calib DATA is required for a PyTorch model (an ONNX model can do without: its data is "
                         "then generated from the file's declared inputs)")
    config = options.read_config(args.config)
    overrides = options.quantizer_options(args, config)
    overrides.pop("max_accuracy_drop", None)
    if overrides.get("smooth_quant") is not None:
        raise UsageError("--smooth-quant: this report compares each layer's output with the unsmoothed model's, "
                         "which smoothing rescales on purpose; run it without --smooth-quant")
    if overrides.get("equalize"):
        raise UsageError("--equalize: this report compares each layer's output with the unequalized model's, "
                         "which equalization rescales per channel on purpose; run it without --equalize")
    target = targets.get(args.target)
    model = load_model(args.model, args.weights, trust_pickle=args.trust_pickle)
    batches = [torch.from_numpy(b) for b in common.read_calibration(args)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = Quantizer.for_target(target, verbose=ui.verbose, **overrides).quantize(
            model, batches, max_calibration_samples=args.max_samples)
        ui.say("sensitivity: measuring every quantized layer output against float")
        report = layer_error(model, qmodel, batches)
    suggested = suggest_skip(report, k=args.k)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = report.plot(out_dir / "sensitivity.png", worst=args.k)
    worst = {r.node for r in report.worst(args.k)}
    rows = [(r.order, r.node, r.module or "(top)", r.op, f"{r.sqnr_db:.1f}", r.node in worst) for r in report.rows]
    summary = (f"{args.model} ({weights_origin(args.model, args.weights)}), {target.target} preset, "
               f"{report.n_samples} calibration sample(s); model output SQNR {report.output_sqnr_db:.1f} dB")
    html_path = out_dir / "sensitivity.html"
    html_path.write_text(html_report(f"quantship sensitivity: {args.model}", rows, png.read_bytes(), suggested,
                                     summary), encoding="utf-8")
    result = {"version": __version__, "command": "sensitivity", "model": args.model, "target": target.target,
              "report": report.as_dict(), "suggested_exclude": suggested,
              "png": str(out_dir / "sensitivity.png"), "html": str(html_path)}
    if ui.json:
        ui.report(result, [])
        return 0
    print(report.to_markdown(worst=args.k))
    print(f"\nsuggested: {suggestion('quantize', args, suggested, args.calib, target.target)}")
    print(f"wrote {out_dir / 'sensitivity.png'} and {html_path}")
    return 0


def _run_onnx(args: argparse.Namespace, ui, out_dir) -> int:
    """A float ONNX file: quantize-onnx's plan and file, then the SQNR of every node it quantizes."""
    # imported when the command runs (onnx, onnxruntime, torch behind these), so --help answers at once
    from quantship import __version__
    from quantship.cli.onnx_input import check_memory, read_feeds, read_float_file
    from quantship.inspect.read.feeds import generated
    from quantship.quantize_onnx.sensitivity import node_sqnr

    refused = [flag for flag, value in (("--weights", args.weights), ("--trust-pickle", args.trust_pickle),
                                        ("--config", args.config), ("--placement", args.placement),
                                        ("--max-drop", args.max_drop)) if value]
    if refused:
        raise UsageError(f"{', '.join(refused)}: not for an ONNX file (quantize-onnx takes --exclude and --observer; "
                         "the accuracy search is quantize-onnx --eval --max-drop)")
    target = targets.get(args.target)
    model, inputs = read_float_file(args.model)
    if args.calib:
        batches, data = read_feeds(args, inputs), f"--calib {args.calib}"
    else:
        fed = generated(model, inputs=inputs)
        batches, data = fed.batches, f"data {fed.describe()}: no --calib given"
    calib = args.calib or str(out_dir / "calibration.npz")  # the generated data, saved for the suggested command
    del model
    check_memory(args.model, batches)
    ui.say(f"sensitivity: quantizing {args.model} for {target.target} on {data}, then every quantized node's "
           "output vs float")
    report = node_sqnr(args.model, batches, target=target, exclude=args.exclude or (), observer=args.observer,
                       smooth_quant=args.smooth_quant)
    suggested = report.suggest_exclude(args.k)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = report.plot(out_dir / "sensitivity.png", worst=args.k)
    if not args.calib:
        import numpy as np

        np.savez(calib, **{name: np.concatenate([b[name] for b in batches]) for name in batches[0]})
    worst = set(suggested)
    rows = [(r.order, r.node, r.op, r.tensor, f"{r.sqnr_db:.1f}", r.node in worst) for r in report.rows]
    summary = (f"{args.model}, {target.target} preset, {report.n_samples} calibration sample(s) ({data}), read in ONNX "
               f"Runtime; each figure is the error accumulated up to that node (not the node's alone); model "
               f"output SQNR {report.output_sqnr_db:.1f} dB")
    html_path = out_dir / "sensitivity.html"
    html_path.write_text(html_report(f"quantship sensitivity: {args.model}", rows, png.read_bytes(), suggested,
                                     summary, command=f"quantship quantize-onnx {args.model}",
                                     headers=ONNX_HEADERS), encoding="utf-8")
    result = {"version": __version__, "command": "sensitivity", "model": args.model, "target": target.target,
              "engine": "quantize_onnx", "data": data, "report": report.as_dict(), "suggested_exclude": suggested,
              "png": str(png), "html": str(html_path)}
    if ui.json:
        ui.report(result, [])
        return 0
    print(report.to_markdown(worst=args.k))
    print(f"\ncalibration: {data}")
    print(f"suggested: {suggestion('quantize-onnx', args, suggested, calib, target.target)}" if suggested else
          "suggested: nothing to exclude (keeping the one weighted node float would leave no integer kernel)")
    print(f"wrote {png} and {html_path}")
    return 0
