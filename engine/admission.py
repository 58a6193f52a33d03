"""A bound on the requests an engine holds at once, for engines without a waiting queue of their
own to bound (the Piper voice, Whisper): past it, a request that may be refused is, with
``QueueFullError`` (the routes' 429 with ``Retry-After``), before any work is done for it.

Only requests that ask for it are refused: the HTTP routes' ones, whose clients can retry. A live
voice turn, or a job already admitted by its own queue, waits its turn behind them instead (a
refused stage of a chain would fail the chain). They count towards the bound all the same."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from engine.errors import QueueFullError


@dataclass
class Admission:
    """``limit``: the requests held at once past which refusable ones are refused (None: no bound).
    ``retry_after_s``: the wait suggested to a refused client. Not thread-safe: enter and leave on
    the engine's event loop."""

    limit: int | None = None
    retry_after_s: float = 1.0
    active: int = 0  # requests inside ``hold``

    @contextlib.contextmanager
    def hold(self, refusable: bool) -> Iterator[None]:
        """Count a request for the time it is inside; raises ``QueueFullError`` first when it is
        ``refusable`` and ``limit`` requests are already held."""
        if refusable and self.limit is not None and self.active >= self.limit:
            raise QueueFullError(self.active, self.retry_after_s)
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
