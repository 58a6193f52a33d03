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

# How long a yielding loop waits for a hold by default: on a CPU, a TTS first piece's time and
# some; on a GPU nothing shares the cores, so no waiting.
DEFAULT_WAIT_S = 0.25


def default_wait_s(device: str) -> float:
    return DEFAULT_WAIT_S if str(device).startswith("cpu") else 0.0


class Turns:
    """A yielding loop's turns with the foreground holds: ``due()`` says it should wait now (a
    hold is active, waiting is on, and since its last wait it ran at least as long as that wait);
    it waits at most ``max_s``, then tells ``waited(seconds)``. Back-to-back holds (a burst of TTS
    requests) so take at most half of the loop's time."""

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self._again_at = 0.0  # monotonic: no wait before then

    def due(self) -> bool:
        return self.max_s > 0 and FOREGROUND.active and time.monotonic() >= self._again_at

    def waited(self, seconds: float) -> None:
        self._again_at = time.monotonic() + seconds


# The request priority of latency-critical work, a live voice turn's: lower runs first in the LLM
# engine's scheduler (``scheduling_policy="priority"``) and in the ASR encoder's queue.
INTERACTIVE = -1
