"""Integer LSTMs (ONNX Runtime's DynamicQuantizeLSTM) against FP32 on the keyword example, per hidden size.

For each hidden size: the example (``quantship.examples.keywords``: log mel frames -> LSTM -> Linear, trained
here, deterministic, cached) exported to ONNX; the default ``quantize_onnx_file`` file for onnxruntime-cpu
(its LSTM as DynamicQuantizeLSTM from 64 hidden units: the target's speed rule) and the same with
``exclude=["LSTM"]`` (the LSTM float, the head still INT8). Each file's top-1 accuracy on the held-out clips in ONNX Runtime at its default optimizations, with a
Wilson 95% interval; its output SQNR against the FP32 file's; and its speed against the FP32 file
(``inspect.run.speed.measure_speed``: one ONNX Runtime thread, thread CPU time, interleaved, median) at batch
1 and the calibration batch. The CPU and its int8 flags are printed with the table.

    python bench/recurrent.py                      # hidden 64, 128, 256
    python bench/recurrent.py --hidden 32,512 --budget 12
    python bench/recurrent.py --smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import _smoke


def row(label: str, acc: tuple[int, int], sqnr: float | None, speed) -> str:
    from quantship.inspect import wilson_interval

    k, n = acc
    low, high = wilson_interval(k, n)
    shown = "-" if sqnr is None else f"{sqnr:.1f}"
    if speed is None:
        timing = "| - | - |"
    else:
        timing = "".join(f"| {speed.fp32_ms[b]:.3f} / {speed.int8_ms[b]:.3f} ms, {speed.speedup[b]:.2f}x "
                         for b in speed.batches) + "|"
    return f"| {label} | {100 * k / n:.1f}% [{100 * low:.1f}, {100 * high:.1f}] ({k}/{n}) | {shown} {timing}"


def one_size(hidden: int, folder: Path, args: argparse.Namespace) -> list[str]:
    import torch

    from quantship import output_sqnr_db as sqnr_db
    from quantship.examples import keywords
    from quantship.export import export_onnx
    from quantship.inspect import measure_speed, ort_session
    from quantship.quantize_onnx import quantize_onnx_file

    model = (keywords.train(hidden, epochs=1, n_train=args.train_samples) if args.train_samples
             else keywords.trained_model(hidden))
    calib, test = keywords.calibration(), keywords.held_out()
    test = keywords.Split(test.x[:args.held_out], test.y[:args.held_out])
    fp32 = export_onnx(model, torch.from_numpy(calib.x[:8]), folder / f"keywords_lstm{hidden}.onnx")
    files = {"FP32": fp32}
    for label, exclude in (("INT8, default file", ()), ("INT8, LSTM float (--exclude LSTM)", ("LSTM",))):
        out = folder / f"keywords_lstm{hidden}_{len(files)}.onnx"
        done = quantize_onnx_file(fp32, out, calib.x, target="onnxruntime-cpu", exclude=exclude, run_check=False)
        census = done.census["integer"]
        files[f"{label}: {census.get('DynamicQuantizeLSTM', 0)} DynamicQuantizeLSTM"] = out
    outputs = {label: ort_session(path, optimized=True).run(None, {"x": test.x})[0] for label, path in files.items()}
    lines = []
    for label, path in files.items():
        speed = None if label == "FP32" else measure_speed(path, fp32, {"x": calib.x}, (1, len(calib.x)),
                                                           budget=args.budget)
        sqnr = None if label == "FP32" else sqnr_db(outputs["FP32"], outputs[label])
        lines.append(row(f"hidden {hidden}: {label}", keywords.accuracy(outputs[label], test.y), sqnr, speed))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="64,128,256", help="LSTM hidden sizes, comma separated")
    parser.add_argument("--budget", type=float, default=8.0, help="seconds of timing per INT8 file (both batches)")
    parser.add_argument("--held-out", type=int, default=None, help="held-out clips to score (default: all)")
    parser.add_argument("--train-samples", type=int, default=0,
                        help="train one epoch on this many clips instead of the cached model (smoke)")
    args = _smoke.parse_args(parser, argv, hidden="64", budget=0.5, held_out=64, train_samples=128)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from quantship.examples import keywords
    from quantship.inspect import cpu_line

    batch = keywords.N_CALIBRATION
    print(f"CPU: {cpu_line()}; ONNX Runtime, 1 thread, thread CPU time, interleaved, median; "
          f"FP32 / INT8 at batch 1 and {batch}")
    print(f"\n| file | top-1 [Wilson 95%] | output SQNR vs FP32, dB | batch 1 | batch {batch} |")
    print("|---|---|---:|---|---|")
    with tempfile.TemporaryDirectory(prefix="quantship-recurrent-") as scratch:
        for hidden in (int(h) for h in args.hidden.split(",")):
            for line in one_size(hidden, Path(scratch), args):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
