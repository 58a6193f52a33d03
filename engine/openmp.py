"""Keep one live OpenMP thread team per busy thread: release a thread's team when it goes idle.

libgomp gives each thread that starts a parallel region its own team of workers, kept until that
thread exits, and once the process holds more such threads than CPUs it cuts its workers' idle
spinning to ~1000 pauses: every parallel region then pays a futex wake-up. A server holds a team
for the main thread (model loading) and one per engine loop and worker thread, so on 2 cores
every parallel op ran throttled: a SmolLM2 decode step took 28-37 ms on an engine thread against
17-25 ms on the main thread, a Whisper one 13-17 ms against 8 (docs/BENCHMARKS.md).
Releasing a team as its thread goes idle (``omp_pause_resource_all``, OpenMP 5.0, frees the
calling thread's team in libgomp) leaves only the busy threads' teams; the next parallel region
on a released thread starts a new team (one thread start, ~0.1 ms).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")
_OMP_PAUSE_SOFT = 1


@functools.cache
def _pause() -> Callable[[int], int] | None:
    try:  # by soname: the libgomp torch already loaded, where it did
        return ctypes.CDLL("libgomp.so.1").omp_pause_resource_all  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # no libgomp (another OpenMP runtime, another OS): nothing to do
        return None


def release_thread_team() -> None:
    """Free the calling thread's OpenMP team (no-op without one, or without libgomp)."""
    pause = _pause()
    if pause is not None:
        pause(_OMP_PAUSE_SOFT)


def _released(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    try:
        return fn(*args, **kwargs)
    finally:
        release_thread_team()


async def to_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``asyncio.to_thread`` for torch work: the worker thread's team is released after ``fn``."""
    return await asyncio.to_thread(_released, fn, *args, **kwargs)
