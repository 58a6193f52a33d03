"""Per-tenant rate limits in each modality's own units, as token buckets.

Units (amounts per minute, configured per tenant in the keys file or with ``--limit``):

==================  ==================================================================
``llm_tokens``      LLM tokens: prompt + ``max_tokens`` at admission, settled to the real usage after
``embed_inputs``    embedding inputs (strings or token-id lists)
``audio_seconds``   seconds of audio in (ASR) or out (TTS)
``image_steps``     diffusion denoising steps (``n`` images x ``steps``)
==================  ==================================================================

**Calling it from a route** (every modality, before any work starts)::

    from gateway.ratelimit import charge

    ch = await charge(request, "image_steps", body.n * body.steps)   # 429 + Retry-After if over
    try:
        result = await engine.run(job)
    except BaseException:
        await ch.refund()              # failed or cancelled: give the budget back
        raise
    await ch.settle(actual_amount)     # optional: reconcile an estimate with the real usage

``charge`` raises ``APIError(429)`` (OpenAI error JSON, ``code="rate_limit_exceeded"``, header
``Retry-After`` in whole seconds) when the tenant's bucket lacks ``amount``; a request larger
than a whole minute's budget can never pass and gets 429 with ``code="request_too_large"``
and no ``Retry-After``. A tenant without a limit for the unit is not limited (``charge`` is then
free: no backend call). When the backend is unreachable (Redis down) the answer is 503.

``bucket(request, unit)`` reads the tenant's budget as it stands, taking nothing (a Realtime
session reports it in ``rate_limits.updated``).

A bucket holds at most one minute's budget and refills continuously; ``settle``/``refund`` may
push it below zero (usage beyond the estimate is owed, later requests wait for it).

Backends: ``MemoryRateLimiter`` (one process: ``--dispatch local``) and ``RedisRateLimiter``
(an atomic Lua token bucket on Redis' clock, so every gateway process of a ``celery``
deployment shares one budget per tenant).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import HTTPConnection

from gateway.errors import APIError

logger = logging.getLogger("mmserve.gateway")

UNITS = ("llm_tokens", "embed_inputs", "audio_seconds", "image_steps")


class RateLimiter(Protocol):
    """Token buckets keyed by ``"<tenant>:<unit>"`` with capacity ``limit_per_min`` refilled
    at ``limit_per_min / 60`` per second."""

    async def take(self, key: str, amount: float, limit_per_min: float) -> float:
        """Take ``amount`` if the bucket holds it and return 0.0; otherwise take nothing and
        return the seconds until it would hold it (``math.inf`` when it never can)."""
        ...

    async def adjust(self, key: str, amount: float, limit_per_min: float) -> None:
        """Charge ``amount`` more unconditionally (negative: refund), capped at a full bucket."""
        ...

    async def level(self, key: str, limit_per_min: float) -> float:
        """What the bucket holds now (below 0: usage owed), changing nothing."""
        ...

    async def aclose(self) -> None: ...


def _refill(tokens: float, elapsed: float, cap: float) -> float:
    return min(cap, tokens + max(0.0, elapsed) * cap / 60.0)


class MemoryRateLimiter:
    """In-process buckets (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, monotonic time)

    def _level(self, key: str, cap: float, now: float) -> float:
        tokens, then = self._buckets.get(key, (cap, now))
        return _refill(tokens, now - then, cap)

    async def take(self, key: str, amount: float, limit_per_min: float) -> float:
        if amount > limit_per_min:
            return math.inf
        with self._lock:
            now = time.monotonic()
            tokens = self._level(key, limit_per_min, now)
            if tokens >= amount:
                self._buckets[key] = (tokens - amount, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (amount - tokens) * 60.0 / limit_per_min

    async def adjust(self, key: str, amount: float, limit_per_min: float) -> None:
        with self._lock:
            now = time.monotonic()
            tokens = self._level(key, limit_per_min, now)
            self._buckets[key] = (min(limit_per_min, tokens - amount), now)

    async def level(self, key: str, limit_per_min: float) -> float:
        with self._lock:
            return self._level(key, limit_per_min, time.monotonic())

    async def aclose(self) -> None:
        pass


# KEYS[1]: the bucket (a hash: tokens, ts). ARGV: capacity, amount, mode ("take" | "adjust" |
# "level": read only). Time comes from Redis, so gateways with skewed clocks agree. Returns
# {taken, wait_s, tokens}; numbers travel as strings because Redis truncates Lua numbers to integers.
_LUA = """
local cap = tonumber(ARGV[1])
local amount = tonumber(ARGV[2])
local rate = cap / 60.0
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1])
local ts = tonumber(b[2])
if tokens == nil then tokens = cap; ts = now end
tokens = math.min(cap, tokens + math.max(0, now - ts) * rate)
if ARGV[3] == 'level' then return {1, '0', tostring(tokens)} end
local taken = 1
local wait = 0
if ARGV[3] == 'take' then
  if tokens >= amount then tokens = tokens - amount else taken = 0; wait = (amount - tokens) / rate end
else
  tokens = math.min(cap, tokens - amount)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - tokens) / rate * 1000) + 1000)
return {taken, tostring(wait), tostring(tokens)}
"""


class RedisRateLimiter:
    """Buckets in Redis under ``<prefix><key>``, updated atomically by one Lua script. A missing
    or expired key is a full bucket, so keys expire once refilled."""

    def __init__(self, url: str, prefix: str = "mmserve:ratelimit:", timeout_s: float = 1.0) -> None:
        self.url = url
        self.prefix = prefix
        self.timeout_s = timeout_s
        self._client: Any = None
        self._script: Any = None

    def _ensure(self) -> Any:
        # Created on first use: redis.asyncio connections belong to the loop that opened them.
        if self._script is None:
            import redis.asyncio as aioredis

            from workers.wire import restart_retry

            self._client = aioredis.Redis.from_url(
                self.url,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                **restart_retry(aio=True),
            )
            self._script = self._client.register_script(_LUA)
        return self._script

    async def _call(self, key: str, amount: float, cap: float, mode: str) -> list[Any]:
        from redis.exceptions import RedisError

        try:
            return await self._ensure()(keys=[self.prefix + key], args=[repr(cap), repr(amount), mode])
        except (RedisError, OSError) as exc:
            raise APIError(503, f"the rate limiter is unavailable: {exc}", code="ratelimiter_unavailable") from exc

    async def take(self, key: str, amount: float, limit_per_min: float) -> float:
        if amount > limit_per_min:
            return math.inf
        taken, wait, _ = await self._call(key, amount, limit_per_min, "take")
        return 0.0 if int(taken) else float(wait)

    async def adjust(self, key: str, amount: float, limit_per_min: float) -> None:
        await self._call(key, amount, limit_per_min, "adjust")

    async def level(self, key: str, limit_per_min: float) -> float:
        return float((await self._call(key, 0.0, limit_per_min, "level"))[2])

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = self._script = None


@dataclass
class Charge:
    """What ``charge`` took; ``settle``/``refund`` reconcile it (each at most once)."""

    limiter: RateLimiter | None
    key: str
    amount: float
    limit_per_min: float
    settled: bool = False

    async def settle(self, actual: float) -> None:
        """Replace the admission estimate by the ``actual`` usage (refunds or charges the difference)."""
        if self.settled:
            return
        self.settled = True
        if self.limiter is not None and actual != self.amount:
            try:  # (shielded: a caller cancelled meanwhile, a closed session, must not lose it)
                await asyncio.shield(self.limiter.adjust(self.key, actual - self.amount, self.limit_per_min))
            except Exception:  # noqa: BLE001 - bookkeeping after the fact must not fail the response
                logger.warning("could not settle the rate-limit charge of %s", self.key, exc_info=True)

    async def refund(self) -> None:
        """Give the whole amount back (the request failed before doing its work)."""
        await self.settle(0.0)


_REFUNDS: set[asyncio.Task[None]] = set()  # (running refunds: the loop keeps only weak references)


async def shielded(taking: Awaitable[Charge]) -> Charge:
    """``await taking`` (a ``charge``) so that a caller cancelled meanwhile (a reply cut by a
    barge-in) does not leak it: the charge completes, and is refunded."""
    task = asyncio.ensure_future(taking)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_refund_taken)
        raise


