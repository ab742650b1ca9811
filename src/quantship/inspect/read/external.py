"""External data: tensors an ONNX file keeps in files beside its graph.

Read side: every location is checked before anything opens it (inside the model's folder, present,
long enough), so a bad file is refused in one line naming the tensor and the file. Write side: a
model too large for one protobuf (``SINGLE_FILE_MAX_BYTES``) is written as a graph plus one data
file, without changing the model in memory and without a second copy of its weights.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING

from quantship.errors import FileRefused, one_line

if TYPE_CHECKING:  # onnx loads when a model is read, not when the export layer imports these constants
    import onnx

_EXTERNAL = 1  # onnx.TensorProto.EXTERNAL

# protobuf cannot serialise 2 GiB: above this a model is written (and given to ONNX Runtime) with external data
SINGLE_FILE_MAX_BYTES = 1_500_000_000
EXTERNAL_TENSOR_MIN_BYTES = 1024  # smaller tensors (scales, zero-points, shapes) stay in the graph
_ALIGN = 4096  # each external tensor starts on a page, so ONNX Runtime can map it instead of copying it


@dataclass(frozen=True)
class ExternalTensor:
    """One tensor stored outside the graph: where, and how many bytes of that file it needs."""

    name: str
    location: str
    end: int


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Initializers and attribute tensors of ``graph`` and of every subgraph in it."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def _is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.HasField("data_location") and tensor.data_location == _EXTERNAL


def external_tensors(model: onnx.ModelProto) -> list[ExternalTensor]:
    """Every tensor of ``model`` whose data lives in an external file."""
    from onnx.external_data_helper import ExternalDataInfo

    found = []
    for tensor in _tensors(model.graph):
        if _is_external(tensor):
            try:
                info = ExternalDataInfo(tensor)
            except ValueError as exc:  # a negative offset or length
                raise FileRefused(f"tensor {tensor.name!r}: {one_line(exc)}") from None
            found.append(ExternalTensor(tensor.name, info.location, (info.offset or 0) + (info.length or 0)))
    return found


def locations(model: onnx.ModelProto) -> set[str]:
    """The external-data files ``model`` refers to, as written in it (relative to its folder)."""
    return {t.location for t in external_tensors(model)}


def relocate(model: onnx.ModelProto, old: str, new: str) -> None:
    """Point every tensor of ``model`` stored in ``old`` at ``new`` (the data file renamed, its offsets kept)."""
    for tensor in _tensors(model.graph):
        for entry in tensor.external_data if _is_external(tensor) else ():
            if entry.key == "location" and entry.value == old:
                entry.value = new


def escapes(location: str) -> bool:
    """True when ``location`` is absolute or climbs out of the folder it is relative to."""
    if not location or PurePosixPath(location).is_absolute() or PureWindowsPath(location).is_absolute():
        return True
    if PureWindowsPath(location).drive or location.startswith(("/", "\\")):
        return True
    return ".." in PurePosixPath(location.replace("\\", "/")).parts


def check_external_data(model: onnx.ModelProto, base_dir: Path, path: Path) -> None:
    """Refuse ``model`` (read from ``path``) whose external data escapes ``base_dir``, is missing, is a
    symbolic link, or is shorter than a tensor says; the message names the tensor and the file."""
    for tensor in external_tensors(model):
        where = f"{path}: tensor {tensor.name!r} keeps its data in the external data file {tensor.location!r}"
        if escapes(tensor.location):
            raise FileRefused(f"{where}, outside the model's folder {base_dir.resolve()}; put the data file beside the model "
                              "and give the tensor a location relative to it")
        data_file = base_dir / tensor.location
        if data_file.is_symlink():
            raise FileRefused(f"{where}, which is a symbolic link (ONNX reads external data only from regular "
                              f"files); copy the file it points to, {os.path.realpath(data_file)}, in its place")
        if not data_file.is_file():
            raise FileNotFoundError(f"{where}, which is missing (expected at {data_file}); copy it next to the "
                                    "model")
        size = data_file.stat().st_size
        if tensor.end > size:
            raise FileRefused(f"{where}, which is truncated ({size} bytes, the tensor needs {tensor.end}); copy "
                              "it again")


def fits_one_file(model: onnx.ModelProto, limit: int | None = None) -> bool:
    """True when ``model`` serialises as one protobuf of at most ``limit`` bytes (``SINGLE_FILE_MAX_BYTES``)."""
    try:
        size = serialized_size(model)
    except Exception:  # protobuf's EncodeError: over 2 GiB it cannot even count the bytes
        return False
    return size <= (SINGLE_FILE_MAX_BYTES if limit is None else limit)


def _split(model: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.GraphProto, list[int]]:
    """``model`` without its graph, its graph without initializers, and each initializer's serialised size."""
    import onnx

    shell = onnx.ModelProto()
    _copy_fields(model, shell, skip="graph")
    graph = onnx.GraphProto()
    _copy_fields(model.graph, graph, skip="initializer")
    return shell, graph, [t.ByteSize() for t in model.graph.initializer]


