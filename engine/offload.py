"""CPU work a request brings to the event loop (tokenizing a long text, rendering a template),
run on a worker thread when it is large: the loop serves every other request meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

OFF_LOOP_CHARS = 20_000  # below this a thread hop costs more than the work (~1 ms of tokenizing)


async def run_sized(size: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``: inline for ``size`` (characters) up to ``OFF_LOOP_CHARS``, else on a thread."""
    if size > OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
