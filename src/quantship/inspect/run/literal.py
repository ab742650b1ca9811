"""ONNX Runtime reading a large QDQ file literally, a few layers at a time, in bounded memory.

Read literally (``ORT_DISABLE_ALL``), ONNX Runtime runs every weight's DequantizeLinear as soon as it is ready,
i.e. all of them before the first MatMul: one session holds a float copy of every weight beside the int8 file.
``split_session`` cuts the graph, in its own order, into consecutive parts whose weights (stored, and dequantized
to float) stay under ``part_bytes``; each part runs in its own session on the previous parts' outputs, and each
session is freed before the next is made. Each node runs the same kernel on the same inputs as in one session,
so the outputs are the same bytes (tests/inspect/test_literal_parts.py). A file whose dequantized weights fit in
one part keeps one session (``consumers.ort_session`` asks here first).

The part size is ``LITERAL_PART_BYTES``, or less inside ``parts_of_at_most`` (``quantize_onnx_file`` gives what
its ``--max-memory`` leaves, ``memory.literal_part_bytes``).
"""

from __future__ import annotations

import contextlib
import contextvars
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from quantship.heap import give_back
from quantship.inspect.read import external
from quantship.inspect.read.loading import file_size

# at most this many bytes of weights (stored plus dequantized) in one literal session, unless a budget says less
LITERAL_PART_BYTES = 1 << 30
_FLOAT_BOUND = 8  # a stored weight dequantizes to at most 8x its bytes (int4 -> float32): files below skip parsing
_PART_BYTES: contextvars.ContextVar[int | None] = contextvars.ContextVar("literal_part_bytes", default=None)


def part_bytes() -> int:
    """The part size in force: ``LITERAL_PART_BYTES``, or the budget of the innermost ``parts_of_at_most``."""
    budget = _PART_BYTES.get()
    return LITERAL_PART_BYTES if budget is None else min(LITERAL_PART_BYTES, budget)


@contextlib.contextmanager
def parts_of_at_most(n_bytes: int | None) -> Iterator[None]:
    """Literal readings made inside hold at most ``n_bytes`` of weights per session (None: the default)."""
    token = _PART_BYTES.set(None if n_bytes is None else max(1, int(n_bytes)))
    try:
        yield
    finally:
        _PART_BYTES.reset(token)


_TENSORS_IN: contextvars.ContextVar[str | None] = contextvars.ContextVar("literal_tensors_in", default=None)


def tensors_folder() -> str | None:
    """The folder of the innermost ``tensors_in``: where an in-memory model's external tensors are."""
    return _TENSORS_IN.get()


@contextlib.contextmanager
def tensors_in(folder: str | Path | None) -> Iterator[None]:
    """Sessions made inside of an in-memory model find its external tensors in ``folder`` (None: nothing changes);
    ``export_qdq`` keeps a large graph's weights there, mapped by every check instead of copied into each graph."""
    token = _TENSORS_IN.set(None if folder is None else str(folder))
    try:
        yield
    finally:
        _TENSORS_IN.reset(token)


def weights_to_disk(model: onnx.ModelProto, folder: str | Path | None = None,
                    min_bytes: int = external.EXTERNAL_TENSOR_MIN_BYTES) -> tuple[onnx.ModelProto, str]:
    """``model``'s graph, its stored tensors of ``min_bytes`` or more written to a data file in ``folder`` (default:
    a new temporary folder) one at a time, page-aligned, so ONNX Runtime maps them; and that folder. Tensors a
    session maps are file pages the kernel can drop, where a copy held in this process would stay resident."""
    made = folder is None
    folder = tempfile.mkdtemp(prefix="quantship-literal-") if made else str(folder)
    try:
        graph = Path(folder) / "model.onnx"
        external.save_with_external_data(model, graph, "model.onnx.data", min_bytes)
        return onnx.load(str(graph), load_external_data=False), folder
    except BaseException:
        if made:
            shutil.rmtree(folder, ignore_errors=True)
        raise


