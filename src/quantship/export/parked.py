"""A float model's weights moved to a file while other work holds the memory.

The ``quantize`` command builds the float model itself and needs it only now and then: to quantize (each
repair step, each candidate of the placement by profile), to give the judgement its reference outputs, to export
the float reference. Between those uses the exports and ONNX Runtime's sessions (the float reference's own copy
of the weights among them) would sit beside it; so would each quantized model the command made, of which it
needs only the one it keeps. ``park`` writes each weight to a page-aligned file in a work folder and makes the tensor a shared mapping of
it (the same ``Parameter`` objects, the same values, every other holder of the tensor included); ``page_out``
then drops the mapped pages from the process (``madvise(MADV_DONTNEED)``: a shared file mapping keeps its
contents in the file, and the next read maps them back in). Only tensors that own their whole storage on the
CPU are moved; the rest stay where they are. Linux only (elsewhere nothing is parked).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE = 4096
MADV_DONTNEED = 4
SMALLEST = 64 << 10  # a tensor under this stays in memory: its pages would hold little


@dataclass
class Parked:
    """The mapping the parked tensors are views of: ``page_out`` empties it from the process."""

    storage: Any  # torch.UntypedStorage of the whole file (MAP_SHARED)
    path: Path
    n_bytes: int
    n_tensors: int

    def page_out(self) -> None:
        """The mapped pages leave the process's resident set (their contents stay in the file)."""
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = self.storage.data_ptr()
        length = -(-self.n_bytes // PAGE) * PAGE
        if libc.madvise(start, length, MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) refused the parked weights' mapping")


def _movable(tensor: Any) -> bool:
    import torch

    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu"
            and tensor.layout == torch.strided and not tensor.is_quantized and tensor.is_contiguous()
            and tensor.storage_offset() == 0 and tensor.numel() * tensor.element_size() >= SMALLEST
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def park(module: Any, folder: Path, name: str = "parked_weights.bin") -> Parked | None:
    """``module``'s large CPU weights (parameters and buffers) moved to ``folder/name`` and mapped
    from it, in place (module docstring); None when none qualifies, or when the file cannot be written (a full
    disk: the weights stay in memory, as without parking). The caller must own ``module``: its tensors' storage
    changes, not their values."""
    import torch

    if not sys.platform.startswith("linux"):
        return None
    seen: dict[int, Any] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        if _movable(tensor.data):
            seen.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    if not seen:
        return None
    path = Path(folder) / name
    places, offset = [], 0
    try:
        with open(path, "wb") as out:
            for tensor in seen.values():
                raw = tensor.data.reshape(-1).view(torch.uint8).numpy()
                out.seek(offset)
                out.write(memoryview(raw))
                places.append((tensor, offset, raw.nbytes))
                offset = -(-(offset + raw.nbytes) // PAGE) * PAGE
            out.truncate(offset)
    except OSError:
        path.unlink(missing_ok=True)
        return None
    storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=offset)
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    with torch.no_grad():
        for tensor, start, n in places:
            tensor.data = whole[start:start + n].view(tensor.dtype).view(tensor.shape)
    parked = Parked(storage, path, offset, len(places))
    parked.page_out()
    return parked
