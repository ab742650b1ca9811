"""Load an ONNX file for reading, refusing anything that is not a complete model.

Every refusal is a ``FileRefused`` (a ``ValueError``) or ``FileNotFoundError`` whose first line
says what is wrong with the file, so the CLI can print it as one line (exit code 2) instead of a
traceback.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from quantship.errors import FileRefused, one_line
from quantship.inspect.read.external import check_external_data, escapes, external_tensors, locations


def file_size(path: str | Path) -> int:
    """Bytes of an ONNX file plus the external-data files it references (not stray neighbours; a location
    that is missing or outside its folder counts nothing here: ``load_onnx`` refuses it)."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    data = [path.parent / loc for loc in locations(model) if not escapes(loc)]
    return path.stat().st_size + sum(p.stat().st_size for p in data if p.is_file())


def load_onnx(path: str | Path, *, external_data: bool = True) -> onnx.ModelProto:
    """Read ``path`` as a complete ONNX model (external weights included) or refuse it in one line.
    ``external_data=False``: the graph alone, its external data checked (present, inside the folder, long
    enough) but left on disk (the quantizer maps it tensor by tensor)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.is_dir():
        raise FileRefused(f"{path} is a directory; give the path of an .onnx file")
    try:
        data = path.read_bytes()
    except OSError as exc:  # unreadable (permissions, a device, a broken mount)
        raise FileRefused(f"{path} cannot be read ({one_line(exc)}); check its permissions") from None
    if not data:
        raise FileRefused(f"{path} is empty (0 bytes); it is not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError (and RuntimeWarning subclasses) here
        raise FileRefused(
            f"{path} is not an ONNX model, or is truncated: the protobuf does not parse ({one_line(exc)})"
        ) from None
    del data  # the parsed model holds the weights now: the file's bytes need not stay beside them
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise FileRefused(f"{path} is not an ONNX model: no IR version or no graph in it")
    if len(model.graph.node) == 0:
        raise FileRefused(f"{path}: the ONNX graph is empty (no nodes); there is nothing to run")
    external = bool(external_tensors(model))
    check_external_data(model, path.parent, path)
    try:  # checked before the external weights join it (by path, so their locations resolve beside the file)
        onnx.checker.check_model(str(path) if external else model)
    except Exception as exc:  # ValidationError, and whatever a corrupt field makes the checker raise
        raise FileRefused(f"{path} is not a valid ONNX model (truncated or corrupt?): {one_line(exc)}") from None
    if not external_data:
        return model
    try:
        onnx.load_external_data_for_model(model, str(path.parent))
    except Exception as exc:  # onnx raises OSError, ValueError or its own ValidationError here
        raise FileRefused(f"{path}: cannot read its external data ({one_line(exc)})") from None
    return model
