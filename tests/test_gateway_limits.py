"""Oversized request bodies get a 413 in OpenAI's error shape over real HTTP, declared or chunked."""

from __future__ import annotations

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
