"""``heap.large_blocks_mapped``: inside it, large blocks a program frees go back to the kernel even after glibc's
dynamic threshold rose (as it does in any process that freed a large tensor), in a fresh process each."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
from pathlib import Path

import pytest

# 30 MiB freed first (glibc's threshold rises to it), then 64 blocks of 4 MiB each followed by a small one that
# stays, the large ones freed: the resident growth, MiB
SCRIPT = """
import sys
import numpy as np
from quantship import heap

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) >> 10

big = np.ones(30 << 18, dtype=np.float32)
del big

def churn():
    held, kept = [], []
    for _ in range(64):
        held.append(np.ones(4 << 18, dtype=np.float32))
        kept.append(np.ones(2048, dtype=np.float32))
    del held
    return rss(), kept

base = rss()
if sys.argv[1] == "mapped":
    with heap.large_blocks_mapped(heap.LARGE_MODEL_BYTES):
        after, kept = churn()
else:
    after, kept = churn()
print(after - base)
"""


def _growth(tmp_path: Path, mode: str) -> int:
    script = tmp_path / "churn.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_large_blocks_freed_inside_go_back_to_the_kernel(tmp_path):
    if not Path("/proc/self/status").is_file() or "libc" not in str(ctypes.util.find_library("c")):
        pytest.skip("glibc on Linux only: elsewhere large_blocks_mapped changes nothing and RSS is not read so")
    plain, mapped = _growth(tmp_path, "plain"), _growth(tmp_path, "mapped")
    if plain < 128:
        pytest.skip(f"this glibc kept {plain} MiB of the 256 freed without the block: nothing to show here")
    assert mapped <= 32, f"{mapped} MiB stayed resident of 256 MiB freed inside large_blocks_mapped"


def test_small_models_leave_the_heap_alone(monkeypatch):
    from quantship import heap

    calls = []
    monkeypatch.setattr(heap, "_libc", lambda: calls.append(1))
    with heap.large_blocks_mapped(heap.LARGE_MODEL_BYTES - 1):
        pass
    assert calls == []
