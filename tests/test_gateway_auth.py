"""Tenants, API keys and per-tenant rate limits over real HTTP: a uvicorn server with the tiny
Llama and MiniLM engines, a keys file with three tenants, raw ``httpx`` and the ``openai`` client;
plus the ``mmserve keys`` commands and the keys-file formats."""

from __future__ import annotations

import io
import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import APIRouter, Request, WebSocket
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from gateway.auth import KeyStore, hash_key
from gateway.ratelimit import MemoryRateLimiter
from tests.gateway_helpers import BUSY, EMBED, LLM, embed_engine, llm_engines, routers, serve

KEYS = {"alpha": "key-alpha", "beta": "key-beta", "gamma": "key-gamma"}
PROMPT = "Hello there"


def _keys_file(tmp: Path) -> Path:
    data = {
        "default_limits": {"embed_inputs": 1000},
        "tenants": {
            "alpha": {"keys": [hash_key(KEYS["alpha"])], "limits": {"llm_tokens": 300, "embed_inputs": 3}},
            "beta": {"keys": [hash_key(KEYS["beta"])]},  # default limits only: LLM unlimited
            "gamma": {"keys": [hash_key(KEYS["gamma"])], "limits": {"llm_tokens": 60}},
        },
    }
    path = tmp / "keys.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from gateway.app import create_app

    store = KeyStore.from_file(_keys_file(tmp_path_factory.mktemp("keys")))
    engines = {**llm_engines(max_model_len=256), EMBED: embed_engine()}
    extra = APIRouter()

    @extra.get("/v1/whoami")  # routes under test only: show request.state.tenant
    async def whoami(request: Request) -> dict[str, Any]:
        return {"tenant": request.state.tenant.name}

    @extra.websocket("/v1/whoami/ws")
    async def whoami_ws(websocket: WebSocket) -> None:
        offered = websocket.scope.get("subprotocols", [])
        await websocket.accept(subprotocol="realtime" if "realtime" in offered else None)
        await websocket.send_text(websocket.state.tenant.name)
        await websocket.close()

    app = create_app(engines, routers=[*routers(), extra], keys=store, ratelimiter=MemoryRateLimiter())
    with serve(app) as (url, _):
        yield url


def _http(base_url: str, tenant: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=60)


def _error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


def _complete(c: httpx.Client, max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"model": LLM, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
    return c.post("/v1/completions", json=body)


def test_missing_or_wrong_key_is_401(base_url: str) -> None:
    with _http(base_url, None) as c:
        assert c.get("/health").status_code == 200  # liveness and readiness stay open
        err = _error(c.get("/v1/models"), 401, "invalid_api_key")
        assert "didn't provide an API key" in err["message"]
        resp = c.post("/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer key-alph"})
        _error(resp, 401, "invalid_api_key")
        assert resp.headers["www-authenticate"] == "Bearer"
        _error(c.get("/v1/models", headers={"Authorization": f"Basic {KEYS['alpha']}"}), 401)
    for tenant in KEYS:  # every tenant's own key works, and the route sees who it is
        with _http(base_url, tenant) as c:
            assert c.get("/v1/whoami").json() == {"tenant": tenant}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="nope", max_retries=0).models.list()
    # WebSockets: the header, or the subprotocol browsers use (they cannot set headers)
    ws_url = base_url.replace("http", "ws") + "/v1/whoami/ws"
    with ws_connect(ws_url, additional_headers={"Authorization": f"Bearer {KEYS['beta']}"}) as ws:
        assert ws.recv() == "beta"
    with ws_connect(ws_url, subprotocols=["realtime", f"openai-insecure-api-key.{KEYS['gamma']}"]) as ws:
        assert ws.recv() == "gamma"
    for bad in ({}, {"subprotocols": ["realtime", "openai-insecure-api-key.nope"]}):
        with pytest.raises(InvalidStatus) as info:
            ws_connect(ws_url, **bad)
        assert info.value.response.status_code == 401


@pytest.mark.parametrize(
    ("offered", "answer"),
    [
        ([], None),
        (["realtime", "openai-insecure-api-key.k"], "realtime"),
        (["openai-insecure-api-key.k", "openai-beta.realtime-v1"], "openai-beta.realtime-v1"),
        (["openai-insecure-api-key.k"], "openai-insecure-api-key.k"),  # (a browser needs one named back)
        (["", " ", "openai-insecure-api-key.k"], "openai-insecure-api-key.k"),
    ],
)
def test_a_websocket_is_answered_with_one_of_its_offered_subprotocols(offered: list[str], answer: str | None) -> None:
    from types import SimpleNamespace

    from gateway.auth import ws_subprotocol

    assert ws_subprotocol(SimpleNamespace(scope={"subprotocols": offered}), "realtime") == answer  # type: ignore[arg-type]


def test_a_request_without_a_key_is_refused_before_its_body_is_read(base_url: str) -> None:
    """The 401 comes first: before a body's own 400 (a lone surrogate, bad gzip) or 415 (an
    unknown encoding), and without waiting for a body that has not arrived."""
    bodies = [
        ({"content-type": "application/json"}, b'{"model": "m", "input": "\\ud800"}', 400),
        ({"content-type": "application/json", "content-encoding": "gzip"}, b"not gzip", 400),
        ({"content-type": "application/json", "content-encoding": "br"}, b"{}", 415),
    ]
    for tenant in (None, "beta"):
        with _http(base_url, tenant) as c:
            for headers, body, status in bodies:
                resp = c.post("/v1/embeddings", content=body, headers=headers)
                assert resp.status_code == (401 if tenant is None else status), resp.text
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:  # 1 MB declared, 10 bytes sent
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        sock.sendall(b'Content-Length: 1048576\r\n\r\n{"input": ')
        assert sock.recv(4096).startswith(b"HTTP/1.1 401 ")
    # the refusals are counted under their route, as a routed response is, not under "other"
    metrics = httpx.get(f"{base_url}/metrics").text
    refused = [line for line in metrics.splitlines() if line.startswith("mmserve_http_requests_total{")]
    assert any('path="/v1/embeddings"' in line and 'status="401"' in line for line in refused), refused
    assert any('modality="embed"' in line and 'status="415"' in line for line in refused), refused
    assert not any('path="other"' in line and 'status="401"' in line for line in refused), refused


