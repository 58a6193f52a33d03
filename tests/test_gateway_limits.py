"""Oversized request bodies get a 413 in OpenAI's error shape over real HTTP, declared or chunked."""

from __future__ import annotations

import gzip
import json
import zlib

import httpx

from gateway.app import create_app
from tests.helpers import serve_app


def test_body_size_limit() -> None:
    app = create_app({}, max_body_bytes=1000)
    with serve_app(app) as base_url:
        url = f"{base_url}/v1/completions"
        big = {"model": "m", "prompt": "x" * 2000}
        resp = httpx.post(url, json=big)
        assert resp.status_code == 413
        err = resp.json()["error"]
        assert "1000 bytes" in err["message"] and err["type"] == "invalid_request_error"

        def chunks():  # no Content-Length: the limit must hold while streaming the body
            for _ in range(5):
                yield b" " * 400

        resp = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"})
        assert resp.status_code == 413
        # A small body goes through to the route (no such model: 404, not 413).
        resp = httpx.post(url, json={"model": "m", "prompt": "hi"})
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "model_not_found"


def test_gzip_and_deflate_bodies_are_decompressed_within_the_limit() -> None:
    app = create_app({}, max_body_bytes=1000, body_limits={"POST /upload": 10_000})
    with serve_app(app) as base_url:
        url = f"{base_url}/v1/completions"
        body = json.dumps({"model": "zipped-model", "prompt": "hi"}).encode()
        for encoding, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
            resp = httpx.post(
                url, content=data, headers={"Content-Type": "application/json", "Content-Encoding": encoding}
            )
            assert resp.status_code == 404 and "zipped-model" in resp.json()["error"]["message"]  # parsed
        bomb = gzip.compress(json.dumps({"model": "m", "prompt": "x" * 100_000}).encode())
        assert len(bomb) < 1000
        resp = httpx.post(url, content=bomb, headers={"Content-Encoding": "gzip"})
        assert resp.status_code == 413 and "once decompressed" in resp.json()["error"]["message"]
        for data, why in ((b"not gzip at all", "not valid gzip"), (gzip.compress(body)[:-12], "truncated")):
            resp = httpx.post(url, content=data, headers={"Content-Encoding": "gzip"})
            assert resp.status_code == 400 and why in resp.json()["error"]["message"]
        resp = httpx.post(url, content=body, headers={"Content-Encoding": "br"})
        assert resp.status_code == 415 and "'br'" in resp.json()["error"]["message"]
        # a streamed route's body is not held, so it can't be decompressed here
        resp = httpx.post(f"{base_url}/upload", content=gzip.compress(body), headers={"Content-Encoding": "gzip"})
        assert resp.status_code == 415
