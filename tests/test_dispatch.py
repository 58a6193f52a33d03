"""``--dispatch celery`` end to end: real Redis (127.0.0.1:6379 db 11, a unique prefix per run),
real ``mmserve worker`` subprocesses (two tiny-llama LLM workers, one embedding worker) and a
real uvicorn gateway; every answer is compared with the same request under ``--dispatch local``."""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from tests.helpers import serve_app
from workers.local_cluster import WorkerProc, start_worker, wait_for_heartbeats
from workers.wire import Keys

REDIS_URL = "redis://127.0.0.1:6379/11"
PREFIX = f"t-dispatch-{uuid.uuid4().hex[:8]}"
LLM = "llama-0"


def _redis_or_skip() -> None:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Any) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def workers(tiny_llm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProc]]:
    _redis_or_skip()
    logs = tmp_path_factory.mktemp("workers")
    llm_args = ["--llm", str(tiny_llm), "--max-model-len", "256"]
    procs = [
        start_worker("llm", REDIS_URL, PREFIX, llm_args, worker_id=f"{PREFIX}-llm-a", log_dir=logs),
        start_worker("llm", REDIS_URL, PREFIX, llm_args, worker_id=f"{PREFIX}-llm-b", log_dir=logs),
        start_worker("embed", REDIS_URL, PREFIX, [], worker_id=f"{PREFIX}-embed", log_dir=logs),
    ]
    try:
        wait_for_heartbeats(REDIS_URL, PREFIX, procs)
        yield procs
    finally:
        for p in procs:
            p.kill()


def _args(tiny_llm: Path, dispatch: str) -> Any:
    from gateway.cli import build_parser

    argv = ["serve", "--only", "llm,embed", "--llm", str(tiny_llm), "--max-model-len", "256", "--dispatch", dispatch]
    return build_parser().parse_args([*argv, "--redis-url", REDIS_URL, "--prefix", PREFIX])


@pytest.fixture(scope="module")
def remote(workers: list[WorkerProc], tiny_llm: Path) -> Iterator[str]:
    from gateway.app import build_app

    with serve_app(build_app(_args(tiny_llm, "celery"))) as url:
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/ready").status_code != 200:
            assert time.monotonic() < deadline, httpx.get(f"{url}/ready").text
            time.sleep(0.2)
        yield url


