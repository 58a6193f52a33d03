"""``engine.allocator``: with glibc, a large block freed and allocated again is served from
memory the process kept, not faulted in afresh. Each case runs in a fresh interpreter: malloc's
state is process-wide."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

_ROUNDS = """
import ctypes, resource, sys
from engine.allocator import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
faults = []
for _ in range(3):  # plain malloc: numpy would ask for huge pages
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(24 << 20)
    ctypes.memset(block, 1, 24 << 20)  # every page touched
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[1])
"""

PAGES = (24 << 20) // 4096


def _second_round_faults(mode: str) -> int:
    root = Path(__file__).resolve().parent.parent  # where ``engine`` imports from
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True, cwd=root)
    return int(out.stdout)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_memory_is_reused_without_page_faults() -> None:
    # glibc's default mmaps the first block, raises its threshold when it is freed, then takes
    # the second from a heap grown afresh: its pages fault in again.
    assert _second_round_faults("default") > PAGES // 2
    assert _second_round_faults("kept") < PAGES // 20


def test_the_users_malloc_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import allocator

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    allocator.keep_freed_memory.cache_clear()
    try:
        assert allocator.keep_freed_memory() is False
    finally:
        allocator.keep_freed_memory.cache_clear()
