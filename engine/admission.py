"""A bound on the requests an engine holds at once, for engines without a waiting queue of their
own to bound (the Piper voice, Whisper): past it, a request that may be refused is, with
``QueueFullError`` (the routes' 429 with ``Retry-After``), before any work is done for it.

Only requests that ask for it are refused: the HTTP routes' ones, whose clients can retry. A live
voice turn, or a job already admitted by its own queue, waits its turn behind them instead (a
refused stage of a chain would fail the chain). They count towards the bound all the same.

``Retry-After`` is when room is likely: a request's usual hold time for the first ``limit``
clients refused within one such time, twice that for the next ``limit``, and so on. A burst's
refused clients (the ``openai`` client waits exactly as told) then come back in waves the freed
room takes, not all at once into the same full bound."""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.errors import QueueFullError

MAX_RETRY_AFTER_S = 60  # (the ``openai`` client takes a longer Retry-After as no advice at all)
HOLD_SMOOTHING = 0.2  # the weight of the last request in the running mean of hold times


@dataclass
class Admission:
    """``limit``: the requests held at once past which refusable ones are refused (None: no bound).
    Not thread-safe: enter and leave on the engine's event loop."""

    limit: int | None = None
    active: int = 0  # requests inside ``hold``
    hold_s: float = 1.0  # a running mean of how long a request stays inside
    _refused: deque[float] = field(default_factory=deque)  # when the recent refusals were

    @contextlib.contextmanager
    def hold(self, refusable: bool) -> Iterator[None]:
        """Count a request for the time it is inside; raises ``QueueFullError`` first when it is
        ``refusable`` and ``limit`` requests are already held."""
        start = time.monotonic()
        if refusable and self.limit is not None and self.active >= self.limit:
            raise QueueFullError(self.active, self._retry_after(start), "in progress")
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            self.hold_s += HOLD_SMOOTHING * (time.monotonic() - start - self.hold_s)

    def _retry_after(self, now: float) -> float:
        """Whole hold times (at least a second) until this refused request likely finds room."""
        unit = max(1, math.ceil(self.hold_s))
        while self._refused and self._refused[0] < now - unit:
            self._refused.popleft()
        wave = len(self._refused) // max(1, self.limit or 1)
        self._refused.append(now)
        return float(min(MAX_RETRY_AFTER_S, unit * (1 + wave)))


def parse_limit(text: str) -> int | None:
    """A ``--*-max-requests`` value: a positive count, or 0 for no bound (argparse ``type``)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no bound) or more, got {value}")
    return value or None