@pytest.fixture(scope="module")
def local(tiny_llm: Path) -> Iterator[str]:
    from gateway.app import build_app

    with serve_app(build_app(_args(tiny_llm, "local"))) as url:
        yield url


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _sse(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _strip(resp: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in resp.items() if k not in ("id", "created", "system_fingerprint")}


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Equal, except float logprobs within 1e-4 (batch composition differs between the two)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for k in want:
            _assert_same(got[k], want[k])
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same(g, w)
    else:
        assert got == want


def _heartbeats() -> dict[str, dict[str, Any]]:
    client = redis.Redis.from_url(REDIS_URL)
    keys = Keys(PREFIX)
    out = {}
    for key in client.scan_iter(match=keys.worker_pattern):
        data = json.loads(client.get(key) or "null")
        if data:
            out[data["worker_id"]] = data
    return out


COMPLETION = {"model": LLM, "prompt": ["The capital of France is", "1, 2, 3,"], "max_tokens": 12, "temperature": 0}
CHAT = {"model": LLM, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 10, "temperature": 0}


def test_ready_reports_workers(remote: str) -> None:
    body = httpx.get(f"{remote}/ready").json()
    assert body["redis"] is True
    assert sorted(body["workers"][LLM]) == [f"{PREFIX}-llm-a", f"{PREFIX}-llm-b"]
    assert body["workers"]["all-MiniLM-L6-v2"] == [f"{PREFIX}-embed"]


def test_completions_match_local(remote: str, local: str) -> None:
    body = {**COMPLETION, "logprobs": 2}
    got, want = _post(remote, "/v1/completions", body), _post(local, "/v1/completions", body)
    assert got.status_code == want.status_code == 200, got.text
    _assert_same(_strip(got.json()), _strip(want.json()))


def test_chat_matches_local(remote: str, local: str) -> None:
    got, want = _post(remote, "/v1/chat/completions", CHAT), _post(local, "/v1/chat/completions", CHAT)
    assert got.status_code == want.status_code == 200, got.text
    _assert_same(_strip(got.json()), _strip(want.json()))


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", {**COMPLETION, "logprobs": 1}), ("/v1/chat/completions", CHAT)]
)
def test_streams_match_local(remote: str, local: str, path: str, body: dict[str, Any]) -> None:
    got, want = _sse(remote, path, body), _sse(local, path, body)

    def text(events: list[dict[str, Any]]) -> dict[int, str]:
        out: dict[int, str] = {}
        for ev in events:
            for ch in ev.get("choices", []):
                piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                out[ch["index"]] = out.get(ch["index"], "") + piece
        return out

    def finishes(events: list[dict[str, Any]]) -> list[Any]:
        return sorted((c["index"], c["finish_reason"]) for e in events for c in e["choices"] if c.get("finish_reason"))

    def usage(events: list[dict[str, Any]]) -> list[Any]:  # rebuilt from the streamed deltas
        return [e["usage"] for e in events if e.get("usage")]

    def logprob_tokens(events: list[dict[str, Any]]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for c in (c for e in events for c in e["choices"]):
            out.setdefault(c["index"], []).extend((c.get("logprobs") or {}).get("tokens") or [])
        return out

    assert text(got) == text(want) and text(got)
    assert finishes(got) == finishes(want)
    assert usage(got) == usage(want) and usage(got)
    assert logprob_tokens(got) == logprob_tokens(want)


def test_embeddings_match_local(remote: str, local: str) -> None:
    body = {"input": ["a short one", "a somewhat longer sentence about embeddings " * 3], "dimensions": 128}
    got, want = _post(remote, "/v1/embeddings", body), _post(local, "/v1/embeddings", body)
    assert got.status_code == want.status_code == 200, got.text
    g = np.array([d["embedding"] for d in got.json()["data"]])
    w = np.array([d["embedding"] for d in want.json()["data"]])
    np.testing.assert_allclose(g, w, atol=1e-6)
    assert got.json()["usage"] == want.json()["usage"]


def test_errors_come_back_as_openai_errors(remote: str) -> None:
    too_long = _post(remote, "/v1/completions", {"model": LLM, "prompt": "hi", "max_tokens": 1000})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    unknown = _post(remote, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert unknown.status_code == 404


def test_same_prefix_goes_to_the_same_worker(remote: str) -> None:
    """Requests sharing their first KV blocks land on one worker (whose prefix cache then hits)."""
    shared = " ".join(f"word{i}" for i in range(40))  # well over 2 blocks of 16 tokens
    time.sleep(1.5)  # let the heartbeats catch up with earlier tests' requests first
    before = _heartbeats()
    for i in range(4):
        r = _post(remote, "/v1/completions", {"model": LLM, "prompt": f"{shared} tail {i}", "max_tokens": 2})
        assert r.status_code == 200, r.text
    time.sleep(1.5)  # three heartbeats
    after = _heartbeats()

    def grew(stat: str) -> dict[str, float]:
        return {
            wid: after[wid]["stats"][LLM][stat] - before[wid]["stats"][LLM][stat]
            for wid in after
            if LLM in after[wid]["models"]
        }

    served = {wid for wid, d in grew("prompt_tokens_total").items() if d > 0}
    assert len(served) == 1, grew("prompt_tokens_total")
    assert grew("prefix_cache_hits")[served.pop()] >= 3 * 32


def test_client_disconnect_aborts_on_the_worker(remote: str) -> None:
    body = {"model": LLM, "prompt": "count:", "max_tokens": 200, "temperature": 1.0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{remote}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # streaming has begun; leave now
    deadline = time.monotonic() + 10
    while True:
        beats = _heartbeats()
        running = sum(b["stats"][LLM]["num_running"] for b in beats.values() if LLM in b["models"])
        inflight = sum(b["inflight"] for b in beats.values() if LLM in b["models"])
        if running == 0 and inflight == 0:
            break
        assert time.monotonic() < deadline, beats
        time.sleep(0.2)
    time.sleep(0.5)
    # The gateway deleted the reply stream when the client left; entries the worker added before
    # the abort landed must not have re-created it without a TTL.
    client = redis.Redis.from_url(REDIS_URL)
    streams = list(client.scan_iter(match=f"{PREFIX}:s:*"))
    assert all(client.ttl(key) != -1 for key in streams), [(k, client.ttl(k)) for k in streams]


def test_sigterm_drains_a_worker(remote: str, workers: list[WorkerProc]) -> None:
    """A worker told to stop finishes its running stream, takes nothing new, then leaves; requests
    that would have gone to it are served by the other worker."""
    from workers.routing import affinity_worker, prefix_key

    victim, other = workers[0], workers[1]
    ids = next(
        ids
        for i in range(100)
        if affinity_worker(prefix_key(ids := [100 + i * 7 + j for j in range(40)]), [victim.worker_id, other.worker_id])
        == victim.worker_id
    )
    body = {"model": LLM, "prompt": ids, "max_tokens": 150, "ignore_eos": True, "temperature": 0, "stream": True}
    chunks, finish = 0, None
    with httpx.stream("POST", f"{remote}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            chunks += 1
            if chunks == 1:
                victim.kill(signal.SIGTERM)  # warm shutdown: returns at once
            finish = event["choices"][0].get("finish_reason") or finish
    assert finish == "length"
    victim.proc.wait(30)
    deadline = time.monotonic() + 10
    while (ready := httpx.get(f"{remote}/ready").json())["workers"][LLM] != [other.worker_id]:
        assert time.monotonic() < deadline, ready
        time.sleep(0.2)
    again = _post(remote, "/v1/completions", {**body, "stream": False, "max_tokens": 4})
    assert again.status_code == 200, again.text
