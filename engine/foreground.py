"""A process-wide foreground hold: short, latency-critical CPU work makes yielding engines wait.

On a CPU, two compute-bound jobs that run at once share the cores: each takes about as long as
both would one after the other. A TTS voice's first piece synthesised while the LLM decodes took
240-290 ms where it takes ~110 ms alone, and the LLM's steps slowed from 20 to 40-140 ms meanwhile
(docs/BENCHMARKS.md): the first audio came ~130 ms later and the LLM gained nothing. Work that
starts a user's first audio takes a ``hold``; an engine loop that yields (``EngineConfig.
foreground_wait_s``) waits before each step while a hold is active, up to that many seconds, so the
hold runs alone and the engine resumes right after it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Foreground:
    """Counts active holds. ``hold()`` is a context manager, re-entrant and usable from any
    thread; ``wait(max_s)`` blocks while any hold is active, at most ``max_s`` seconds, and
    returns the seconds it waited."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._holds = 0

    @property
    def active(self) -> bool:
        return self._holds > 0

    @contextmanager
    def hold(self) -> Iterator[None]:
        with self._cv:
            self._holds += 1
        try:
            yield
        finally:
            with self._cv:
                self._holds -= 1
                if not self._holds:
                    self._cv.notify_all()

    def wait(self, max_s: float) -> float:
        if self._holds <= 0 or max_s <= 0:  # unlocked read: a missed hold only costs one step
            return 0.0
        t0 = time.monotonic()
        with self._cv:
            self._cv.wait_for(lambda: self._holds <= 0, timeout=max_s)
        return time.monotonic() - t0


FOREGROUND = Foreground()

# The request priority of latency-critical work, a live voice turn's: lower runs first in the LLM
# engine's scheduler (``scheduling_policy="priority"``) and in the ASR encoder's queue.
INTERACTIVE = -1