def _graph_length(head: int, sizes: list[int]) -> int:
    tag = len(encoded_varint(_GRAPH_INITIALIZER << 3 | _LENGTH_DELIMITED))
    return head + sum(tag + len(encoded_varint(n)) + n for n in sizes)


def serialized_size(model: onnx.ModelProto) -> int:
    """The bytes ``model`` serialises to, counted a tensor at a time (protobuf's ``ByteSize`` of the whole model
    serialises it to count: a copy of every weight)."""
    shell, graph, sizes = _split(model)
    length = _graph_length(graph.ByteSize(), sizes)
    return shell.ByteSize() + len(encoded_varint(_MODEL_GRAPH << 3 | _LENGTH_DELIMITED)) + len(
        encoded_varint(length)) + length


def _copy_fields(source, target, skip: str) -> None:
    """Every set field of ``source`` but ``skip`` into ``target`` (messages shared by copy, one level)."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):
            getattr(target, field.name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def save_with_external_data(model: onnx.ModelProto, path: Path, location: str,
                            min_bytes: int = EXTERNAL_TENSOR_MIN_BYTES) -> bool:
    """Write ``model`` to ``path``, its top-level initializers of ``min_bytes`` or more (held as raw bytes)
    in ``location`` beside it, one tensor at a time; ``model`` is left as it was. Returns whether any
    tensor went to ``location`` (when none did, no data file is left)."""
    import onnx

    shell = onnx.ModelProto()
    _copy_fields(model, shell, skip="graph")
    _copy_fields(model.graph, shell.graph, skip="initializer")
    data_path = path.parent / location
    wrote = False
    with open(data_path, "wb") as data:
        for tensor in model.graph.initializer:
            if _is_external(tensor) or not tensor.HasField("raw_data") or tensor.ByteSize() < min_bytes:
                shell.graph.initializer.add().CopyFrom(tensor)
                continue
            raw = tensor.raw_data
            data.write(b"\0" * (-data.tell() % _ALIGN))
            offset = data.tell()
            data.write(raw)
            out = shell.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims,
                                              doc_string=tensor.doc_string,
                                              data_location=_EXTERNAL)
            for key, value in (("location", location), ("offset", offset), ("length", len(raw))):
                out.external_data.add(key=key, value=str(value))
            del raw
            wrote = True
    if not wrote:
        data_path.unlink()
    path.write_bytes(shell.SerializeToString())
    return wrote


def save_one_file(model: onnx.ModelProto, path: Path) -> None:
    """Write ``model`` to ``path`` as one file, its initializers serialised one at a time (``onnx.save_model``
    serialises the whole model into one string first: a second copy of every weight held while it writes). The
    graph's fields come in another order than protobuf's own serialisation (the initializers last); any parser
    reads the same model (``ModelProto.ParseFromString`` of the file equals ``model``). ``model`` is left as it
    was."""
    shell, graph, sizes = _split(model)
    head = graph.SerializeToString()
    tag = encoded_varint(_GRAPH_INITIALIZER << 3 | _LENGTH_DELIMITED)
    length = _graph_length(len(head), sizes)
    with open(path, "wb") as f:
        f.write(shell.SerializeToString())
        f.write(encoded_varint(_MODEL_GRAPH << 3 | _LENGTH_DELIMITED) + encoded_varint(length) + head)
        for tensor, n in zip(model.graph.initializer, sizes):
            f.write(tag + encoded_varint(n))
            f.write(tensor.SerializeToString())


# ONNX's field numbers (onnx.proto) the reader below walks: ModelProto.graph, GraphProto.initializer,
# TensorProto.raw_data
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9
_MODEL_METADATA_PROPS = 14  # ModelProto.metadata_props
_LENGTH_DELIMITED = 2


def _read_varint(f) -> int:
    value = shift = 0
    while True:
        byte = f.read(1)
        if not byte:
            raise ValueError("the file ends inside a varint")
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def encoded_varint(value: int) -> bytes:
    """``value`` as protobuf writes an unsigned varint (seven bits a byte, the lowest first)."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _fields(f, end: int) -> Iterator[tuple[int, int, int, int]]:
    """The fields of the protobuf message from ``f``'s position to ``end``: (field number, where the field starts,
    where its payload starts, where it ends); a length-delimited field's payload is its bytes, any other's its
    value. The caller may move ``f`` between fields (each starts where the last one ended)."""
    pos = f.tell()
    while pos < end:
        f.seek(pos)
        tag = _read_varint(f)
        kind, payload = tag & 7, f.tell()
        if kind == 0:
            _read_varint(f)
            after = f.tell()
        elif kind == 1:
            after = payload + 8
        elif kind == _LENGTH_DELIMITED:
            length = _read_varint(f)
            payload = f.tell()
            after = payload + length
        elif kind == 5:
            after = payload + 4
        else:
            raise ValueError(f"wire type {kind} (groups) in an ONNX file")
        if after > end:
            raise ValueError("a field runs past the end of its message")
        yield tag >> 3, pos, payload, after
        pos = after


