"""The three-way check: float file in ONNX Runtime, INT8 file in ONNX Runtime, INT8 file in a target.

Row 1 (INT8 ORT vs float) is what quantization cost; row 2 (target vs INT8 ORT) is what the
runtime adds. Both in the INT8 file's output LSB, on the same seeded inputs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantship import targets
from quantship.errors import NoOutputScale, one_line
from quantship.inspect.read.feeds import for_run
from quantship.inspect.read.inputs import declared_inputs, graph_inputs
from quantship.inspect.read.loading import load_onnx
from quantship.inspect.read.lsb import output_scales
from quantship.inspect.run.consumers import (
    RUNNERS,
    constant_reference,
    lsb_between,
    run_onnxruntime,
)
from quantship.targets import Target

REPORT_VERSION = 1


@dataclass(frozen=True)
class CompareRow:
    """One comparison: candidate vs reference, in output LSB (None when it could not run)."""

    label: str
    max_lsb: float | None
    mean_lsb: float | None
    note: str = ""

    def __str__(self) -> str:
        if self.max_lsb is None:
            return f"{self.label:<38}: not run ({self.note})"
        return f"{self.label:<38}: max {self.max_lsb:.1f} LSB, mean {self.mean_lsb:.2f} LSB"


@dataclass
class CompareReport:
    """The two rows of the three-way check and what they were measured on."""

    float_path: str
    int8_path: str
    target: str
    n_batches: int  # runs of each file, one batch each
    n_samples: int  # inputs in those batches (batches x the file's batch size)
    rows: list[CompareRow] = field(default_factory=list)
    version: int = REPORT_VERSION
    inconclusive: str = ""  # why the rows prove nothing (e.g. the float output is the same for every input)
    inputs: str = ""  # what the files ran on: "given", "from PATH", or "generated (how, per input)"

    def as_dict(self) -> dict:
        out = {"report": "quantship-compare", **asdict(self)}
        return out

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


def compare_files(float_path: str | Path, int8_path: str | Path, target: str | Target = "tigris",
                  n_inputs: int = 20, seed: int = 0, inputs: Any = None, *, key: str | None = None) -> CompareReport:
    """Run the three-way check; outputs are matched by position, the INT8 file's scales give the LSB.

    ``inputs``: real data, read by the one loader (``feeds.for_run``: a path, an array, a dict by input
    name or a list of batches; all of it, cut at the file's batch size); None: ``n_inputs`` batches
    generated for each input's dtype and range, which overstates what quantization costs a model
    calibrated on real data.
    """
    tgt = targets.get(target)  # a name or alias is resolved here; a Target passes
    if n_inputs < 1:
        raise ValueError(f"n_inputs={n_inputs}: compare needs at least one input")
    float_model, int8_model = load_onnx(float_path), load_onnx(int8_path)
    declared_inputs(float_model, float_path), declared_inputs(int8_model, int8_path)  # positive, sane dims
    scales = list(output_scales(int8_model).values())
    if not any(scales):
        raise NoOutputScale(f"{int8_path}: no output is produced by a per-tensor DequantizeLinear, so there is "
                         "no output LSB to measure in; is it the INT8 file?")
    if len(float_model.graph.output) != len(int8_model.graph.output):
        raise ValueError(f"the float file has {len(float_model.graph.output)} outputs and the INT8 file "
                         f"{len(int8_model.graph.output)}: they are not the same model")
    fed = for_run(int8_model, inputs, n=n_inputs if inputs is None else 1 << 30, seed=seed, key=key, path=int8_path)
    feeds = fed.batches
    float_names = [value.name for value in graph_inputs(float_model)]
    float_feeds = [dict(zip(float_names, feed.values())) for feed in feeds]
    reference = run_onnxruntime(float_path, float_feeds, optimize=False)
    int8_ort = run_onnxruntime(int8_path, feeds, optimize=False)
    n_samples = sum(int(next(iter(feed.values())).shape[0]) if next(iter(feed.values())).ndim else 1 for feed in feeds)
    report = CompareReport(str(float_path), str(int8_path), tgt.name, n_batches=len(feeds), n_samples=n_samples,
                           inputs=fed.describe())
    if constant_reference(reference):
        report.inconclusive = ("the float file's output is the same for every input, so these rows prove "
                               "nothing; pass real inputs (--inputs) or a trained model")
    report.rows.append(CompareRow("ONNX Runtime int8 vs float", *lsb_between(reference, int8_ort, scales)))
    label = ("ONNX Runtime optimized vs literal int8" if tgt.runtime_is_onnxruntime
             else f"{tgt.consumer} vs ONNX Runtime int8")
    if tgt.runner is None:
        report.rows.append(CompareRow(label, None, None, f"{tgt.consumer} cannot run on this machine"))
        return report
    try:
        candidate = RUNNERS[tgt.runner](int8_path, feeds, int8_model)
    except Exception as exc:  # the target refusing the file is a result, not a crash
        report.rows.append(CompareRow(label, None, None, one_line(exc, 200)))
        return report
    report.rows.append(CompareRow(label, *lsb_between(int8_ort, candidate, scales)))
    return report
