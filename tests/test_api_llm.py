"""End-to-end tests of the OpenAI-compatible LLM routes: a real uvicorn server on a loopback
port, the real ``AsyncEngine`` on a tiny random Llama, the official ``openai`` client (streaming
included) and raw ``httpx`` for error shapes and disconnects."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model
from gateway.app import create_app
from tests.helpers import serve_app

API_KEY = "test-key"
MODEL = "tiny"
BUSY = "tiny-busy"
MAX_MODEL_LEN = 256


def _tiny_llama_dir() -> Path:
    from engine.tiny_models import tiny_model_dir

    return tiny_model_dir("llama")


class Server:
    def __init__(self, base_url: str, engines: dict[str, AsyncEngine]) -> None:
        self.base_url = base_url
        self.engines = engines

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60, **kw)

    def http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60, **kw)

    @property
    def tokenizer(self) -> Any:
        return self.engines[MODEL].tokenizer

    def active(self) -> int:
        stats = self.engines[MODEL].stats()
        return int(stats["num_running"] + stats["num_waiting"])

    def wait_idle(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.active() == 0:
                return True
            time.sleep(0.05)
        return False


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    loaded = load_model(str(_tiny_llama_dir()), max_model_len=MAX_MODEL_LEN)
    common = dict(model=str(loaded.path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=96, max_num_seqs=8)
    engines = {
        MODEL: AsyncEngine(LLMEngine(EngineConfig(**common), loaded=loaded)),
        BUSY: AsyncEngine(LLMEngine(EngineConfig(**common, max_waiting=0), loaded=loaded)),  # always full: 429
    }
    app = create_app(engines, api_key=API_KEY)
    with serve_app(app) as base_url:
        yield Server(base_url, engines)


def _assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


# -- basics ------------------------------------------------------------------------------------


def test_health_ready_models_metrics(server: Server) -> None:
    with httpx.Client(base_url=server.base_url) as c:  # no key: these are open
        assert c.get("/health").status_code == 200
        assert c.get("/ready").status_code == 200
        assert c.get("/metrics").status_code == 200
    models = server.client().models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL, BUSY]
    with server.http() as c:
        card = c.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == MAX_MODEL_LEN and card["object"] == "model"
        _assert_openai_error(c.get("/v1/models/nope"), 404, "model_not_found")


def test_chat_stream_matches_non_stream(server: Server) -> None:
    client = server.client()
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    prompt_ids = server.tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert 1 <= full.usage.completion_tokens <= 8

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id for c in chunks)
    content_chunks = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == choice.message.content
    assert content_chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_completions_string_and_token_prompts(server: Server) -> None:
    client = server.client()
    prompt = "The quick brown fox"
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert a.id.startswith("cmpl-") and a.object == "text_completion"
    ids = server.tokenizer.encode(prompt)
    assert a.usage.prompt_tokens == len(ids)
    b = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert b.choices[0].text == a.choices[0].text
    # several prompts (strings and token-id lists) -> merged choices, index = prompt_idx * n + i
    c = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=4, temperature=0, n=2)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    assert c.choices[0].text == c.choices[1].text == a.choices[0].text[: len(c.choices[0].text)]
    assert c.usage.prompt_tokens == len(ids) + 2
    # streaming: concatenated deltas equal the non-streamed text; usage chunk last
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == a.choices[0].text
    assert chunks[-1].usage.completion_tokens == a.usage.completion_tokens
    # echo prepends the prompt
    e = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text.startswith(prompt)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server: Server) -> None:
    client, prompt = server.client(), "The quick brown fox"
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=6, temperature=0, stream=True, stream_options=options)
    chunks = list(client.completions.create(prompt=prompt, extra_body={"ignore_eos": True}, **kw))
    chat = list(client.chat.completions.create(messages=CHAT, **kw))
    num_chat_prompt = len(server.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False))
    for stream, num_prompt in ((chunks, len(server.tokenizer.encode(prompt))), (chat, num_chat_prompt)):
        usages = [c.usage for c in stream]
        assert all(u is not None and u.prompt_tokens == num_prompt for u in usages)
        done = [u.completion_tokens for u in usages]
        assert done == sorted(done) and done[-1] >= 1 and usages[-1].total_tokens == num_prompt + done[-1]
        assert len(set(done)) > 2  # it grows chunk by chunk, not only in the last
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    # without it, only the last chunk has usage
    plain = list(client.completions.create(prompt=prompt, **{**kw, "stream_options": {"include_usage": True}}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_n_and_seed_reproducible(server: Server) -> None:
    client = server.client()
    kw: dict[str, Any] = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2, seed=1234)
    r1 = client.completions.create(**kw)
    r2 = client.completions.create(**kw)
    assert [c.index for c in r1.choices] == [0, 1]
    assert [c.text for c in r1.choices] == [c.text for c in r2.choices]
    r3 = client.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in r3.choices] != [c.text for c in r1.choices]
    # chat streaming with n=2: every choice gets a role delta, deltas and a finish_reason
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2, seed=7, stream=True))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    roles = {c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"}
    assert set(finishes) == roles == {0, 1}


def test_stop_strings(server: Server) -> None:
    client = server.client()
    kw: dict[str, Any] = dict(
        model=MODEL, prompt="Hello world", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = client.completions.create(**kw).choices[0].text
    stop = text[4:7]
    assert len(stop.strip()) > 0, text
    expected = text[: text.find(stop)]
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.text == expected and cut.finish_reason == "stop"
    kept = client.completions.create(
        **{**kw, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}, stop=stop
    )
    assert kept.choices[0].text == expected + stop
    streamed = client.completions.create(**kw, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_logprobs_shapes(server: Server) -> None:
    client = server.client()
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(v <= 0 for v in lp.token_logprobs)
    for tok, top, v in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
        assert 2 <= len(top) <= 3 and top[tok] == pytest.approx(v)
        assert max(top.values()) == pytest.approx(v, abs=1e-4)  # greedy picks the top token
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert isinstance(item.token, str) and item.logprob <= 0 and item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices[0].logprobs is None
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=1, stream=True
    )
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_concurrent_requests_match_sequential(server: Server) -> None:
    client = server.client()
    prompts = [f"Story number {i}:" for i in range(4)]

    def run(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text

    sequential = [run(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(run, prompts))
    assert concurrent == sequential


# -- errors --------------------------------------------------------------------------------------


def test_auth(server: Server) -> None:
    with httpx.Client(base_url=server.base_url) as c:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        _assert_openai_error(c.post("/v1/completions", json=body), 401, "invalid_api_key")
        bad = {"Authorization": "Bearer wrong"}
        _assert_openai_error(c.post("/v1/completions", json=body, headers=bad), 401, "invalid_api_key")
        _assert_openai_error(c.get("/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0).models.list()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"\u0663": 1}}, "logit_bias"),  # an Arabic-Indic 3
        (
            {
                "prompt": "x",
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}},
            },
            "response_format",
        ),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "priority": -1}, "priority"),
        # Each of these three killed the engine loop for every later request (a logits index
        # out of range, a seed torch's generator can't take).
        ({"prompt": "x", "logit_bias": {"1000000": 5}}, "logit_bias"),
        ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"prompt": "x", "seed": 2**64, "temperature": 1}, "seed"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),  # no boolean is a number
        ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ],
)
def test_completion_validation_errors(server: Server, body: dict[str, Any], param: str) -> None:
    with server.http() as c:
        err = _assert_openai_error(c.post("/v1/completions", json={"model": MODEL, **body}), 400)
        assert err["param"] == param and err["type"] == "invalid_request_error"


def test_a_prompt_too_long_by_its_length_alone_is_refused_before_tokenizing(server: Server) -> None:
    """Characters enough for more tokens than the context: a 400 from the length alone (the
    message gives the bound), for a text prompt and for chat messages, and the server serves on."""
    huge = "hello world, " * 40_000  # 520k characters: at least ~3.2k tokens, the context is 256
    with server.http() as c:
        for path, body, param in (
            ("/v1/completions", {"prompt": huge}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
        ):
            err = _assert_openai_error(c.post(path, json={"model": MODEL, **body}), 400, "context_length_exceeded")
            assert err["param"] == param and "characters, at least" in err["message"], err
        # Shorter, but still too long once tokenized: the engine's own count, as before.
        err = _assert_openai_error(
            c.post("/v1/completions", json={"model": MODEL, "prompt": "hello " * 300}), 400, "context_length_exceeded"
        )
        assert "characters" not in err["message"]
        ok = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_other_client_errors(server: Server) -> None:
    with server.http() as c:
        chat = {"model": MODEL, "messages": CHAT}
        _assert_openai_error(c.post("/v1/chat/completions", json={**chat, "model": "nope"}), 404, "model_not_found")
        _assert_openai_error(c.post("/v1/chat/completions", json={**chat, "messages": []}), 400)
        _assert_openai_error(c.post("/v1/chat/completions", json={**chat, "top_logprobs": 2}), 400)
        img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
        _assert_openai_error(c.post("/v1/chat/completions", json={**chat, "messages": img}), 400)
        _assert_openai_error(
            c.post("/v1/chat/completions", json={**chat, "max_tokens": 1000}), 400, "context_length_exceeded"
        )
        err = _assert_openai_error(
            c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 300}), 400
        )
        assert str(MAX_MODEL_LEN) in err["message"] and "300" in err["message"]
        _assert_openai_error(
            c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400
        )
        _assert_openai_error(
            c.post("/v1/completions", content=b"[1]", headers={"content-type": "application/json"}), 400
        )
        _assert_openai_error(
            c.post("/v1/completions", content=b"prompt=x", headers={"content-type": "text/plain"}), 415
        )
        _assert_openai_error(c.get("/v1/nothing"), 404)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=CHAT)


def test_the_engine_outlives_edge_parameters(server: Server) -> None:
    """A seed plus its choice index past 2**64 wraps (torch takes no more); the template's own
    parameters are not the client's to set (a template of its own is unbounded Jinja)."""
    with server.http() as c:
        body = {"model": MODEL, "prompt": "x", "seed": 2**64 - 1, "n": 2, "temperature": 1, "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 200
        for kwargs in ({"chat_template": "{% for i in range(10**9) %}{% endfor %}"}, {"padding": "max_length"}):
            body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "chat_template_kwargs": kwargs}
            err = _assert_openai_error(c.post("/v1/chat/completions", json=body), 400, "invalid_value")
            assert err["param"] == f"chat_template_kwargs.{next(iter(kwargs))}"
        raw = b'{"model": "tiny", "prompt": "x", "repetition_penalty": 1e999}'  # inf: Python's json takes it
        resp = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert _assert_openai_error(resp, 400)["param"] == "repetition_penalty"
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_dead_engine_fails_health_and_ready() -> None:
    """An engine loop that stopped fails every request until a restart: liveness says so."""
    loaded = load_model(str(_tiny_llama_dir()), max_model_len=MAX_MODEL_LEN)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(loaded.path), max_model_len=MAX_MODEL_LEN), loaded=loaded))
    with serve_app(create_app({MODEL: engine})) as url, httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/health").status_code == 200

        def crash() -> None:
            raise RuntimeError("injected step failure")

        engine.engine.step = crash  # type: ignore[method-assign]
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code >= 500
        health = c.get("/health")
        assert health.status_code == 503 and "injected" in health.json()["dead"][MODEL]
        assert c.get("/ready").status_code == 503


