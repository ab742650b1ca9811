"""INT4 (or INT8) weight-only quantization of a float ONNX file: every MatMul whose weight is a stored 2-D
float tensor becomes one ``com.microsoft.MatMulNBits`` node (codes packed low nibble first, one scale per
``group`` weights along K, symmetric, round to nearest), in ONNX Runtime's form that ``export.weight_only``
writes for the PyTorch path. No calibration: the weights alone are read, one at a time, from a mapping of
the file's external data when it has some, so the float weights are never all held at once.

The MatMulNBits nodes carry ``export.weight_only.default_accuracy_level`` unless asked: 4 for 8 bits (int8
activations inside the kernel; at 0 ONNX Runtime's 8-bit kernel runs far slower than FP32), 0 for 4 bits.
The written file is run in ONNX Runtime (default optimizations) on the given samples against the float
file, its fidelity measured (``quantship.fidelity``) as written and at level 0 (float activations, the
stored arithmetic) and stored in its metadata; with ``speed`` it is timed against the float file on this
CPU (``export.speed_gate``: batch 1 and a larger batch, one thread, a few seconds), ``require_faster``
refusing a slower file. Nothing appears at the destination unless it runs and its outputs are finite
(``export.artifact``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantship.errors import ExportRefused, cause
from quantship.export import artifact, speed_gate
from quantship.export.metadata import add_file_metadata
from quantship.export.weight_only import (
    QuantizedWeight,
    default_accuracy_level,
    set_accuracy_level,
    speed_hint,
    to_matmul_nbits,
)
from quantship.fidelity import METADATA_KEY as FIDELITY_KEY
from quantship.fidelity import Fidelity
from quantship.fidelity import measure as measure_fidelity
from quantship.inspect.read.feeds import as_feeds, model_inputs
from quantship.inspect.read.loading import load_onnx
from quantship.inspect.run.consumers import joined, ort_session
from quantship.inspect.run.weight_only import without_accuracy_level
from quantship.quantize_onnx import memory
from quantship.quantize_onnx.quantizer import ENGINE_KEY, unmap

ENGINE = "quantize_onnx.weight_only"
FORMAT_KEY = "quantship.weight_format"
GROUP = 128  # weights per scale along K (MatMulNBits: a power of two, at least 16)
GROUPS = (128, 64, 32)  # choose_group: the largest of these dividing every weight's K
SPEED_BATCH = 8  # timed at batch 1 and this batch when the samples' own batch is 1


@dataclass(frozen=True)
class WeightOnlyResult:
    """What ``quantize_weight_only_file`` wrote and measured."""

    path: Path
    bits: int
    group: int
    n_matmul_nbits: int
    kept_float: list[str]  # weighted MatMuls left float (weight not 2-D float, shared, or K not a multiple of group)
    fp32: Fidelity  # the file as written, against the float file
    accuracy_level: int = 0  # the MatMulNBits nodes' attribute
    exact: Fidelity | None = None  # the same file at accuracy_level 0 (None: it is written at 0)
    speed: Any = None  # inspect.run.speed.SpeedReading against the float file (None: not timed)

    def as_dict(self) -> dict:
        return {"path": str(self.path), "engine": ENGINE, "bits": self.bits, "group": self.group,
                "n_matmul_nbits": self.n_matmul_nbits, "kept_float": self.kept_float,
                "accuracy_level": self.accuracy_level, "fidelity_fp32": self.fp32.as_dict(),
                "fidelity_fp32_accuracy_level_0": self.exact.as_dict() if self.exact is not None else None,
                "speed": self.speed.as_dict() if self.speed is not None else None}


def choose_group(float_path: str | Path) -> int:
    """The largest of ``GROUPS`` dividing the K of every MatMul over a stored 2-D float weight (the smallest
    when none divides them all: the others are kept float, and said)."""
    graph = load_onnx(Path(float_path).expanduser(), external_data=False).graph
    shapes = {t.name: tuple(t.dims) for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    widths = {shapes[n.input[1]][0] for n in graph.node
              if n.op_type == "MatMul" and len(n.input) == 2 and len(shapes.get(n.input[1], ())) == 2}
    return next((g for g in GROUPS if widths and all(k % g == 0 for k in widths)), GROUPS[-1])


def quantize_rows(weight: np.ndarray, bits: int, group: int) -> QuantizedWeight:
    """``weight`` [K, N] (a MatMul's B) as codes [N, K] with one symmetric scale per ``group`` along K."""
    rows = np.ascontiguousarray(weight.T, dtype=np.float32)  # [N, K], as MatMulNBits stores it
    n, k = rows.shape
    top = (1 << (bits - 1)) - 1
    blocks = rows.reshape(n, k // group, group)
    scale = np.abs(blocks).max(axis=2) / top
    scale[scale == 0] = 1.0
    codes = np.clip(np.rint(blocks / scale[:, :, None]), -top - 1, top).astype(np.int8).reshape(n, k)
    return QuantizedWeight("", codes, scale.astype(np.float32), None, bits, group, np.empty(0, np.float32))


def quantize_weight_only_file(float_path: str | Path, out_path: str | Path, samples: Any, *, bits: int = 4,
                              group: int = GROUP, accuracy_level: int | None = None,
                              speed: bool = False, require_faster: bool = False,
                              wait: bool = True) -> WeightOnlyResult:
    """Write ``out_path``: the float file at ``float_path`` with every MatMul over a stored 2-D weight whose K
    is a multiple of ``group`` as MatMulNBits (``bits`` 4 or 8, ``accuracy_level`` on every node; None:
    ``export.weight_only.default_accuracy_level``, 4 for 8 bits, 0 for 4), and its
    fidelity to the float file measured on ``samples`` (the calibration grammar) in ONNX Runtime. ``speed``:
    timed against the float file on this CPU before it is moved into place; ``require_faster``: a slower (or
    untimed) file raises ``SpeedMissed`` and nothing is written."""
    if bits not in (4, 8):
        raise ValueError(f"bits={bits}: MatMulNBits weight-only writes 4 or 8 bits")
    if group < 16 or group & (group - 1):
        raise ValueError(f"group={group}: MatMulNBits needs a power of two, at least 16")
    if accuracy_level is None:
        accuracy_level = default_accuracy_level(bits)
    if accuracy_level not in range(5):
        raise ValueError(f"accuracy_level={accuracy_level!r}: MatMulNBits takes 0 to 4, or None (the default)")
    if require_faster and not speed:
        raise ValueError("require_faster needs the speed reading: pass speed=True, or drop require_faster")
    src = Path(float_path).expanduser()
    artifact.refuse_unsafe_destination(out_path, (src,))
    memory.refuse_if_too_large(src)
    graph = load_onnx(src, external_data=False)  # checked (external data present, inside its folder), not read
    feeds = as_feeds(samples, model_inputs(graph))
    names = [o.name for o in graph.graph.output]
    del graph
    model = ir.load(src)  # weights stay on disk until each is read
    on_disk = [v.const_value for v in model.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)]
    written, kept = 0, []
    for node in list(model.graph):
        if node.op_type != "MatMul" or len(node.inputs) != 2 or node.inputs[1] is None:
            continue
        value = node.inputs[1]
        tensor = value.const_value
        if tensor is None or value.name not in model.graph.initializers:
            continue  # activation x activation (attention scores): no weight to store
        if (tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2 or tensor.shape[0] % group
                or len(value.uses()) != 1):
            kept.append(node.name or value.name)
            continue
        weight = quantize_rows(tensor.numpy(), bits, group)
        label = node.name or value.name
        written += to_matmul_nbits(model, [(weight, value, True)])
        made = next(n for n in model.graph if n.name == "matmul_nbits_0_0")  # its name for a one-weight call
        made.name = f"{label}_matmul_nbits"
        if isinstance(tensor, ir.ExternalTensor):
            tensor.release()
    if not written:
        raise ExportRefused(f"{src.name}: no MatMul reads a stored 2-D float weight whose K is a multiple of "
                            f"{group}; there is nothing to store in {bits} bits")
    ir.external_data.load_to_model(model)  # what stays float (biases, norms) read from the mapping now
    unmap(on_disk)
    set_accuracy_level(model, accuracy_level)
    model.metadata_props[ENGINE_KEY] = ENGINE
    model.metadata_props[FORMAT_KEY] = f"MatMulNBits int{bits} group {group}"
    final = ir.to_proto(model)
    del model
    reference = joined([ort_session(src, optimized=True).run(None, feed) for feed in feeds])
    memory.give_back()
    with artifact.atomic_destination(out_path, wait=wait, inputs=(src,)) as staged:
        artifact.save_model(final, staged)
        del final
        try:
            session = ort_session(staged, optimized=True)
            outputs = joined([session.run(None, feed) for feed in feeds])
        except Exception as exc:
            raise ExportRefused(f"ONNX Runtime cannot run the weight-only file: {cause(exc)}") from exc
        del session
        if not all(np.isfinite(o).all() for o in outputs if o.dtype.kind == "f"):
            raise ExportRefused("the weight-only file gives NaN or infinite outputs in ONNX Runtime")
        n = sum(len(next(iter(f.values()))) for f in feeds)
        fp32 = measure_fidelity(names, reference, outputs, budget=None, data=f"{n} sample(s)",
                                runtime="ONNX Runtime (default optimizations)")
        exact = None
        if accuracy_level:  # the other reading: float activations, what the codes and scales compute
            session = ort_session(without_accuracy_level(staged), optimized=True)
            exact = measure_fidelity(names, reference, joined([session.run(None, feed) for feed in feeds]),
                                     budget=None, data=f"{n} sample(s)",
                                     runtime="ONNX Runtime (default optimizations), accuracy_level 0")
            del session
        add_file_metadata(staged, {FIDELITY_KEY: fp32.metadata()})
        reading = None
        if speed:
            first = {name: np.asarray(a) for name, a in feeds[0].items()}
            batch = len(next(iter(first.values())))
            reading = speed_gate.gate(staged, src, first, (1, batch if batch > 1 else SPEED_BATCH),
                                      require_faster=require_faster, hint=speed_hint(accuracy_level))
    return WeightOnlyResult(Path(out_path).expanduser().resolve(), bits, group, written, kept, fp32,
                            accuracy_level, exact, reading)

