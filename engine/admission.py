"""A bound on the requests an engine holds at once (the TTS voices, Whisper: engines whose own
queues are not bounded per request): past it, a request that may be refused is, with
``HeldBoundError`` (the routes' 429 with ``Retry-After``), before any work is done for it. Work a
route does before the engine's (decoding an upload) takes a place with ``reserve``, so that a
burst past the bound is refused before that work too, not after it.

Only requests that ask for it are refused: the HTTP routes' ones, whose clients can retry. A live
voice turn, or a job already admitted by its own queue, waits its turn behind them instead (a
refused stage of a chain would fail the chain). They count towards the bound all the same, so
they may take the count past it.

``Retry-After`` treats refused clients as a queue: a client is told to come back once the
requests ahead of it, ``limit`` per usual hold time of a refusable request, have had their turn
(the clients already told to come back and not yet due are ahead of it). A burst's refused
clients (the ``openai`` client waits exactly as told) then come back in waves the freed room
takes, not all at once into the same full bound."""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from engine.errors import QueueFullError

MAX_RETRY_AFTER_S = 60  # (the ``openai`` client takes a longer Retry-After as no advice at all)
HOLD_SMOOTHING = 0.2  # the weight of the last request in the running mean of hold times
T = TypeVar("T")


class HeldBoundError(QueueFullError):
    """Refused at an engine's bound of requests held, before any work for it: another engine
    (another worker) may take it at once."""


@dataclass
class Admission:
    """``limit``: the requests held at once past which refusable ones are refused (None: no bound).
    Not thread-safe: enter and leave on the engine's event loop."""

    limit: int | None = None
    active: int = 0  # requests inside ``hold``
    reserved: int = 0  # requests inside ``reserve``: on their way to ``hold``
    hold_s: float = 1.0  # a running mean of how long a refusable request stays inside
    _due: deque[float] = field(default_factory=deque)  # when the refused clients were told to come back

    @contextlib.contextmanager
    def hold(self, refusable: bool) -> Iterator[None]:
        """Count a request for the time it is inside; raises ``HeldBoundError`` first when it is
        ``refusable`` and ``limit`` requests are already held."""
        start = time.monotonic()
        self._refuse_when_full(refusable)
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            if refusable:  # (a job's or a live turn's time says nothing of when a client finds room)
                sample = min(time.monotonic() - start, MAX_RETRY_AFTER_S)
                self.hold_s += HOLD_SMOOTHING * (sample - self.hold_s)

    @contextlib.contextmanager
    def reserve(self, refusable: bool) -> Iterator[None]:
        """A place for a request's work before ``hold`` (a route decoding an upload), refused as
        ``hold`` refuses. Both count the places reserved: of a burst, only as many as there is
        room for get to do that work. Given back on leaving (``hold`` then takes its own)."""
        self._refuse_when_full(refusable)
        self.reserved += 1
        try:
            yield
        finally:
            self.reserved -= 1

    def _refuse_when_full(self, refusable: bool) -> None:
        taken = self.active + self.reserved
        if refusable and self.limit is not None and taken >= self.limit:
            raise HeldBoundError(taken, self._retry_after(time.monotonic()), "in progress")

    async def held(self, refusable: bool, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """``items`` (an engine's stream), counted inside ``hold`` while they are read and closed
        as soon as the reader stops (not when the garbage collector gets to them)."""
        with self.hold(refusable):
            async with contextlib.aclosing(items) as each:
                async for item in each:
                    yield item

    def _retry_after(self, now: float) -> float:
        """Whole hold times (at least a second) until this refused client likely finds room."""
        unit = max(1, math.ceil(self.hold_s))
        while self._due and self._due[0] <= now:  # (come back by now: no longer ahead of anyone)
            self._due.popleft()
        limit = max(1, self.limit or 1)
        wait = min(MAX_RETRY_AFTER_S, unit * (1 + len(self._due) // limit))
        if len(self._due) < limit * (MAX_RETRY_AFTER_S // unit + 1):  # (more ahead would change nothing)
            self._due.append(now + wait)
        return float(wait)
