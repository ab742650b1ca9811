"""Rows of ``quantship quantize``'s report: ``--eval`` (top-1 of FP32, INT8 torch and the INT8 file on labelled
data, a model with one input), the accuracy-aware search, and what the file leaves in float."""

from __future__ import annotations

from typing import Any

from quantship.cli import common
from quantship.cli.usage import UsageError
from quantship.progress import step


def read_labelled_batches(run) -> None:
    """``--eval``: the labelled data, and the same cut into batches of the calibration batch size."""
    if not run.args.eval:
        return
    # imported when the command runs (torch, numpy behind these), so --help answers at once
    import torch

    from quantship.cli.labelled import read_labelled

    if len(run.data.names) != 1:
        raise UsageError(f"--eval scores top-1 of a model with one input; this one takes {run.data.names}")
    run.labelled = labelled = read_labelled(run.args.eval, common.preprocessing(run.args))
    bs = run.data.batches[0].shape[0]
    run.labelled_batches = [(torch.from_numpy(labelled.x[i:i + bs]), torch.from_numpy(labelled.y[i:i + bs]))
                            for i in range(0, (len(labelled.y) // bs) * bs, bs)]


def accuracy_rows(run, result: dict) -> list[tuple[str, str]]:
    """``--eval``'s top-1 of FP32, INT8 torch and the INT8 file, and the accuracy-aware search (into ``result``)."""
    # imported when the command runs (torch, onnxruntime behind these), so --help answers at once
    from quantship.cli.labelled import file_runner, top1, torch_runner

    rows: list[tuple[str, str]] = []
    labelled = run.labelled
    if labelled is not None:
        bs = run.data.batches[0].shape[0]
        runners = {"fp32_torch": ("FP32 torch", lambda: torch_runner(run.model)),
                   "int8_torch": ("INT8 torch", lambda: torch_runner(run.qmodel)),
                   "int8_file_ort": ("INT8 file in ORT", lambda: file_runner(run.path))}
        accuracy = {}
        for key, (what, runner) in runners.items():
            with step(f"--eval: top-1 of {what} on {len(labelled.y)} sample(s)"):
                accuracy[key] = top1(runner(), labelled, bs)
        result["accuracy"] = {k: v.as_dict() for k, v in accuracy.items()}
        rows = [("top-1 FP32 (torch)", accuracy["fp32_torch"].describe()),
                ("top-1 INT8 (torch)", accuracy["int8_torch"].describe()),
                ("top-1 INT8 (file, ORT)", accuracy["int8_file_ort"].describe())]
    search = run.quantizer.accuracy_search
    if search is not None:
        result["accuracy_search"] = search.as_dict()
        rows.append(("accuracy-aware search", f"{len(search.steps)} quantization(s); kept in "
                     f"float: {', '.join(search.chosen.excluded) or 'nothing'}"))
    return rows


def precision_row(spec: Any, target: Any) -> tuple[str, str]:
    """The precision, the target's preset and its activation type, and the modules stored in 16 bits."""
    wide = f"; 16-bit activations in {', '.join(spec.int16)}" if spec.int16 else ""
    return "precision", f"{spec.label} {target.target} preset ({target.activation_dtype} activations{wide})"


def float_rows(left_float: dict) -> list[tuple[str, str]]:
    """What the file leaves in float (``export.torch_file.left_float``), and why."""
    # onnx loads with the reader: when the command runs, so --help answers at once
    from quantship.inspect.read.float_ops import describe_float_ops

    no_rule, requested = left_float["no_int8_rule"], left_float["requested_but_int8"]
    return [("left in float", describe_float_ops(left_float)),
            *([("no INT8 rule (torch ops)", "; ".join(f"{m}: {', '.join(ops)}" for m, ops in no_rule.items()))]
              if no_rule else []),
            *([("kept float on request, yet INT8", ", ".join(requested) + " (other ops quantize what these modules "
                "read and write, so their compute ops run in INT8)")] if requested else [])]