@dataclass(frozen=True)
class Arg:
    """A graph input or output as ``InferenceSession.get_inputs()`` describes it."""

    name: str
    shape: list
    type: str


def _arg(info: onnx.ValueInfoProto) -> Arg:
    tensor = info.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]
    kind = onnx.TensorProto.DataType.Name(tensor.elem_type).lower() if tensor.elem_type else "undefined"
    return Arg(info.name, dims, f"tensor({kind})")


def _numel(tensor: onnx.TensorProto) -> int:
    return int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1


def _stored(tensor: onnx.TensorProto) -> int:
    """Bytes of an initializer's values, read off its dims and type (its data is not read)."""
    if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (_numel(tensor) + 1) // 2
    return _numel(tensor) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _subgraph_names(node: onnx.NodeProto) -> set[str]:
    """Every name the subgraphs of ``node`` read (outer-scope values among them; a superset is harmless)."""
    names: set[str] = set()
    for attr in node.attribute:
        for graph in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            for inner in graph.node:
                names.update(n for n in inner.input if n)
                names |= _subgraph_names(inner)
    return names


def _reads(node: onnx.NodeProto) -> list[str]:
    return [n for n in node.input if n] + sorted(_subgraph_names(node))


@dataclass
class _Plan:
    parts: list[list[int]]  # node indices, in the order they run
    inputs: list[list[str]]  # each part's inputs: graph inputs or earlier parts' outputs
    outputs: list[list[str]]  # each part's outputs: what later parts or the graph's outputs read
    initializers: list[list[str]]
    last_use: dict[str, int]  # value -> the last part that reads it


def dequantized_bytes(graph: onnx.GraphProto) -> int:
    """Bytes of float weights a literal reading makes: each DequantizeLinear of a stored tensor's output."""
    stored = {t.name: t for t in graph.initializer}
    total = 0
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input and node.input[0] in stored:
            total += _numel(stored[node.input[0]]) * _float_size(node, stored)
    return total


def _float_size(node: onnx.NodeProto, stored: dict[str, onnx.TensorProto]) -> int:
    """Bytes per value a DequantizeLinear writes: its ``output_dtype``, else its scale's type, else float32."""
    for attr in node.attribute:
        if attr.name == "output_dtype" and attr.i:
            return onnx.helper.tensor_dtype_to_np_dtype(attr.i).itemsize
    scale = stored.get(node.input[1]) if len(node.input) > 1 else None
    return onnx.helper.tensor_dtype_to_np_dtype(scale.data_type).itemsize if scale is not None else 4


