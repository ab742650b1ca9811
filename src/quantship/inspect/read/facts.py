"""``FileFacts``: everything quantship reads from an ONNX file, from one load, one shape inference, one walk.

``qdq_stats``, ``quant_spec_of_file``, ``output_scales``, ``inspect_file``, ``check_file`` and the
export post-conditions all take their figures from the same ``FileFacts``, so two commands can
never count one file differently. Each of them accepts a path, an in-memory model or a
``FileFacts``; pass the latter to read a file once for several questions.

A file that cannot be read is refused with ``FileRefused`` naming the file and the field
(``FileNotFoundError`` when it is absent). Loading a path also runs ``onnx.checker``; an in-memory
model is taken as given.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from quantship.errors import FileRefused, cause
from quantship.inspect.read.counts import FLOAT_WEIGHT, QDQStats, count_qdq, float_compute_nodes
from quantship.inspect.read.float_ops import FloatCompute, module_path, torch_op
from quantship.inspect.read.loading import load_onnx
from quantship.inspect.read.quantization import QuantFacts, quant_facts
from quantship.inspect.read.view import DEQUANTIZE, TABLE_READERS, GraphView, node_label
from quantship.precision import METADATA_KEY, QuantSpec
from quantship.targets import TARGET_KEY, get, names

MAX_SPEC_DEPTH = 16  # quantship writes a spec two levels deep; anything this deep is not one
_SPEC_FIELD = f"metadata_props[{METADATA_KEY!r}]"


@dataclass(frozen=True)
class FileFacts:
    """One read of one file: the model, its indexed view, its quantization facts and counts."""

    path: str
    model: onnx.ModelProto = field(repr=False)
    view: GraphView = field(repr=False)
    quant: QuantFacts = field(repr=False)
    stats: QDQStats
    output_scales: dict[str, float | None]
    spec: Any = None  # the parsed quantship spec metadata (a dict), {"unreadable": text}, or None
    # compute ops reading a float activation, each with the module path its node's metadata records
    float_compute: tuple[FloatCompute, ...] = ()

    @property
    def opset_imports(self) -> dict[str, int]:
        """Declared opset per domain (the default domain under ``""``)."""
        declared = {o.domain: int(o.version) for o in self.model.opset_import}
        if "ai.onnx" in declared:
            declared.setdefault("", declared["ai.onnx"])
        return declared

    def quant_spec(self) -> QuantSpec | None:
        """The ``QuantSpec`` the file carries (None without one); ``FileRefused`` when it is not a spec."""
        if self.spec is None:
            return None
        if isinstance(self.spec, dict) and set(self.spec) == {"unreadable"}:
            raise FileRefused(f"{self.path}: {_SPEC_FIELD} is not JSON; the file's metadata is corrupt: re-export it")
        try:
            return QuantSpec.from_dict(self.spec)
        except Exception as exc:  # noqa: BLE001 - any way a foreign dict fails to be a spec
            raise FileRefused(f"{self.path}: {_SPEC_FIELD} is not a quantship spec ({cause(exc)}); "
                              "re-export the file with quantship") from None

    def widest_stored_weight(self) -> int:
        """The largest |value - zero-point| among the stored integer tensors that DequantizeLinear reads
        directly (a uint8 constant stored with zero-point 128 spans the same range as its int8 form). A
        table only a Gather reads (``TABLE_READERS``: rows moved, never multiplied by a u8s8 kernel) is
        not counted: the 7-bit bound of ``reduce_range`` is about those kernels."""
        widest = 0
        for node in self.view.nodes:
            readers = self.view.consumer_nodes(node.output[0]) if node.output else []
            if readers and all(r.op_type in TABLE_READERS and r.input[0] == node.output[0] for r in readers):
                continue
            if node.op_type == DEQUANTIZE and node.input and node.input[0] in self.view.initializers:
                values = self.view.passing(node.input[0])
                if values is not None and values.dtype.kind in "iu" and values.size:
                    zero = self.view.value(node.input[2]) if len(node.input) > 2 and node.input[2] else None
                    offset = int(zero.reshape(-1)[0]) if zero is not None and zero.size == 1 else 0
                    widest = max(widest, abs(int(values.min()) - offset), abs(int(values.max()) - offset))
        return widest


def _output_scales(view: GraphView) -> dict[str, float | None]:
    """For each graph output, the per-tensor scale of the DequantizeLinear producing it (through shape-only ops)."""
    scales: dict[str, float | None] = {}
    for name in view.outputs:
        node = view.node_of(view.through_shape_ops_up(name))
        scale = None
        if node is not None and node.op_type == DEQUANTIZE and len(node.input) > 1:
            value = view.value(node.input[1])
            if value is not None and value.size == 1 and value.dtype.kind == "f":
                scale = float(value.reshape(()))
        scales[name] = scale
    return scales


def _refuse_constant(source: str):
    def refuse(name: str):
        raise FileRefused(f"{source}: {_SPEC_FIELD} holds {name}, which is not a number; "
                          "the file's metadata is corrupt: re-export it")
    return refuse


def _check_spec_values(parsed: Any, source: str) -> None:
    """Refuse a spec nested deeper than any spec, or holding a non-finite number (walked without recursion)."""
    stack = [(parsed, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SPEC_DEPTH:
            raise FileRefused(f"{source}: {_SPEC_FIELD} is nested more than {MAX_SPEC_DEPTH} levels deep; "
                              "it is not a quantship spec: re-export the file")
        if isinstance(value, float) and not math.isfinite(value):
            raise FileRefused(f"{source}: {_SPEC_FIELD} holds the number {value}, which is out of range; "
                              "the file's metadata is corrupt: re-export it")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)


def _read_spec(model: onnx.ModelProto, source: str) -> Any:
    text = next((p.value for p in model.metadata_props if p.key == METADATA_KEY), None)
    if text is None:
        return None
    if isinstance(text, bytes):  # protobuf hands back a string field that is not UTF-8 as bytes
        raise FileRefused(f"{source}: {_SPEC_FIELD} is not UTF-8 text; the file's metadata is corrupt: re-export it")
    try:
        parsed = json.loads(text, parse_constant=_refuse_constant(source))
    except RecursionError:
        raise FileRefused(f"{source}: {_SPEC_FIELD} is nested too deeply to read; it is not a quantship spec: "
                          "re-export the file") from None
    except json.JSONDecodeError:
        return {"unreadable": text}
    _check_spec_values(parsed, source)
    return parsed


def _float_rules(model: onnx.ModelProto) -> tuple:
    """The float rules of the target the file names in its metadata (none for another tool's file)."""
    name = next((p.value for p in model.metadata_props if p.key == TARGET_KEY), None)
    return get(name).float_rules if name in names() else ()


def _rule(view: GraphView, node: onnx.NodeProto, rules: tuple) -> str:
    """The reason of the target's float rule that keeps this weighted op float (read on the same facts the
    quantizers read: op type, group, weight shape), or ""."""
    if not rules or len(node.input) < 2:
        return ""
    weight = view.passing(node.input[1])
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "group"}
    shape = tuple(weight.shape) if weight is not None else ()
    return next((r.why for r in rules if r.applies(node.op_type, attributes, shape)), "")


