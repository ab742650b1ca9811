"""The process's freed heap pages, handed back to the kernel: a leaf (the standard library only).

glibc keeps the pages of freed allocations for reuse, so a process that freed gigabytes (convert_pt2e's float
copies of the weights, ONNX Runtime's sessions, a graph's protobuf copies) stays at its largest resident size
until it calls ``malloc_trim``. ``give_back`` does; elsewhere (not glibc) it does nothing.
"""

from __future__ import annotations


def give_back(*, collect: bool = False) -> None:
    """Return the heap pages freed so far to the kernel (glibc's ``malloc_trim``; nothing elsewhere). ``collect``:
    first free what only reference cycles keep (an onnx_ir model is one: its graph and nodes refer to each other,
    so ``del model`` frees none of the tensors it holds until the collector runs); a collection costs a quarter of
    a second in a process that imported torch, so callers ask for it where a large model was let go."""
    import ctypes
    import ctypes.util
    import gc

    if collect:
        gc.collect()

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass
