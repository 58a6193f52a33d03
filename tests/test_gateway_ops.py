"""Gateway operations over a real uvicorn server (tiny Llama + MiniLM): request ids and the JSON
request log, the Prometheus series per modality, Server-Timing on embeddings and streams,
admission 429s with Retry-After from both engines' bounded queues, and the graceful drain."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import APIRouter

from gateway.logs import JsonFormatter
from tests.gateway_helpers import BUSY, EMBED, LLM, embed_engine, llm_engines, routers, serve

EMBED_BUSY = "embed-busy"
CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    from gateway.app import create_app
    from modalities.embed.engine import EmbeddingEngine

    embed = embed_engine()
    busy = EmbeddingEngine(embed.model, served_name=EMBED_BUSY, max_pending=0, num_workers=1)  # always full
    app = create_app({**llm_engines(), EMBED: embed, EMBED_BUSY: busy}, routers=routers())
    with serve(app) as (url, _):
        yield url


@pytest.fixture
def access_log() -> Iterator[io.StringIO]:
    """The ``mmserve.access`` records, rendered by the JSON formatter ``mmserve serve`` uses."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("mmserve.access")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield out
    logger.removeHandler(handler)
    logger.setLevel(level)


def _log_line(out: io.StringIO, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 5  # written when the response is complete, on the server thread
    while time.monotonic() < deadline:
        for line in out.getvalue().splitlines():
            record = json.loads(line)
            if record.get("request_id") == request_id:
                return record
        time.sleep(0.02)
    raise AssertionError(f"no log line for {request_id}: {out.getvalue()}")


def _timing(header: str) -> dict[str, float]:
    return {k.strip(): float(v) for k, v in (p.split(";dur=") for p in header.split(","))}


def test_request_id_and_json_log_line(base_url: str, access_log: io.StringIO) -> None:
    body = {"model": LLM, "messages": CHAT, "max_tokens": 3}
    resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers={"X-Request-ID": "req-42.a"})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "req-42.a"
    record = _log_line(access_log, "req-42.a")
    assert record["msg"] == "request" and record["level"] == "info"
    assert record["tenant"] == "anonymous" and record["model"] == LLM and record["status"] == 200
    assert record["route"] == "/v1/chat/completions" and record["modality"] == "llm" and record["method"] == "POST"
    assert record["completion_tokens"] == 3 and record["prompt_tokens"] > 0
    assert 0 <= record["queue_ms"] and 0 < record["inference_ms"] <= record["total_ms"]
    # no (or an unusable) id: one is generated, echoed, and logged, errors included
    resp = httpx.post(f"{base_url}/v1/embeddings", json={"input": []}, headers={"X-Request-ID": "bad id <x>"})
    generated = resp.headers["x-request-id"]
    assert resp.status_code == 400 and re.fullmatch(r"[0-9a-f]{32}", generated)
    record = _log_line(access_log, generated)
    assert record["status"] == 400 and record["modality"] == "embed"
    resp = httpx.get(f"{base_url}/no/such/route")
    assert _log_line(access_log, resp.headers["x-request-id"])["route"] == "other"


def test_server_timing_on_embeddings(base_url: str) -> None:
    resp = httpx.post(f"{base_url}/v1/embeddings", json={"model": EMBED, "input": ["a", "b c d"]})
    assert resp.status_code == 200
    t = _timing(resp.headers["server-timing"])
    assert set(t) == {"queue", "inference", "total"}
    assert 0 <= t["queue"] and 0 < t["inference"] and t["queue"] + t["inference"] <= t["total"] + 0.2


