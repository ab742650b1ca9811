"""The process's heap, kept from holding freed pages: a leaf (the standard library only).

glibc keeps the pages of freed allocations for reuse, so a process that freed gigabytes (convert_pt2e's float
copies of the weights, ONNX Runtime's sessions, a graph's protobuf copies) stays at its largest resident size
until it calls ``malloc_trim``. ``give_back`` does. Blocks below glibc's mmap threshold come from the heap, and
that threshold rises (to 32 MiB) each time a program frees a larger block, as torch does: then the weights a
step copies and frees (a session's parsed graph, a converted model's float copies) fragment the heap, and the
next step's allocations cannot reuse those pages. ``large_blocks_mapped`` keeps the threshold low for a large
model's steps. Elsewhere (not glibc) both do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# glibc's mallopt parameter (malloc.h) and the thresholds: its starting one, and the most its dynamic one reaches
# on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), which a program that freed large blocks runs at
_M_MMAP_THRESHOLD = -3
MAPPED_FROM = 128 << 10
DYNAMIC_MAX = 32 << 20
# a model whose weights reach this many bytes gets its steps with large blocks mapped
LARGE_MODEL_BYTES = 256 << 20
_depth = 0


def module_bytes(module) -> int:
    """Bytes of a torch module's parameters and buffers (what its weights hold; 0 for anything else)."""
    if not hasattr(module, "parameters"):
        return 0
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (OSError, AttributeError, TypeError):  # not glibc
        return None


def give_back(*, collect: bool = False) -> None:
    """Return the heap pages freed so far to the kernel (glibc's ``malloc_trim``; nothing elsewhere). ``collect``:
    first free what only reference cycles keep (an onnx_ir model is one: its graph and nodes refer to each other,
    so ``del model`` frees none of the tensors it holds until the collector runs); a collection costs a quarter of
    a second in a process that imported torch, so callers ask for it where a large model was let go."""
    import gc

    if collect:
        gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def large_blocks_mapped(n_bytes: int) -> Iterator[None]:
    """For a model of ``n_bytes`` of weights (``LARGE_MODEL_BYTES`` or more; smaller ones: nothing changes): inside
    the block every allocation of ``MAPPED_FROM`` bytes or more is a mapping of its own, handed back to the kernel
    when freed. Measured on bench/scale.py's 2 GB encoder (PyTorch path, VmHWM per step): convert_pt2e peaked
    0.93 GiB lower, ONNX Runtime's optimized session of the 0.5 GB file added 0.51 GiB instead of 1.02. On leaving
    the outermost block the threshold is ``DYNAMIC_MAX`` (glibc's own once large blocks were freed, fixed from then
    on) and the freed pages go back."""
    global _depth
    libc = _libc() if n_bytes >= LARGE_MODEL_BYTES else None
    if libc is None:
        yield
        return
    if _depth == 0:
        libc.mallopt(_M_MMAP_THRESHOLD, MAPPED_FROM)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            libc.mallopt(_M_MMAP_THRESHOLD, DYNAMIC_MAX)
            libc.malloc_trim(0)


def forget_module_caches() -> None:
    """Empty the per-module device caches of torchao (``utils._assert_and_get_unique_device``) and torch.ao
    (``quantization.fx.utils.assert_and_get_unique_device``): each is a ``functools.cache`` keyed by the module,
    filled by prepare_pt2e, convert_pt2e and the graph passes after them, so it keeps every model it was given
    alive, weights and all, for the life of the process; each quantized model a repair step or the placement made
    and let go stayed resident (0.47 GiB each on bench/scale.py's 2 GB encoder). The caches only spare a walk over
    a module's parameters. A library not loaded yet has nothing cached (it is not imported here); a cache that is
    not there is left alone."""
    import sys

    for module, name in (("torchao.utils", "_assert_and_get_unique_device"),
                         ("torch.ao.quantization.fx.utils", "assert_and_get_unique_device")):
        cached = getattr(sys.modules.get(module), name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
