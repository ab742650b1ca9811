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
        size = model.ByteSize()
    except Exception:  # protobuf's EncodeError: over 2 GiB it cannot even count the bytes
        return False
    return size <= (SINGLE_FILE_MAX_BYTES if limit is None else limit)


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