def plan(graph: onnx.GraphProto, limit: int) -> _Plan | None:
    """``graph``'s nodes cut into consecutive parts of at most ``limit`` bytes of weights each (a node heavier
    than that alone), or None when the graph cannot be cut here (not in topological order, an output that is
    a stored tensor, sparse initializers). Nodes that read only stored tensors (a weight's DequantizeLinear)
    move to just before their first reader, so a weight and its float copy fall in the same part."""
    if graph.sparse_initializer:
        return None
    stored = {t.name: t for t in graph.initializer}
    graph_inputs = {i.name for i in graph.input} - set(stored)
    wanted = [o.name for o in graph.output]
    if any(name in stored for name in wanted):
        return None
    nodes = list(graph.node)
    producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    constant: set[int] = set()
    for i, node in enumerate(nodes):
        reads = _reads(node)
        if not any(a.HasField("g") or a.graphs for a in node.attribute) and all(
                n in stored or (n in producer and producer[n] in constant) for n in reads):
            constant.add(i)
    groups: list[list[int]] = []
    placed: set[int] = set()
    known = set(graph_inputs) | set(stored)

    def pull(i: int, group: list[int]) -> bool:
        for name in _reads(nodes[i]):
            j = producer.get(name)
            if j is not None and j not in placed:
                if j not in constant or not pull(j, group):
                    return False
            elif j is None and name not in known:
                return False
        placed.add(i)
        group.append(i)
        return True

    for i, node in enumerate(nodes):
        if i in placed or (i in constant and not set(node.output) & set(wanted)):
            continue  # a constant node runs with its first reader (none: it feeds no output, and is not run)
        group: list[int] = []
        if not pull(i, group):
            return None  # a value read before it is made: not topologically sorted
        groups.append(group)

    def cost(i: int) -> int:
        node = nodes[i]
        own = sum(_stored(stored[n]) for n in set(_reads(node)) if n in stored)
        if node.op_type == "DequantizeLinear" and node.input and node.input[0] in stored:
            own += _numel(stored[node.input[0]]) * _float_size(node, stored)
        return own

    parts: list[list[int]] = [[]]
    held = 0
    for group in groups:
        weight = sum(cost(i) for i in group)
        if parts[-1] and held + weight > limit:
            parts.append([])
            held = 0
        parts[-1].extend(group)
        held += weight
    where = {i: k for k, part in enumerate(parts) for i in part}
    made_in = {out: where[i] for i, node in enumerate(nodes) if i in where for out in node.output if out}
    last_use: dict[str, int] = {}
    for k, part in enumerate(parts):
        for i in part:
            for name in _reads(nodes[i]):
                if name not in stored:
                    last_use[name] = k
    inputs, outputs, inits = [], [], []
    for k, part in enumerate(parts):
        reads = {n for i in part for n in _reads(nodes[i])}
        made = {out for i in part for out in nodes[i].output if out}
        inputs.append(sorted(n for n in reads - made if n not in stored and (n in graph_inputs or n in made_in)))
        inits.append(sorted(n for n in reads if n in stored))
        outputs.append(sorted(n for n in made if last_use.get(n, -1) > k or n in wanted))
    return _Plan(parts, inputs, outputs, inits, last_use)


