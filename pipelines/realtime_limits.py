"""``rate_limits.updated``: the limits a Realtime session's replies meet, in OpenAI's shape.

OpenAI emits it "at the beginning of a Response": the tokens reserved for the response's output
are taken then, and the figures, which reflect that reservation, are adjusted once it completes.
So a session sends it twice per reply: once its tokens are reserved (``LLMReserved``: after
``response.created``, before its first delta; a reply refused before that sends none), and right
after its ``response.done``, adjusted to what it used (the client sees the adjustment then).

- ``tokens``: with a tenant limited in ``llm_tokens`` (``gateway.ratelimit``), which pays for
  the replies, its budget: ``limit`` a minute, ``remaining`` what the bucket holds (the reply's
  prompt and max tokens taken at its start, its usage after), ``reset_seconds`` until it is full
  again. Otherwise the bound the LLM engine holds every reply to: its context window
  (``max_model_len``, a reply's prompt and output together), and what the reply reserved of it
  (its usage after; the next reply's prompt grows from it, and the conversation's oldest items
  leave the prompt when it is full), with ``reset_seconds`` 0.
- ``requests``: tenants have no budget of requests, so it is the engine's waiting queue
  (``max_waiting``, shared by every client of the engine; past it a reply is refused,
  ``QueueFullError``): ``remaining``, the places free now; ``reset_seconds`` 0 (a place frees as a
  waiting request starts, not with time).

A bound the engine does not have (``--max-waiting 0``) or does not show (an LLM on a worker,
``workers.proxies``, shows no queue) is left out, and with neither no event is sent.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from fastapi import WebSocket

from gateway.errors import APIError
from gateway.ratelimit import bucket

logger = logging.getLogger("mmserve.realtime")


async def rate_limits(ws: WebSocket, llm: Any, used_tokens: int) -> list[dict[str, Any]]:
    """The ``rate_limits`` of session ``ws`` (its tenant) over LLM engine ``llm``, for a reply
    holding ``used_tokens`` of the context: its prompt and max tokens as it starts, its usage's
    ``total_tokens`` once done (0 for one that never started)."""
    limits = []
    queue = getattr(llm, "max_waiting", None)
    if isinstance(queue, int) and queue < sys.maxsize and callable(getattr(llm, "stats", None)):
        limits.append(_limit("requests", queue, queue - int(llm.stats().get("num_waiting", 0))))
    try:
        budget = await bucket(ws, "llm_tokens")
    except APIError as exc:  # (the limiter unreachable: the figures are left out, the session goes on)
        logger.warning("rate_limits.updated without the tenant's tokens: %s", exc.message)
        return limits
    if budget is not None:
        reset = round(budget.reset_seconds, 3)
        limits.append(_limit("tokens", int(budget.limit_per_min), int(budget.tokens), reset))
        return limits
    window = getattr(llm, "max_model_len", None)
    if isinstance(window, int):
        limits.append(_limit("tokens", window, window - used_tokens))
    return limits


def _limit(name: str, limit: int, remaining: int, reset_seconds: float = 0.0) -> dict[str, Any]:
    return {"name": name, "limit": limit, "remaining": max(0, remaining), "reset_seconds": reset_seconds}