def _read(f, start: int, end: int) -> bytes:
    f.seek(start)
    return f.read(end - start)


def _delimited(field: int, payload: bytes) -> bytes:
    return encoded_varint(field << 3 | _LENGTH_DELIMITED) + encoded_varint(len(payload)) + payload


def _stripped(path: str | Path) -> tuple[onnx.ModelProto, list[tuple[int, int, int]]]:
    """The model at ``path`` without the stored bytes of its top-level initializers, and where each left-out
    ``raw_data`` is in the file: (initializer index, offset, length)."""
    import onnx

    size = Path(path).stat().st_size
    model, spans, index = bytearray(), [], 0
    with open(path, "rb") as f:
        for field, first, payload, end in _fields(f, size):
            if field != _MODEL_GRAPH:
                model += _read(f, first, end)
                continue
            graph = bytearray()
            f.seek(payload)
            for g_field, g_first, g_payload, g_end in _fields(f, end):
                if g_field != _GRAPH_INITIALIZER:
                    graph += _read(f, g_first, g_end)
                    continue
                f.seek(g_payload)
                kept = []
                for t_field, t_first, t_payload, t_end in _fields(f, g_end):
                    if t_field == _TENSOR_RAW_DATA:
                        spans.append((index, t_payload, t_end - t_payload))
                    else:
                        kept.append((t_first, t_end))
                graph += _delimited(_GRAPH_INITIALIZER, b"".join(_read(f, a, b) for a, b in kept))
                index += 1
            model += _delimited(_MODEL_GRAPH, bytes(graph))
    parsed = onnx.ModelProto()
    parsed.ParseFromString(bytes(model))
    return parsed, spans