class SplitSession:
    """A literal ONNX Runtime reading of a model, run part by part (``plan``): ``run`` and ``run_feeds`` as an
    ``InferenceSession``'s, ``get_inputs`` / ``get_outputs`` describe the whole graph."""

    def __init__(self, model: onnx.ModelProto, cut: _Plan, base_dir: str | None, folder: str | None = None):
        self._model, self._plan, self._base_dir = model, cut, base_dir
        if folder is not None:  # the weights written out for the parts to map: removed with this session
            weakref.finalize(self, shutil.rmtree, folder, True)
        stored = {t.name for t in model.graph.initializer}
        self._inputs = [_arg(i) for i in model.graph.input if i.name not in stored]
        self._outputs = [_arg(o) for o in model.graph.output]
        self._declared = {i.name: i for i in model.graph.input}

    @property
    def n_parts(self) -> int:
        return len(self._plan.parts)

    def get_inputs(self) -> list[Arg]:
        return list(self._inputs)

    def get_outputs(self) -> list[Arg]:
        return list(self._outputs)

    def run(self, output_names: Sequence[str] | None, feed: dict[str, np.ndarray], run_options=None) -> list:
        return self.run_feeds([feed], output_names)[0]

    def run_feeds(self, feeds: Sequence[dict[str, np.ndarray]], output_names: Sequence[str] | None = None
                  ) -> list[list[np.ndarray]]:
        """Every feed through each part in turn (one session per part, alive one at a time)."""
        wanted = list(output_names) if output_names else [o.name for o in self._outputs]
        unknown = [n for n in wanted if n not in {o.name for o in self._outputs}]
        if unknown:
            raise ValueError(f"{unknown} are not outputs of the graph: {[o.name for o in self._outputs]}")
        values = [dict(feed) for feed in feeds]
        if not values:
            return []
        missing = [i.name for i in self._inputs if any(i.name not in held for held in values)]
        if missing:
            raise ValueError(f"missing input(s) {missing}: the graph's inputs are {[i.name for i in self._inputs]}")
        keep = set(wanted)
        for k in range(self.n_parts):
            names = self._plan.outputs[k]
            if not names:  # nothing it makes is read later
                continue
            session = self._session(k, values[0])
            for held in values:
                outs = session.run(names, {n: held[n] for n in self._plan.inputs[k]})
                held.update(zip(names, outs))
                for name in [n for n in held if n not in keep and self._plan.last_use.get(n, -1) <= k]:
                    del held[name]
            del session
            give_back()
        return [[held[n] for n in wanted] for held in values]

    def _session(self, k: int, held: dict[str, np.ndarray]):
        """An ONNX Runtime session of part ``k``, its inputs typed as ``held`` (the arrays it will read) has them."""
        import onnxruntime as ort

        graph, cut = self._model.graph, self._plan
        part = onnx.GraphProto(name=f"{graph.name}_part{k}")
        part.node.extend(graph.node[i] for i in cut.parts[k])
        wanted = set(cut.initializers[k])
        part.initializer.extend(t for t in graph.initializer if t.name in wanted)
        for name in cut.inputs[k]:
            if name in self._declared:
                part.input.append(self._declared[name])
            else:
                dtype = onnx.helper.np_dtype_to_tensor_dtype(np.asarray(held[name]).dtype)
                part.input.append(onnx.helper.make_tensor_value_info(name, dtype, None))
        part.output.extend(onnx.ValueInfoProto(name=name) for name in cut.outputs[k])
        model = onnx.ModelProto(ir_version=self._model.ir_version, graph=part)
        model.opset_import.extend(self._model.opset_import)
        model.functions.extend(self._model.functions)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.enable_cpu_mem_arena = False
        if self._base_dir is not None:
            options.add_session_config_entry("session.model_external_initializers_file_folder_path", self._base_dir)
        data = model.SerializeToString()
        del model, part
        return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def split_session(model: str | Path | onnx.ModelProto, base_dir: str | Path | None = None,
                  limit: int | None = None) -> SplitSession | None:
    """A ``SplitSession`` of ``model`` when its weights, dequantized, exceed ``limit`` (default ``part_bytes()``)
    and the graph can be cut; None when one session holds it within the limit (or it cannot be cut)."""
    limit = part_bytes() if limit is None else limit
    if not isinstance(model, onnx.ModelProto):
        path = Path(model)
        try:
            if _FLOAT_BOUND * file_size(path) <= limit:
                return None
        except Exception:  # not ONNX, or unreadable: ONNX Runtime says so in its own words
            return None
        model = onnx.load(str(path), load_external_data=False)
        base_dir = path.parent if base_dir is None else base_dir
    if dequantized_bytes(model.graph) <= limit:
        return None
    cut = plan(model.graph, limit)
    if cut is None or len(cut.parts) < 2:
        return None
    folder = None
    # a model whose weights are already in a data file (``tensors_in``'s) keeps them there
    if not external.external_tensors(model) and any(
            t.HasField("raw_data") and len(t.raw_data) >= external.EXTERNAL_TENSOR_MIN_BYTES
            for t in model.graph.initializer):
        model, folder = weights_to_disk(model)  # every part maps its weights: none held here
        base_dir = folder
    return SplitSession(model, cut, None if base_dir is None else str(base_dir), folder)


def graph_only(path: str | Path) -> onnx.ModelProto:
    """The file's model with its initializers' names, types and dims but not their values (external ones keep
    their references): what reading feeds and outputs needs, without a copy of the weights held beside the
    sessions that run it."""
    model = onnx.load(str(path), load_external_data=False)
    if not any(t.HasField("raw_data") and len(t.raw_data) >= external.EXTERNAL_TENSOR_MIN_BYTES
               for t in model.graph.initializer):
        return model
    shell = onnx.ModelProto()
    external._copy_fields(model, shell, skip="graph")
    external._copy_fields(model.graph, shell.graph, skip="initializer")
    for tensor in model.graph.initializer:
        if tensor.HasField("raw_data") and len(tensor.raw_data) >= external.EXTERNAL_TENSOR_MIN_BYTES:
            shell.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
        else:
            shell.graph.initializer.add().CopyFrom(tensor)
    return shell


def run_feeds(session, feeds: Sequence[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    """Every output of ``session`` (an ``InferenceSession`` or a ``SplitSession``) for each feed."""
    if isinstance(session, SplitSession):
        return session.run_feeds(feeds)
    return [session.run(None, feed) for feed in feeds]