def test_a_failed_step_is_a_500_for_its_request_and_the_server_serves_on() -> None:
    """A step that raises (a bug, not the input) fails the requests it held with OpenAI error
    JSON, in-band once a stream has begun; the engine, /health and later requests are fine."""
    loaded = load_model(str(_tiny_llama_dir()), max_model_len=MAX_MODEL_LEN)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(loaded.path), max_model_len=MAX_MODEL_LEN), loaded=loaded))
    real, fail = engine.engine.runner.execute, threading.Event()

    def execute(sched):  # type: ignore[no-untyped-def]
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected step failure")
        return real(sched)

    engine.engine.runner.execute = execute  # type: ignore[method-assign]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    with serve_app(create_app({MODEL: engine})) as url, httpx.Client(base_url=url, timeout=60) as c:
        fail.set()
        err = _assert_openai_error(c.post("/v1/completions", json=body), 500, "engine_error")
        assert err["type"] == "internal_server_error" and "RuntimeError" in err["message"]
        streamed = {**body, "stream": True, "max_tokens": 200, "ignore_eos": True}
        with c.stream("POST", "/v1/completions", json=streamed) as resp:
            lines = (json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {"))
            assert resp.status_code == 200 and "text" in next(lines)["choices"][0]
            fail.set()  # mid-stream: the error comes in-band
            events = list(lines)
        assert events[-1]["error"]["code"] == "engine_error" and not fail.is_set()
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 2


def test_queue_full_is_429(server: Server) -> None:
    with server.http() as c:
        resp = c.post("/v1/completions", json={"model": BUSY, "prompt": "x", "max_tokens": 2})
        _assert_openai_error(resp, 429, "rate_limit_exceeded")
        assert int(resp.headers["retry-after"]) >= 1
        resp = c.post("/v1/chat/completions", json={"model": BUSY, "messages": CHAT, "stream": True})
        _assert_openai_error(resp, 429)  # admission errors come before the stream starts
    with pytest.raises(openai.RateLimitError):
        server.client().completions.create(model=BUSY, prompt="x", max_tokens=2)


def test_more_prompts_than_the_queue_holds_is_400_before_any_work(server: Server) -> None:
    """A request of more prompts than the waiting queue's bound could never be queued whole: a 400
    naming ``prompt`` (not a 429 to retry), before any prompt reaches the engine."""
    engine = server.engines[MODEL].engine
    limit, before = engine.config.max_waiting, engine.num_prompt_tokens
    with server.http() as c:
        body = {"model": MODEL, "prompt": [[5, 6]] * (limit + 1), "max_tokens": 2}
        err = _assert_openai_error(c.post("/v1/completions", json=body), 400)
        assert err["param"] == "prompt" and f"at most {limit}" in err["message"], err
    assert engine.num_prompt_tokens == before


# -- disconnects -----------------------------------------------------------------------------------


def _disconnected(server: Server) -> float:
    with server.http() as c:
        text = c.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("mmserve_requests_total{") and 'status="disconnected"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_stream_disconnect_aborts(server: Server) -> None:
    assert server.wait_idle()
    before = _disconnected(server)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with server.http() as c, c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        assert server.active() == 1
    # the client is gone: the engine request is aborted well before 200 tokens
    assert server.wait_idle(timeout=5), server.engines[MODEL].stats()
    deadline = time.monotonic() + 5
    while _disconnected(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _disconnected(server) == before + 1


def test_non_stream_disconnect_aborts(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that leaves a non-streamed request aborts its engine work. The engine is held
    before its second step until the server has seen the disconnect, so the request cannot
    finish first however fast the machine is; once released, it must stop instead of going on."""
    assert server.wait_idle()
    before = _disconnected(server)
    llm = server.engines[MODEL].engine
    real_step, release, steps = llm.step, threading.Event(), [0]

    def held_step() -> list[Any]:
        steps[0] += 1
        if steps[0] > 1:  # the first step (prefill + first token) went out: the request is running
            release.wait(30)
        return real_step()

    monkeypatch.setattr(llm, "step", held_step)
    tokens_before = llm.stats()["generation_tokens_total"]
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 250, "ignore_eos": True}
    try:
        with server.http() as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
        # the server notices (it polls) and closes the engine stream, queueing the abort
        deadline = time.monotonic() + 10
        while _disconnected(server) < before + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _disconnected(server) == before + 1
        assert server.active() == 1  # still in the engine, held mid-generation
    finally:
        release.set()
    assert server.wait_idle(timeout=5), llm.stats()
    # the abort is applied right after the held step: only the tokens of the two steps were made
    assert llm.stats()["generation_tokens_total"] - tokens_before <= 2


def test_server_timing_header(server: Server) -> None:
    with server.http() as c:
        for path, body in (
            ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4}),
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            ),
        ):
            resp = c.post(path, json=body)
            assert resp.status_code == 200
            parts = dict(p.strip().split(";dur=") for p in resp.headers["server-timing"].split(","))
            assert set(parts) == {"queue", "inference", "total"}
            queue, inference, total = (float(parts[k]) for k in ("queue", "inference", "total"))
            assert 0 <= queue and 0 < inference and inference <= total