def set_metadata_streamed(path: str | Path, entries: dict[str, str], chunk: int = 16 << 20) -> None:
    """Set ``entries`` in the ``metadata_props`` of the model at ``path`` without reading its graph: every other
    top-level field is copied as it is, ``chunk`` bytes at a time, in field-number order (a repeated field's
    entries in their own), the entries (the file's own in their order, values replaced, new keys last) in their
    place: the order ONNX's serialiser writes, which readers that sniff a file's first fields expect (OpenVINO
    refused a file whose graph came after its metadata, as onnx_ir writes one). The new file replaces the old one
    whole (``os.replace``); the old one stays on any failure."""
    import onnx

    path = Path(path)
    size = path.stat().st_size
    props: dict[str, str] = {}
    staged = path.with_name(path.name + ".metadata.tmp")
    try:
        with open(path, "rb") as f, open(staged, "wb") as out:
            # the entries' place: after every field numbered below theirs (a stable sort keeps a repeated field's order)
            place = (_MODEL_METADATA_PROPS, -1, -1, -1)
            fields = sorted([*_fields(f, size), place], key=lambda found: found[0])
            for field, first, payload, end in fields:
                if field == _MODEL_METADATA_PROPS and first >= 0:
                    entry = onnx.StringStringEntryProto()
                    entry.ParseFromString(_read(f, payload, end))
                    props[entry.key] = entry.value
            props.update(entries)
            for field, first, _, end in fields:
                if field != _MODEL_METADATA_PROPS:
                    f.seek(first)
                    for at in range(first, end, chunk):
                        out.write(f.read(min(chunk, end - at)))
                elif first < 0:
                    for key, value in props.items():
                        out.write(_delimited(_MODEL_METADATA_PROPS,
                                             onnx.StringStringEntryProto(key=key, value=value).SerializeToString()))
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


def graph_without_weights(path: str | Path) -> onnx.ModelProto:
    """The model at ``path`` with the stored bytes of its top-level initializers left out (``raw_data``; their
    names, types, dims and external references kept): what finding its data files or its graph needs, read
    without holding its weights (``onnx.load`` of a single-file model holds them all, twice while it parses). The
    weights' bytes are skipped on disk, never read. Raises ``ValueError`` (or protobuf's ``DecodeError``) for bytes
    that are not an ONNX model."""
    return _stripped(path)[0]


def read_one_tensor_at_a_time(path: str | Path) -> tuple[onnx.ModelProto, str | None]:
    """The model at ``path`` as ``onnx.load`` reads it without its external data, and ``onnx.checker``'s verdict on
    it (None: valid), read a tensor at a time: the graph first, checked (a file with external data by its path, its
    graph is small; a single file) with a placeholder of each initializer's
    stored bytes (a sparse file of their lengths: the checker reads a tensor's shape and the length of its data,
    not the data), then each initializer's bytes read into it. ``onnx.load`` holds the file's bytes beside the
    parsed model, and ``onnx.checker`` given the path reads and parses it again: three copies of every weight at
    the peak where this holds one. Raises ``ValueError`` (or protobuf's ``DecodeError``) for bytes that are not an
    ONNX model."""
    model, spans = _stripped(path)
    invalid = _checked_with_placeholders(model, spans) if spans and not external_tensors(model) else False
    if invalid is False:  # its own data files resolve beside it (its graph is small), or nowhere to write
        invalid = _checked(str(path))
    return _filled(model, spans, path), invalid