def read_model(model: onnx.ModelProto, source: str = "the model") -> FileFacts:
    """The facts of an in-memory model (``source`` names it in refusals)."""
    view = GraphView.of(model, source)
    rules = _float_rules(model)
    float_compute = tuple(FloatCompute(node_label(node, i), node.op_type, module_path(node), seen,
                                       _rule(view, node, rules) if seen == FLOAT_WEIGHT else "", torch_op(node))
                          for i, node, seen in float_compute_nodes(view))
    return FileFacts(path=source, model=model, view=view, quant=quant_facts(view),
                     stats=count_qdq(view, n_float_compute=len(float_compute)), output_scales=_output_scales(view),
                     spec=_read_spec(model, source), float_compute=float_compute)


def read_file(path: str | Path) -> FileFacts:
    """Load ``path`` (``load_onnx``: complete, checked, external data included) and read its facts once."""
    return read_model(load_onnx(path), str(path))


def facts_of(source: str | Path | onnx.ModelProto | FileFacts) -> FileFacts:
    """``source`` as ``FileFacts``: given ones are reused, a model or a path is read once."""
    if isinstance(source, FileFacts):
        return source
    if isinstance(source, onnx.ModelProto):
        return read_model(source)
    if not isinstance(source, (str, Path)):
        raise TypeError(f"expected a path, an onnx.ModelProto or FileFacts, not {type(source).__name__}")
    return read_file(source)