def test_llm_limit_settles_to_real_usage_and_throttles_one_tenant(base_url: str) -> None:
    with _http(base_url, "alpha") as c:
        first = _complete(c, 1)  # the greedy first token: used as a stop string below
        assert first.status_code == 200, first.text
        stop = first.json()["choices"][0]["text"]
        assert stop.strip()
        # charged prompt + 200 at admission, settled to prompt + 1 when it stops after one token
        resp = _complete(c, 200, stop=[stop])
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 1
        # refused by the engine's full queue: the whole charge comes back
        _error(c.post("/v1/completions", json={"model": BUSY, "prompt": PROMPT, "max_tokens": 200}), 429)
        # so there is room for prompt + 200 again (without settling there would be ~90 left)
        resp = _complete(c, 200, stop=[stop])
        assert resp.status_code == 200, resp.text
        # more than a whole minute's budget can never pass
        _error(_complete(c, 150, n=2), 429, "request_too_large")
    with _http(base_url, "gamma") as c:  # 60 tokens/min: one 40-token request, then throttled
        assert _complete(c, 36, ignore_eos=True).status_code == 200
        resp = _complete(c, 36, ignore_eos=True)
        err = _error(resp, 429, "rate_limit_exceeded")
        assert err["type"] == "rate_limit_error" and "gamma" in err["message"]
        assert 1 <= int(resp.headers["retry-after"]) <= 60
        stream = c.post("/v1/chat/completions", json={"model": LLM, "messages": [{"role": "user", "content": "x"}]})
        _error(stream, 429)  # chat without max_tokens is charged the rest of the context
    with _http(base_url, "beta") as c:  # another tenant is not affected
        for _ in range(3):
            assert _complete(c, 36, ignore_eos=True).status_code == 200
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEYS["gamma"], max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=LLM, prompt=PROMPT, max_tokens=36)


def test_embedding_inputs_limit(base_url: str) -> None:
    with _http(base_url, "alpha") as c:  # 3 inputs per minute
        assert c.post("/v1/embeddings", json={"input": ["a", "b"]}).status_code == 200
        resp = c.post("/v1/embeddings", json={"input": ["c", "d"]})
        _error(resp, 429, "rate_limit_exceeded")
        assert int(resp.headers["retry-after"]) >= 1
        _error(c.post("/v1/embeddings", json={"input": ["x"] * 4}), 429, "request_too_large")
        # an input refused as too long is refunded: one input still fits
        too_long = c.post("/v1/embeddings", json={"input": "word " * 600})
        _error(too_long, 400, "context_length_exceeded")
        assert c.post("/v1/embeddings", json={"input": "e"}).status_code == 200
    with _http(base_url, "beta") as c:
        assert c.post("/v1/embeddings", json={"input": ["a", "b", "c", "d"]}).status_code == 200


def test_keys_file_formats_and_errors(tmp_path: Path) -> None:
    toml = tmp_path / "keys.toml"
    toml.write_text(
        f'[default_limits]\nllm_tokens = 1000\n\n[tenants.acme]\nkeys = ["{hash_key("k1")}"]\n\n'
        "[tenants.acme.limits]\nimage_steps = 50\n"
    )
    store = KeyStore.from_file(toml, {"audio_seconds": 60.0})
    acme = store.authenticate("k1")
    assert acme is not None and acme.name == "acme"
    assert acme.limits == {"llm_tokens": 1000, "audio_seconds": 60, "image_steps": 50}
    assert store.authenticate("k2") is None and store.authenticate("") is None
    bad = tmp_path / "bad.json"
    for data, message in (
        ({"tenants": {"x": {"keys": ["plaintext"]}}}, "sha256"),
        ({"tenants": {"x": {"keys": [], "limits": {"tokens": 5}}}}, "unknown limit unit"),
        ({"tenants": {"x": {"keys": [], "limits": {"llm_tokens": -1}}}}, "positive"),
    ):
        bad.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            KeyStore.from_file(bad)


def test_keys_cli_add_and_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.cli import main

    path = tmp_path / "keys.json"
    assert main(["keys", "add", "--keys-file", str(path), "--tenant", "acme", "--limit", "llm_tokens=500"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("mms-") and key not in path.read_text()  # only the hash is stored
    assert (path.stat().st_mode & 0o777) == 0o600
    monkeypatch.setattr(sys, "stdin", io.StringIO(key + "\n"))  # not on the command line: no shell history
    assert main(["keys", "hash"]) == 0
    assert capsys.readouterr().out.strip() == hash_key(key) and hash_key(key) in path.read_text()
    store = KeyStore.from_file(path)
    tenant = store.authenticate(key)
    assert tenant is not None and tenant.name == "acme" and tenant.limits == {"llm_tokens": 500}
    with pytest.raises(SystemExit):
        main(["keys", "add", "--keys-file", str(path), "--tenant", "b", "--limit", "x=1"])
    assert "unknown limit unit" in capsys.readouterr().err
