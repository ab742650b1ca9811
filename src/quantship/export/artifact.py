"""Atomic artifacts: a file appears at its path only when every check passed, or nothing appears.

The graph (and any external-data file) is written in a private temporary directory beside the
destination, then renamed into place. A refusal or a crash removes the directory: no graph, no
external data, and a file that was already at the destination is left untouched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx

# protobuf cannot serialise 2 GiB; larger models keep their tensors in one external-data file
EXTERNAL_DATA_THRESHOLD = 1_500_000_000


def external_data_name(path: Path) -> str:
    return path.name + ".data"


def save_model(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Write ``model`` to ``path`` (external data beside it when large); returns every file written."""
    if model.ByteSize() > EXTERNAL_DATA_THRESHOLD:
        data = external_data_name(path)
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data, size_threshold=1024)
        return [path, path.parent / data]
    onnx.save_model(model, str(path))
    return [path]


@contextlib.contextmanager
def atomic_destination(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path for the artifact; on clean exit move it (and its siblings) to ``path``.

    Every file the body writes into the temporary directory is moved beside ``path`` under the
    same name, external data first, the graph last.
    """
    final = Path(path).expanduser().resolve()
    if final.is_dir():
        raise ValueError(f"{final} is a directory: give the path of the .onnx file to write")
    if not final.parent.is_dir():
        raise ValueError(f"{final.parent} does not exist: create the directory first")
    workdir = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        staged = workdir / final.name
        yield staged
        if not staged.is_file():
            raise RuntimeError(f"the exporter wrote nothing at {staged}")
        siblings = sorted(p for p in workdir.iterdir() if p != staged)
        for p in siblings:
            os.replace(p, final.parent / p.name)
        os.replace(staged, final)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