def test_server_timing_on_streams(base_url: str) -> None:
    body = {"model": LLM, "prompt": "Hello", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
        head = _timing(resp.headers["server-timing"])  # known when the headers left: queue, ttft
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert set(head) == {"queue", "ttft"} and 0 <= head["queue"] <= head["ttft"]
    final = events[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5
    timing = final["timing"]
    assert set(timing) == {"queue_ms", "inference_ms", "total_ms", "ttft_ms"}
    assert timing["queue_ms"] <= timing["ttft_ms"] <= timing["total_ms"] and timing["inference_ms"] > 0
    # without include_usage, the chunk that finishes the last choice carries it (openai client too)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model=LLM, messages=CHAT, max_tokens=4, n=2, stream=True))
    with_timing = [c for c in chunks if getattr(c, "timing", None)]
    assert len(with_timing) == 1 and with_timing[0] is chunks[-1]
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].timing["total_ms"] > 0


def test_bounded_queues_answer_429_with_retry_after(base_url: str) -> None:
    resp = httpx.post(f"{base_url}/v1/embeddings", json={"model": EMBED_BUSY, "input": "x"})
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
    assert resp.json()["error"]["code"] == "rate_limit_exceeded"
    resp = httpx.post(f"{base_url}/v1/completions", json={"model": BUSY, "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1


def test_metrics_series_per_modality(base_url: str) -> None:
    httpx.post(f"{base_url}/v1/completions", json={"model": LLM, "prompt": "Hi", "max_tokens": 3})
    httpx.post(f"{base_url}/v1/embeddings", json={"model": EMBED, "input": "Hi"})
    httpx.post(f"{base_url}/v1/completions", json={"model": BUSY, "prompt": "x", "max_tokens": 2})  # a 429
    text = httpx.get(f"{base_url}/metrics").text
    for needle in (
        'mmserve_http_requests_total{modality="llm",path="/v1/completions",status="200"}',
        'mmserve_http_requests_total{modality="embed",path="/v1/embeddings",status="200"}',
        'mmserve_http_request_errors_total{modality="llm",path="/v1/completions",status="429"}',
        'mmserve_http_request_duration_seconds_count{modality="embed",path="/v1/embeddings"}',
        'mmserve_http_request_duration_seconds_bucket{modality="llm",path="/v1/completions",le="+Inf"}',
        f'mmserve_time_to_first_token_seconds_count{{model="{LLM}"}}',
        f'mmserve_time_per_output_token_seconds_count{{model="{LLM}"}}',
        f'mmserve_e2e_request_latency_seconds_count{{model="{LLM}"}}',
        f'mmserve_request_queue_seconds_count{{modality="llm",model="{LLM}"}}',
        f'mmserve_request_inference_seconds_count{{modality="embed",model="{EMBED}"}}',
        f'mmserve_queue_depth{{modality="llm",model="{LLM}"}} 0',
        f'mmserve_queue_depth{{modality="embed",model="{EMBED}"}} 0',
        f'mmserve_running_batch_size{{modality="llm",model="{LLM}"}} 0',
        f'mmserve_running_batch_size{{modality="embed",model="{EMBED}"}} 0',
        f'mmserve_kv_cache_usage_ratio{{modality="llm",model="{LLM}"}}',
        f'mmserve_prefix_cache_hit_rate{{modality="llm",model="{LLM}"}}',
        f'mmserve_preemptions_total{{modality="llm",model="{LLM}"}} 0',
        "mmserve_http_inflight_requests 1",  # the scrape itself
    ):
        assert needle in text, needle
    # well-formed exposition: every sample belongs to a declared metric
    declared = set(re.findall(r"^# TYPE (\S+) (?:counter|gauge|histogram)$", text, re.M))
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})? -?[0-9.e+-]+|.* \+?Inf", line), line
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            assert name in declared or re.sub(r"_(bucket|sum|count)$", "", name) in declared, line


# -- graceful drain --------------------------------------------------------------------------------


def _stream_lines(url: str, body: dict[str, Any], first: threading.Event, out: list[str]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                first.set()


def test_drain_finishes_in_flight_stream_then_stops_engines() -> None:
    from gateway.app import create_app

    engines = llm_engines()
    stuck = APIRouter()

    @stuck.get("/test/stuck")  # never answers: the drain timeout must cut it
    async def never() -> None:
        await asyncio.sleep(3600)

    app = create_app({LLM: engines[LLM]}, routers=[*routers(), stuck], drain_timeout_s=5)
    body = {"model": LLM, "prompt": "Hi", "max_tokens": 40, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with serve(app, drain_timeout_s=20, grace_s=3.0) as (url, server):
        first, lines = threading.Event(), []
        reader = threading.Thread(target=_stream_lines, args=(url, body, first, lines))
        reader.start()
        assert first.wait(30)
        server.should_exit = True  # what SIGTERM does
        # uvicorn notices should_exit on its next 0.1 s tick: poll; during the grace period the
        # server still answers, but not ready
        deadline = time.monotonic() + 2.5
        while (ready := httpx.get(f"{url}/ready")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        reader.join(60)
        server.thread.join(30)
        assert not server.thread.is_alive()
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["usage"]["completion_tokens"] == 40  # the stream ran to its end
    assert not engines[LLM].is_running  # engines stopped after it

    # a request that never finishes is cancelled at the drain timeout; nothing hangs
    engines = llm_engines()
    app = create_app({LLM: engines[LLM]}, routers=[*routers(), stuck], drain_timeout_s=1)
    with serve(app, drain_timeout_s=1) as (url, server):
        answers: list[httpx.Response] = []

        def call() -> None:
            answers.append(httpx.get(f"{url}/test/stuck", timeout=30))

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.5)
        start = time.monotonic()
        server.should_exit = True
        server.thread.join(30)
        assert not server.thread.is_alive() and time.monotonic() - start < 15
        caller.join(10)
    assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "shutting_down"
    assert not engines[LLM].is_running


def test_error_json_escapes_what_utf8_cannot_encode() -> None:
    from gateway.errors import APIError, lone_surrogate

    body = APIError(404, "The model `\ud800` does not exist.").response().body
    assert json.loads(body)["error"]["message"] == "The model `\ud800` does not exist."
    assert lone_surrogate({"messages": [{"content": "ok"}, {"content": "bad \udc00"}]}) == "messages[1].content"
    assert lone_surrogate({"fine": ["é", "😀", 1, None]}) is None


def test_an_audio_streams_error_event_is_the_routes_error_object(caplog: pytest.LogCaptureFixture) -> None:
    """``error_event``: a failure after the status line went out carries the whole OpenAI error
    object the route would have sent (type, param, code); a bug's says nothing of its detail,
    which goes to the log."""
    from engine.errors import QueueFullError
    from gateway.streaming import error_event

    def event(exc: BaseException, param: str | None) -> dict[str, Any]:
        text = error_event(exc, param, "transcribing")
        assert text.startswith("data: ") and text.endswith("\n\n")
        return json.loads(text[6:])

    busy = event(QueueFullError(3), "file")
    assert busy["type"] == "error" and busy["error"]["code"] == "rate_limit_exceeded"
    bad = event(ValueError("no speech"), "input")["error"]
    assert bad == {"message": "no speech", "type": "invalid_request_error", "param": "input", "code": None}
    assert not caplog.records
    bug = event(KeyError("secret detail"), "file")["error"]
    assert bug == {"message": "internal error while transcribing", "type": "server_error", "param": None, "code": None}
    assert [r.exc_info[1] for r in caplog.records if r.exc_info] and "secret detail" in caplog.text


def test_a_streamed_response_closes_its_body_when_the_client_is_gone() -> None:
    """The body generator is closed (its ``finally``: the engine work and admission it holds
    released) as soon as a ``send`` fails, not when the garbage collector gets to it (Starlette's
    ``StreamingResponse`` leaves it suspended at its ``yield``)."""
    import gc

    from starlette.requests import ClientDisconnect

    from gateway.streaming import ClosingStreamingResponse

    closed: list[str] = []

    async def body() -> Any:
        try:
            for i in range(10):
                yield f"chunk {i}"
        finally:
            closed.append("closed")

    async def send(message: dict[str, Any]) -> None:
        if message.get("body"):
            raise OSError("the client is gone")

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def go() -> None:
        response = ClosingStreamingResponse(body())
        with pytest.raises(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        assert closed == ["closed"]  # (while ``response`` still holds the generator)

    gc.disable()
    try:
        asyncio.run(go())
    finally:
        gc.enable()


def test_a_raw_stream_cut_by_a_known_failure_is_one_log_line_and_a_cut_body(
    caplog: pytest.LogCaptureFixture, access_log: io.StringIO
) -> None:
    """A raw byte stream (``/v1/audio/speech`` audio) whose worker is lost after its status line:
    the client's body is cut short (the connection closes without the last chunk), the log says
    so in one warning, not twice as an unhandled error with a traceback, and the access line has
    ``outcome`` "error". A bug mid-stream still raises (uvicorn logs its traceback)."""
    from gateway.app import create_app
    from gateway.errors import APIError
    from gateway.streaming import ClosingStreamingResponse
    from tests.helpers import serve_app

    router = APIRouter()

    @router.get("/cut/{why}")
    async def cut(why: str) -> ClosingStreamingResponse:
        async def body() -> Any:
            yield b"RIFF" + bytes(4096)
            if why == "lost":
                raise APIError(503, "worker w1 was lost mid-request; the reply is incomplete", code="worker_lost")
            raise KeyError("a bug")

        return ClosingStreamingResponse(body(), media_type="audio/wav")

    with serve_app(create_app({}, routers=[router])) as url, caplog.at_level(logging.WARNING):
        for why in ("lost", "bug"):
            with pytest.raises(httpx.RemoteProtocolError), httpx.stream("GET", f"{url}/cut/{why}", timeout=30) as r:
                assert r.status_code == 200
                r.read()
    lost = [r for r in caplog.records if "/cut/lost" in r.getMessage()]
    assert [(r.levelname, r.exc_info) for r in lost] == [("WARNING", None)], caplog.text
    assert "the stream ended early: worker w1 was lost" in lost[0].getMessage()
    assert "/cut/bug: the stream ended early" not in caplog.text  # (a bug raises on, to uvicorn's log)
    lines = [json.loads(line) for line in access_log.getvalue().splitlines()]
    assert [line.get("outcome") for line in lines if line.get("route") == "/cut/{why}"][:1] == ["error"]


def test_a_raw_stream_the_client_left_is_logged_as_disconnected(access_log: io.StringIO) -> None:
    """A raw stream (``/v1/audio/speech`` audio, a transcription's events) that the client
    closes mid-way has ``outcome`` "disconnected" in its access line, as a chat stream has: its
    status (200) went out first, and without it the line reads as a stream served whole. A stream
    read to its end has no such outcome."""
    from gateway.app import create_app
    from gateway.streaming import ClosingStreamingResponse
    from tests.helpers import serve_app

    router = APIRouter()

    @router.get("/audio/{chunks}")
    async def audio(chunks: int) -> ClosingStreamingResponse:
        async def body() -> Any:
            for _ in range(chunks):
                yield bytes(4096)
                await asyncio.sleep(0.05)

        return ClosingStreamingResponse(body(), media_type="audio/wav")

    with serve_app(create_app({}, routers=[router])) as url:
        with httpx.stream("GET", f"{url}/audio/1000", timeout=30) as r:
            next(r.iter_raw())
            left = r.headers["x-request-id"]
        with httpx.stream("GET", f"{url}/audio/2", timeout=30) as r:
            r.read()
            whole = r.headers["x-request-id"]
        assert _log_line(access_log, left).get("outcome") == "disconnected"
        assert _log_line(access_log, whole).get("outcome") is None
