"""``rate_limits.updated``: the limits a Realtime session's replies meet, in OpenAI's shape.

OpenAI's figures are an organisation's per-minute budgets of requests and tokens. mmserve has no
such budget for a session's replies: its tenant pays for the input audio (``audio_seconds``,
``gateway.ratelimit``), and the replies it generates are not charged. So the figures sent are
the bounds the LLM engine holds every reply to, under OpenAI's two names:

- ``requests``: the engine's waiting queue (``max_waiting``, shared by every client of the
  engine): past it a reply is refused (``QueueFullError``); ``remaining``, the places free now.
- ``tokens``: its context window (``max_model_len``), a reply's prompt and output together;
  ``remaining``, what the reply just ended left of it (the next reply's prompt grows from it,
  and the conversation's oldest items leave the prompt when it is full).

Neither refills with time (a place frees as a waiting request starts), so ``reset_seconds`` is
0. A bound the engine does not have (``--max-waiting 0``) or does not show (an LLM on a worker,
``workers.proxies``, shows no queue) is left out, and with neither no event is sent.
"""

from __future__ import annotations

import sys
from typing import Any


def rate_limits(llm: Any, used_tokens: int) -> list[dict[str, Any]]:
    """The ``rate_limits`` after a reply that used ``used_tokens`` of the context (its usage's
    ``total_tokens``; 0 for one that never started), for LLM engine ``llm``."""
    limits = []
    queue = getattr(llm, "max_waiting", None)
    if isinstance(queue, int) and queue < sys.maxsize and callable(getattr(llm, "stats", None)):
        limits.append(_limit("requests", queue, queue - int(llm.stats().get("num_waiting", 0))))
    window = getattr(llm, "max_model_len", None)
    if isinstance(window, int):
        limits.append(_limit("tokens", window, window - used_tokens))
    return limits


def _limit(name: str, limit: int, remaining: int) -> dict[str, Any]:
    return {"name": name, "limit": limit, "remaining": max(0, remaining), "reset_seconds": 0.0}
