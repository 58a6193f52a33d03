"""Keep freed tensor memory in the process: glibc malloc settings for torch on a CPU.

glibc serves large blocks (above a threshold that starts at 128 KiB) with ``mmap`` and returns
them to the OS when they are freed, and trims the heap's top likewise. A CPU forward allocates
and frees the same large activations on every pass, so every pass faults its memory in again,
a zeroed page at a time: a Whisper tiny.en encoder pass took ~9-19k minor page faults here, and
the cross-attention K/V ~9k. With blocks up to 32 MiB kept on the heap and the top never
trimmed below 1 GiB of slack, a pass reuses the memory of the last one (0-400 faults); a turn's
ASR work alone ran ~6% faster (docs/BENCHMARKS.md). The cost is the usual one of a serving process: memory
freed after a peak stays mapped for the next one. PyTorch's CPU tuning guides get the same
effect from preloading jemalloc or tcmalloc; this needs no library and no environment.
"""

from __future__ import annotations

import ctypes
import functools
import os

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the settings once per process; False where malloc is not glibc's (musl, macOS) or
    where the user set ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` (theirs win)."""
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded: the C library's
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it: a different mallopt's codes differ
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD))
    return all(mallopt(param, value) == 1 for param, value in settings)
