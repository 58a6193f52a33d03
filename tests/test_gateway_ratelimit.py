"""Rate-limit backends: the in-memory token bucket, and the Redis one against the real Redis at
127.0.0.1:6379 (db 12, a unique key prefix per test): two limiter instances (two gateway
processes) share one budget, the Lua script is atomic under concurrent takes, settle/refund
reconcile, and an unreachable Redis is a 503 in OpenAI error JSON. Then two real gateways on
one Redis budget over HTTP."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway.auth import KeyStore
from gateway.errors import APIError
from gateway.ratelimit import Charge, MemoryRateLimiter, RedisRateLimiter

REDIS_URL = "redis://127.0.0.1:6379/12"


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"mmserve-test-ratelimit-{uuid.uuid4().hex}:"
    yield p
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=p + "*"):
        client.delete(key)
    client.close()


def test_memory_bucket_take_refill_and_settle() -> None:
    async def run() -> None:
        rl = MemoryRateLimiter()
        assert await rl.take("t:llm_tokens", 50, 60) == 0.0
        wait = await rl.take("t:llm_tokens", 20, 60)  # 10 left, refills 1/s: ~10 s to 20
        assert 9 < wait <= 10
        assert await rl.take("t:llm_tokens", 61, 60) == math.inf  # never fits
        assert await rl.take("u:llm_tokens", 60, 60) == 0.0  # buckets are per key
        charge = Charge(rl, "t:llm_tokens", 10, 60)
        assert await rl.take("t:llm_tokens", 10, 60) == 0.0  # what ``charge`` does; ~0 left now
        await charge.settle(2)  # used 2 of 10: 8 back
        assert await rl.take("t:llm_tokens", 8, 60) == 0.0
        await charge.refund()  # at most once
        assert await rl.take("t:llm_tokens", 5, 60) > 0
        await Charge(rl, "t:llm_tokens", 1, 60).settle(40)  # usage beyond the estimate: debt
        assert await rl.take("t:llm_tokens", 1, 60) > 30

    asyncio.run(run())


def test_redis_two_instances_share_one_budget(prefix: str) -> None:
    async def run() -> None:
        a, b = (
            RedisRateLimiter(REDIS_URL, prefix=prefix, timeout_s=10),
            RedisRateLimiter(REDIS_URL, prefix=prefix, timeout_s=10),
        )
        try:
            assert await a.take("acme:image_steps", 40, 60) == 0.0
            wait = await b.take("acme:image_steps", 40, 60)  # the other gateway sees a's charge
            assert 19 < wait <= 21
            assert await b.take("other:image_steps", 40, 60) == 0.0
            await a.adjust("acme:image_steps", -30, 60)  # a refunds: b may take it
            assert await b.take("acme:image_steps", 40, 60) == 0.0
            assert await a.take("acme:image_steps", 61, 60) == math.inf
            # concurrent takes from both instances: the Lua script admits exactly the capacity
            results = await asyncio.gather(*(lim.take("race:embed_inputs", 1, 30) for lim in [a, b] * 25))
            assert 30 <= sum(1 for r in results if r == 0.0) <= 31  # + at most a refill of 0.5/s
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(run())


def test_redis_concurrent_takes_are_atomic(prefix: str) -> None:
    async def run() -> int:
        limiters = [RedisRateLimiter(REDIS_URL, prefix=prefix, timeout_s=10) for _ in range(4)]
        try:
            # (timeouts are generous: this checks atomicity on a loaded machine, not latency)
            # 1000/min refills ~17/s; 120 takes of 10 against a 1000 bucket: 100 fit, plus at
            # most what refills during the burst
            results = await asyncio.gather(*(limiters[i % 4].take("burst:llm_tokens", 10, 1000) for i in range(120)))
            return sum(1 for r in results if r == 0.0)
        finally:
            for lim in limiters:
                await lim.aclose()

    admitted = asyncio.run(run())
    assert 100 <= admitted <= 110, admitted


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_bucket_is_read_as_it_stands_and_left_alone(backend: str, prefix: str) -> None:
    """``level`` (what a Realtime session's ``rate_limits.updated`` reports) reads the bucket,
    refilled to now, without taking from it: a full one for a new key, debt below 0."""

    async def run() -> None:
        rl = MemoryRateLimiter() if backend == "memory" else RedisRateLimiter(REDIS_URL, prefix=prefix, timeout_s=10)
        try:
            assert await rl.level("t:llm_tokens", 600) == 600  # (no bucket yet: a full one)
            assert await rl.take("t:llm_tokens", 450, 600) == 0.0
            assert 150 <= await rl.level("t:llm_tokens", 600) < 160  # refills 10/s
            assert 150 <= await rl.level("t:llm_tokens", 600) < 160  # (reading took nothing)
            await rl.adjust("t:llm_tokens", 400, 600)  # usage beyond the estimate: owed
            assert -250 <= await rl.level("t:llm_tokens", 600) < -240
        finally:
            await rl.aclose()

    asyncio.run(run())


def test_bucket_is_the_tenants_budget_of_one_unit() -> None:
    """``bucket``: the tenant's budget of a unit it is limited in (with the seconds until it is
    full again); None for a unit it is not limited in, or no tenant."""
    from types import SimpleNamespace

    from gateway.ratelimit import bucket, charge

    async def run() -> None:
        tenant = SimpleNamespace(name="acme", limits={"llm_tokens": 600.0})
        request: Any = SimpleNamespace(
            state=SimpleNamespace(tenant=tenant),
            app=SimpleNamespace(state=SimpleNamespace(ratelimiter=MemoryRateLimiter())),
        )
        await charge(request, "llm_tokens", 300)
        level = await bucket(request, "llm_tokens")
        assert level is not None and level.limit_per_min == 600 and 300 <= level.tokens < 310
        assert 29 < level.reset_seconds <= 30  # 300 to refill at 10/s
        assert await bucket(request, "audio_seconds") is None
        request.state.tenant = None
        assert await bucket(request, "llm_tokens") is None

    asyncio.run(run())


def test_redis_down_is_503() -> None:
    async def run() -> None:
        rl = RedisRateLimiter("redis://127.0.0.1:1/0", timeout_s=0.5)  # nothing listens on port 1
        with pytest.raises(APIError) as info:
            await rl.take("t:llm_tokens", 1, 60)
        assert info.value.status_code == 503 and info.value.code == "ratelimiter_unavailable"
        await Charge(rl, "t:llm_tokens", 5, 60).settle(1)  # after the fact: logged, not raised
        await rl.aclose()

    asyncio.run(run())


def test_two_gateways_share_the_redis_budget(prefix: str) -> None:
    from gateway.app import create_app
    from tests.gateway_helpers import EMBED, embed_engine, routers, serve

    engine = embed_engine()

    def app() -> Any:
        store = KeyStore({"embed_inputs": 4.0})
        store.add_plain_key("acme", "k-acme")
        return create_app(
            {EMBED: engine}, routers=routers(), keys=store, ratelimiter=RedisRateLimiter(REDIS_URL, prefix)
        )

    headers = {"Authorization": "Bearer k-acme"}
    with serve(app()) as (url_a, _), serve(app()) as (url_b, _):
        assert httpx.post(f"{url_a}/v1/embeddings", json={"input": ["a", "b", "c"]}, headers=headers).status_code == 200
        resp = httpx.post(f"{url_b}/v1/embeddings", json={"input": ["d", "e"]}, headers=headers)
        assert resp.status_code == 429, resp.text  # gateway b knows what a spent
        assert resp.json()["error"]["code"] == "rate_limit_exceeded" and int(resp.headers["retry-after"]) >= 1
        assert httpx.post(f"{url_b}/v1/embeddings", json={"input": "f"}, headers=headers).status_code == 200
