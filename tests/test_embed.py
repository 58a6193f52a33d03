"""End-to-end tests of ``POST /v1/embeddings``: a real uvicorn server on a loopback port, the real
``EmbeddingEngine`` on the packaged all-MiniLM-L6-v2, the official ``openai`` client, and
``sentence-transformers`` as the reference implementation."""

from __future__ import annotations

import argparse
import asyncio
import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from modalities.embed.engine import EmbeddingEngine, _Item, _Request
from modalities.embed.model import DEFAULT_EMBED
from tests.helpers import serve_app

API_KEY = "test-key"
MODEL = DEFAULT_EMBED

TEXTS = [
    "Hello world.",
    "A",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors so that similar meanings end up close together.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "naïve café déjà vu — ünïcödé text with accents",
    "1234567890 + 42 = ?",
    "def f(x):\n    return x * 2  # code",
    "short",
    "A much longer passage that keeps going. " * 12,
    "Why is the sky blue? Rayleigh scattering of sunlight by the molecules of the atmosphere.",
    "混合语言 text with Chinese characters",
    "emoji 🙂 and symbols #$%&",
    "The mitochondria is the powerhouse of the cell.",
    "Tokens, tokens everywhere, and not a vector to spare. " * 4,
    "ok",
    "Dynamic batching groups requests of similar lengths to avoid padding waste.",
    "THE SAME SENTENCE IN UPPER CASE",
    "the same sentence in upper case",
    "A really long input " * 40,
]


class Server:
    def __init__(self, base_url: str, engine: EmbeddingEngine) -> None:
        self.base_url = base_url
        self.engine = engine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def post(self, body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.post(f"{self.base_url}/v1/embeddings", json=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    from gateway.app import create_app

    engine = EmbeddingEngine.from_path(None)
    app = create_app({MODEL: engine}, api_key=API_KEY, aliases={f"sentence-transformers/{MODEL}": MODEL})
    with serve_app(app) as base_url:
        yield Server(base_url, engine)


@pytest.fixture(scope="module")
def reference(server: Server) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(server.engine.model.path), device="cpu")
    return np.asarray(st.encode(TEXTS, normalize_embeddings=True, batch_size=32))


def _vectors(resp: Any) -> np.ndarray:
    return np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)], dtype=np.float32)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_models_lists_embedding_model(server: Server) -> None:
    cards = {m.id: m for m in server.client().models.list().data}
    assert MODEL in cards
    assert cards[MODEL].model_extra["max_model_len"] == 256


def test_matches_sentence_transformers(server: Server, reference: np.ndarray) -> None:
    resp = server.client().embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    got = _vectors(resp)
    assert got.shape == (len(TEXTS), 384) and resp.model == MODEL
    assert _cos(got, reference).min() >= 0.9999
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    n_tokens = sum(len(ids) for ids in server.engine.model.tokenize(TEXTS))
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == n_tokens
    # the openai client's default (base64 on the wire, decoded by the client) gives the same floats
    default = _vectors(server.client().embeddings.create(model=f"sentence-transformers/{MODEL}", input=TEXTS))
    assert np.array_equal(default, got)


def test_base64_decodes_to_the_same_floats(server: Server) -> None:
    floats = server.post({"model": MODEL, "input": TEXTS[:5]}).json()["data"]
    encoded = server.post({"model": MODEL, "input": TEXTS[:5], "encoding_format": "base64"}).json()["data"]
    for f, e in zip(floats, encoded, strict=True):
        decoded = np.frombuffer(base64.b64decode(e["embedding"]), dtype="<f4")
        assert np.array_equal(decoded, np.array(f["embedding"], dtype=np.float32))