def _refund_taken(task: asyncio.Future[Charge]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    refund = asyncio.ensure_future(task.result().refund())
    _REFUNDS.add(refund)
    refund.add_done_callback(_REFUNDS.discard)


@dataclass(frozen=True)
class Bucket:
    """One tenant's budget of one unit, as it stands."""

    limit_per_min: float
    tokens: float  # what it holds now (below 0: usage owed)

    @property
    def reset_seconds(self) -> float:
        """Seconds until it is full again (it refills a whole minute's budget in a minute)."""
        return max(0.0, (self.limit_per_min - self.tokens) * 60.0 / self.limit_per_min)


def _limited(request: HTTPConnection, unit: str) -> tuple[RateLimiter, str, float] | None:
    """``(limiter, key, limit per minute)`` of the request's tenant for ``unit``; None when the
    tenant has no limit for it (or the app no limiter)."""
    if unit not in UNITS:
        raise ValueError(f"unknown rate-limit unit {unit!r}")  # a bug in the caller, not user input
    tenant = getattr(request.state, "tenant", None)
    limit = tenant.limits.get(unit) if tenant is not None else None
    limiter: RateLimiter | None = getattr(request.app.state, "ratelimiter", None)
    if limit is None or limiter is None:
        return None
    return limiter, f"{tenant.name}:{unit}", limit


async def charge(request: HTTPConnection, unit: str, amount: float) -> Charge:
    """Take ``amount`` of ``unit`` from the budget of the request's tenant (``request.state.tenant``;
    a WebSocket's too) or raise ``APIError(429)`` with ``Retry-After``. Free when the tenant has no
    limit for ``unit``."""
    limited = _limited(request, unit)
    if limited is None or amount <= 0:
        return Charge(None, "", amount, 0.0, settled=True)
    limiter, key, limit = limited
    tenant = request.state.tenant
    wait = await limiter.take(key, amount, limit)
    if wait == math.inf:
        raise APIError(
            429,
            f"Request too large for tenant {tenant.name!r}: it needs {amount:g} {unit}, more than the limit of "
            f"{limit:g} {unit} per minute.",
            code="request_too_large",
        )
    if wait > 0:
        retry = max(1, math.ceil(wait))
        raise APIError(
            429,
            f"Rate limit reached for tenant {tenant.name!r}: {limit:g} {unit} per minute. "
            f"This request needs {amount:g}; please try again in {retry}s.",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry)},
        )
    return Charge(limiter, key, amount, limit)


async def bucket(request: HTTPConnection, unit: str) -> Bucket | None:
    """The budget ``charge`` takes ``unit`` from for the request's tenant, as it stands now (None:
    the tenant has no limit for ``unit``). ``APIError(503)`` when the backend is unreachable."""
    limited = _limited(request, unit)
    if limited is None:
        return None
    limiter, key, limit = limited
    return Bucket(limit, await limiter.level(key, limit))


def limiter_from_args(args: Any) -> RateLimiter:
    """Redis buckets under ``--dispatch celery`` (shared by every gateway), memory otherwise."""
    if getattr(args, "dispatch", "local") == "celery" and getattr(args, "redis_url", None):
        return RedisRateLimiter(args.redis_url, prefix=f"{getattr(args, 'prefix', 'mmserve')}:ratelimit:")
    return MemoryRateLimiter()
