"""The OpenAPI spec is true (every route of the full app, every plugin mounted, is in
``/openapi.json`` with its methods, and nothing else is), bad content types and bodies get
OpenAI-shaped 400/415s (never FastAPI's 422), and a hypothesis run of generated bodies against
the real uvicorn server (tiny Llama + MiniLM) never gets a 5xx or a non-OpenAI error."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway_helpers import EMBED, LLM, embed_engine, llm_engines, serve

# Routes whose side effects outlive a request (stored jobs and files) are fuzzed by their owners.
FUZZ_SKIP = {"/v1/jobs", "/v1/batches"}
ALLOWED = {200, 400, 401, 404, 413, 415, 429}


def _route_methods(app: Any) -> set[tuple[str, str]]:
    """(path template, METHOD) of every HTTP route, through included routers."""
    from fastapi import routing

    docs = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
    contexts: Any = getattr(routing, "iter_route_contexts", None)
    routes = [c.original_route for c in contexts(app.routes)] if contexts else list(app.routes)
    out = set()
    for route in routes:
        path = getattr(route, "path", None)
        methods = getattr(route, "methods", None)
        if path in docs or not methods or not getattr(route, "include_in_schema", True):
            continue
        for method in methods - {"HEAD", "OPTIONS"}:
            out.add((re.sub(r"\{(\w+):\w+\}", r"{\1}", path), method))
    return out


@pytest.fixture(scope="module")
def app() -> Any:
    from gateway.app import create_app

    return create_app({**llm_engines(max_model_len=64), EMBED: embed_engine()})  # every plugin's router


@pytest.fixture(scope="module")
def base_url(app: Any) -> Iterator[str]:
    with serve(app) as (url, _):
        yield url


def test_openapi_lists_every_route(app: Any, base_url: str) -> None:
    spec = httpx.get(f"{base_url}/openapi.json").json()
    listed = {(path, method.upper()) for path, ops in spec["paths"].items() for method in ops}
    routes = _route_methods(app)
    assert {("/v1/chat/completions", "POST"), ("/v1/embeddings", "POST"), ("/metrics", "GET")} <= routes
    assert routes == listed
    for path, ops in spec["paths"].items():  # JSON bodies are described by a schema
        for op in ops.values():
            content = (op.get("requestBody") or {}).get("content", {})
            assert all("schema" in media for media in content.values()), path


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_content_types_and_validation_errors(base_url: str) -> None:
    url = f"{base_url}/v1/embeddings"
    _error(httpx.post(url, files={"input": ("a.txt", b"hello")}), 415)
    _error(httpx.post(url, content=b"input=hello", headers={"Content-Type": "text/plain"}), 415)
    err = _error(httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    assert "not valid JSON" in err["message"]
    err = _error(httpx.post(url, json={"model": EMBED, "input": "x", "dimensions": "many"}), 400)
    assert err["param"] == "dimensions"
    err = _error(httpx.post(f"{base_url}/v1/chat/completions", json={"model": LLM}), 400)
    assert err["param"] == "messages" and "Missing required parameter" in err["message"]
    # content: null only in an assistant's message with calls (OpenAI's history shape), rendered as ""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    chat = f"{base_url}/v1/chat/completions"
    assert httpx.post(chat, json={"model": LLM, "messages": history, "max_tokens": 1}).status_code == 200
    for bad in ({"role": "user"}, {"role": "user", "content": None}, {"role": "assistant", "content": None}):
        err = _error(httpx.post(chat, json={"model": LLM, "messages": [bad], "max_tokens": 1}), 400)
        assert err["param"] == "messages[0]" and "needs 'content'" in err["message"], err
    for part in ({"type": "text"}, {"type": "text", "text": None}):
        body = {"model": LLM, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
        assert _error(httpx.post(chat, json=body), 400)["param"] == "messages[0].content"
    _error(httpx.post(f"{base_url}/v1/completions", json=[1, 2]), 400)
    _error(httpx.get(f"{base_url}/v1/completions"), 405)
    # context caps are checked before any work: prompt + max_tokens over the 64-token window
    body = {"model": LLM, "prompt": "hi", "max_tokens": 64}
    assert _error(httpx.post(f"{base_url}/v1/completions", json=body), 400)["code"] == "context_length_exceeded"


def _json_routes(spec: dict[str, Any]) -> dict[str, list[str]]:
    """POST routes with a JSON body -> the property names of their body schema."""
    schemas = spec.get("components", {}).get("schemas", {})
    out: dict[str, list[str]] = {}
    for path, ops in spec["paths"].items():
        body = (ops.get("post", {}).get("requestBody") or {}).get("content", {}).get("application/json")
        if body is None or path in FUZZ_SKIP:
            continue
        schema = body["schema"]
        if "$ref" in schema:
            schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
        out[path] = sorted(schema.get("properties", {}))
    return out


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False)  # torch may set flush-to-zero
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
SMALL = st.integers(min_value=-2, max_value=70) | st.sampled_from([0.5, -1.5, "3", 10**9])


def test_generated_bodies_never_fail_the_server(base_url: str) -> None:
    spec = httpx.get(f"{base_url}/openapi.json").json()
    routes = _json_routes(spec)
    assert "/v1/chat/completions" in routes and "/v1/embeddings" in routes

    def field_values(name: str) -> st.SearchStrategy[Any]:
        if name == "model":
            return st.sampled_from([LLM, EMBED, "nope"]) | JSON
        if name == "messages":
            message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]), "content": JSON})
            return st.lists(message, max_size=3) | JSON
        if name in ("max_tokens", "n", "dimensions", "top_k", "logprobs", "top_logprobs", "steps", "seed"):
            return SMALL | JSON
        return JSON

    bodies = st.sampled_from(sorted(routes)).flatmap(
        lambda path: st.tuples(
            st.just(path),
            st.fixed_dictionaries({}, optional={name: field_values(name) for name in routes[path]}) | JSON,
        )
    )

    with httpx.Client(base_url=base_url, timeout=60) as client:

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(bodies)
        def check(case: tuple[str, Any]) -> None:
            path, body = case
            resp = client.post(path, json=body)
            assert resp.status_code in ALLOWED, (path, body, resp.status_code, resp.text)
            if resp.status_code >= 400:
                err = resp.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, (path, body, resp.text)

        check()