def test_dimensions_truncate_and_renormalise(server: Server) -> None:
    client = server.client()
    full = _vectors(client.embeddings.create(model=MODEL, input=TEXTS[:6], encoding_format="float"))
    small = _vectors(client.embeddings.create(model=MODEL, input=TEXTS[:6], dimensions=64, encoding_format="float"))
    assert small.shape == (6, 64)
    assert np.allclose(np.linalg.norm(small, axis=1), 1.0, atol=1e-5)
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    assert np.allclose(small, expected, atol=1e-6)
    err = _error(server.post({"model": MODEL, "input": "x", "dimensions": 385}), 400)
    assert err["param"] == "dimensions" and "384" in err["message"]
    _error(server.post({"model": MODEL, "input": "x", "dimensions": 0}), 400)
    for bad in (True, "3"):  # no boolean or string is a number
        assert _error(server.post({"model": MODEL, "input": "x", "dimensions": bad}), 400)["param"] == "dimensions"


def test_batch_equals_one_by_one_and_concurrent(server: Server) -> None:
    client = server.client()
    batch = _vectors(client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float"))
    with ThreadPoolExecutor(8) as pool:
        singles = list(
            pool.map(lambda t: client.embeddings.create(model=MODEL, input=t, encoding_format="float"), TEXTS)
        )
    one_by_one = np.concatenate([_vectors(r) for r in singles])
    assert np.abs(batch - one_by_one).max() < 1e-5
    assert _cos(batch, one_by_one).min() >= 0.99999


def test_token_id_inputs(server: Server) -> None:
    ids = server.engine.model.tokenize(TEXTS[:3])
    by_text = _vectors(server.client().embeddings.create(model=MODEL, input=TEXTS[:3], encoding_format="float"))
    by_ids = _vectors(server.client().embeddings.create(model=MODEL, input=ids, encoding_format="float"))
    assert _cos(by_text, by_ids).min() >= 0.99999
    single = server.post({"model": MODEL, "input": ids[0]}).json()
    assert single["usage"]["prompt_tokens"] == len(ids[0]) and len(single["data"]) == 1
    err = _error(server.post({"model": MODEL, "input": [[1, 2, 10**9]]}), 400)
    assert "out of range" in err["message"]


def test_too_long_input_and_truncation(server: Server) -> None:
    from sentence_transformers import SentenceTransformer

    long_text = "word " * 400
    err = _error(server.post({"model": MODEL, "input": ["fine", long_text]}), 400)
    assert "256" in err["message"] and err["code"] == "context_length_exceeded" and err["param"] == "input"
    with pytest.raises(openai.BadRequestError, match="256"):
        server.client().embeddings.create(model=MODEL, input=long_text)
    ok = server.post({"model": MODEL, "input": long_text, "truncate": True, "encoding_format": "float"})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 256
    st = SentenceTransformer(str(server.engine.model.path), device="cpu")  # it truncates to 256 too
    ref = st.encode([long_text], normalize_embeddings=True)[0]
    assert _cos(np.array(ok.json()["data"][0]["embedding"]), ref) >= 0.9999
    vllm = server.post({"model": MODEL, "input": long_text, "truncate_prompt_tokens": 16})
    assert vllm.status_code == 200 and vllm.json()["usage"]["prompt_tokens"] == 16
    too_long_ids = _error(server.post({"model": MODEL, "input": list(range(1000, 1300))}), 400)
    assert "256" in too_long_ids["message"]


def test_a_text_far_over_the_limit_is_judged_by_its_head(server: Server) -> None:
    """A text 100x the model's limit: refused naming a lower bound, or truncated to the very
    embedding sentence-transformers gives the whole text (which it tokenizes whole)."""
    from sentence_transformers import SentenceTransformer

    huge = "The quick brown fox jumps over the lazy dog. " * 3_000  # 135k characters
    err = _error(server.post({"model": MODEL, "input": ["fine", huge]}), 400)
    assert "input[1] has at least" in err["message"] and err["code"] == "context_length_exceeded", err
    ok = server.post({"model": MODEL, "input": huge, "truncate": True, "encoding_format": "float"})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 256
    st = SentenceTransformer(str(server.engine.model.path), device="cpu")
    ref = st.encode([huge], normalize_embeddings=True)[0]
    assert _cos(np.array(ok.json()["data"][0]["embedding"]), ref) >= 0.9999
    head_ids = server.engine.prepare([huge], truncate=256)[0]
    assert head_ids == st.tokenizer(huge, truncation=True, max_length=256)["input_ids"]


@pytest.mark.parametrize(
    "body",
    [
        {"input": ""},
        {"input": []},
        {"input": ["ok", ""]},
        {"input": [[]]},
        {"input": ["x"] * 2049},
        {"input": "x", "encoding_format": "int8"},
        {"input": [1.5, 2.5]},
        {},
    ],
)
def test_bad_requests(server: Server, body: dict[str, Any]) -> None:
    _error(server.post({"model": MODEL, **body}), 400)


def test_unknown_model_and_auth(server: Server) -> None:
    assert _error(server.post({"model": "nope", "input": "x"}), 404)["code"] == "model_not_found"
    assert server.post({"input": "x"}).status_code == 200  # the only embedding model
    assert httpx.post(f"{server.base_url}/v1/embeddings", json={"input": "x"}).status_code == 401


def test_batches_group_similar_lengths() -> None:
    """The batch planner takes the oldest request first and does not pad short inputs to long ones."""
    engine = EmbeddingEngine.__new__(EmbeddingEngine)
    engine.max_batch_tokens, engine.max_batch_size, engine.max_padding = 1024, 256, 0.15
    engine._pending = []
    loop = asyncio.new_event_loop()
    try:
        old = _Request(0, np.empty((0, 1)), loop.create_future(), loop, 0)
        new = _Request(1, np.empty((0, 1)), loop.create_future(), loop, 0)
        lengths = [(old, 200), (old, 200), (old, 10), (new, 9), (new, 11), (new, 5), (new, 200)]
        engine._pending = sorted(_Item(n, r.seq, i, [0] * n, r) for i, (r, n) in enumerate(lengths))
        first = engine._next_batch()
        assert sorted(it.length for it in first) == [9, 10, 11]  # shortest of the oldest, plus neighbours
        second = engine._next_batch()
        assert [it.length for it in second] == [200, 200, 200] and second[0].seq == 0
        assert [it.length for it in engine._next_batch()] == [5]
    finally:
        loop.close()


def test_build_app_only_embed() -> None:
    from gateway.app import build_app

    args = argparse.Namespace(only=["embed"], llm="smollm2", embed=None, api_key=None)
    app = build_app(args)
    assert list(app.state.engines) == [MODEL]
    assert app.state.aliases[f"sentence-transformers/{MODEL}"] == MODEL


def test_chat_routes_refuse_an_embedding_model(server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server.base_url}/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    # No LLM is served: omitting the model is a 400, naming the embedding model too.
    _error(httpx.post(url, json={"messages": messages}, headers=headers), 400)
    err = _error(httpx.post(url, json={"model": MODEL, "messages": messages}, headers=headers), 400)
    assert err["param"] == "model"


def test_a_client_that_leaves_frees_the_queue(server: Server) -> None:
    """An abandoned request's queued inputs are dropped: the next request does not wait for
    them (before, ~60 s of work for 2048 long inputs ran on, unread, ahead of it)."""
    import time

    headers = {"Authorization": f"Bearer {API_KEY}"}
    big = {"model": MODEL, "input": [[1000] * 256] * 1024}  # ~30 s of work on 2 cores
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/embeddings", json=big, headers=headers, timeout=1.0)
    time.sleep(0.5)  # the server polls for the disconnect
    start = time.perf_counter()
    assert server.post({"model": MODEL, "input": "hello"}).status_code == 200
    assert time.perf_counter() - start < 5.0
    assert server.engine.stats()["num_pending"] == 0