def checked_without_weights(model: onnx.ModelProto, base_dir: str | Path | None = None) -> str | None:
    """``onnx.checker``'s verdict on an in-memory ``model`` (None: valid) without a second copy of its weights:
    given a model, onnx serialises it and parses it again (two more copies of every weight at once). The graph is
    checked as ``read_one_tensor_at_a_time`` checks a file's, each initializer's stored bytes given as a
    placeholder of their length; a model with external data is checked beside its tensors when ``base_dir`` (the
    folder they are in) is given, else in memory, as is one with no temporary folder to write in."""
    import onnx

    if external_tensors(model):  # its locations resolve nowhere but beside its file
        if base_dir is None:
            return _checked(model)
        beside = Path(base_dir) / "checked.onnx"
        beside.write_bytes(model.SerializeToString())
        try:
            return _checked(str(beside))
        finally:
            beside.unlink(missing_ok=True)
    stripped = onnx.ModelProto()
    _copy_fields(model, stripped, skip="graph")
    _copy_fields(model.graph, stripped.graph, skip="initializer")
    spans = []
    for index, tensor in enumerate(model.graph.initializer):
        if not tensor.HasField("raw_data"):
            stripped.graph.initializer.add().CopyFrom(tensor)
            continue
        # every field but the bytes, set one by one: a copy cleared afterwards would keep its bytes in the
        # message's arena until the whole message goes (protobuf frees an arena at once)
        stripped.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims,
                                       doc_string=tensor.doc_string, metadata_props=tensor.metadata_props)
        spans.append((index, 0, len(tensor.raw_data)))
    invalid = _checked_with_placeholders(stripped, spans) if spans else False
    return _checked(model) if invalid is False else invalid


def _checked(model) -> str | None:
    """``onnx.checker``'s refusal of ``model`` (a path or a ModelProto) in one line, or None."""
    import onnx

    try:
        onnx.checker.check_model(model)
        return None
    except Exception as exc:  # ValidationError, and whatever a corrupt field makes the checker raise
        return one_line(exc)


def _checked_with_placeholders(model: onnx.ModelProto, spans: list[tuple[int, int, int]]) -> str | None | bool:
    """The checker's verdict on ``model`` whose ``spans`` were left out, each given as external data in a sparse
    placeholder file of its length in a temporary folder; False when that folder cannot be written."""
    import shutil
    import tempfile

    import onnx

    try:
        folder = Path(tempfile.mkdtemp(prefix="quantship-check-"))
    except OSError:
        return False
    try:
        shell = onnx.ModelProto()
        shell.CopyFrom(model)
        offset = 0
        for index, _, length in spans:
            tensor = shell.graph.initializer[index]
            tensor.data_location = _EXTERNAL
            for key, value in (("location", "placeholder.data"), ("offset", str(offset)), ("length", str(length))):
                tensor.external_data.add(key=key, value=value)
            offset += length
        with open(folder / "placeholder.data", "wb") as data:
            data.truncate(offset)  # a hole: no byte written, none read
        (folder / "model.onnx").write_bytes(shell.SerializeToString())
    except OSError:  # a full or read-only temporary folder
        shutil.rmtree(folder, ignore_errors=True)
        return False
    try:
        # what the checker checks of stored bytes given in the file, it does not check of external ones
        return _checked(str(folder / "model.onnx")) or _short_tensor(model, spans)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _filled(model: onnx.ModelProto, spans: list[tuple[int, int, int]], path: str | Path) -> onnx.ModelProto:
    """``model`` with each left-out ``raw_data`` read back from ``path``, one tensor at a time."""
    with open(path, "rb") as f:
        for index, start, length in spans:
            f.seek(start)
            model.graph.initializer[index].raw_data = f.read(length)
    return model


_FOUR_BIT = (21, 22, 23)  # UINT4, INT4, FLOAT4E2M1: two values a byte


def _short_tensor(model: onnx.ModelProto, spans: list[tuple[int, int, int]]) -> str | None:
    """The checker's refusal of a tensor whose stored bytes are fewer than its shape and type need, or None."""
    import numpy as np
    import onnx

    for index, _, length in spans:
        tensor = model.graph.initializer[index]
        count = int(np.prod(tensor.dims, dtype=np.int64))
        try:
            need = (count + 1) // 2 if tensor.data_type in _FOUR_BIT else \
                count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        except (KeyError, TypeError, ValueError):  # a type numpy has no size for: the checker judged it
            continue
        if length < need:
            return (f"TensorProto (tensor name: {tensor.name}) raw_data size ({length} bytes) is too small for the "
                    f"declared shape and type ({need} bytes required)")
    return None
