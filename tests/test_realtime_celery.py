"""``/v1/realtime`` with ``--dispatch celery``: the gateway holds no models, its LLM, ASR and TTS
are proxies to real ``mmserve worker`` processes (a tiny random LLM, Whisper tiny.en, the Piper
voice) over Redis (127.0.0.1:6379 db 15, a unique prefix per run). One voice turn goes through
as on local engines: the same events, the transcript, a reply with audio."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.helpers import serve_app
from tests.test_realtime import BETA, QUESTION, Client, assert_voice_turn, speech
from workers.local_cluster import start_worker, wait_for_heartbeats

websockets = pytest.importorskip("websockets")
REDIS_URL = "redis://127.0.0.1:6379/15"
PREFIX = f"t-rtcel-{uuid.uuid4().hex[:8]}"
TTS_ARGS = ["--tts-workers", "1", "--tts-threads", "1"]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from gateway.app import build_app
    from gateway.cli import build_parser

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    llm = ["--llm", str(tiny_model_dir("llama")), "--max-model-len", "512"]
    logs = tmp_path_factory.mktemp("workers")
    procs = [
        start_worker(kind, REDIS_URL, PREFIX, args, worker_id=f"{PREFIX}-{kind}", log_dir=logs)
        for kind, args in (("llm", llm), ("asr", []), ("tts", TTS_ARGS))
    ]
    try:
        wait_for_heartbeats(REDIS_URL, PREFIX, procs)
        argv = ["serve", "--only", "llm,asr,tts", *llm, *TTS_ARGS, "--dispatch", "celery"]
        args = build_parser().parse_args([*argv, "--redis-url", REDIS_URL, "--prefix", PREFIX])
        with serve_app(build_app(args)) as url:
            deadline = time.monotonic() + 30
            while httpx.get(f"{url}/ready").status_code != 200:
                assert time.monotonic() < deadline, httpx.get(f"{url}/ready").text
                time.sleep(0.2)
            yield url.replace("http://", "ws://") + "/v1/realtime"
    finally:
        for p in procs:
            p.kill()
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{PREFIX}*", count=1000):
            client.delete(key)


def test_a_voice_turn_over_celery(gateway: str) -> None:
    async def go() -> None:
        async with websockets.connect(gateway, max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            created = await c.until("session.created")
            assert created["session"]["modalities"] == ["text", "audio"]  # the TTS proxy counts as served
            await c.send("session.update", session={"temperature": 0, "max_response_output_tokens": 8})
            await c.until("session.updated")
            feeder = asyncio.create_task(c.stream(speech(QUESTION)))
            done = await c.until("response.done", timeout=90)
            await feeder
            assert_voice_turn(c, done)
            assert done["response"]["usage"]["output_tokens"] > 0

    asyncio.run(go())
