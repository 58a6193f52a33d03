"""TTS with the real Piper voice: text splitting, the engine's streaming and scheduling, and
``POST /v1/audio/speech`` end to end (real uvicorn server, the official ``openai`` client)."""

from __future__ import annotations

import asyncio
import io
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from engine.errors import EngineDeadError
from engine.foreground import FOREGROUND, INTERACTIVE
from modalities.audio import decode_audio, from_pcm16
from modalities.tts.piece_queue import Item
from modalities.tts.piper_engine import FIRST_FRAMES, PiperEngine
from modalities.tts.protocol import TTSInputError, TTSRequest
from modalities.tts.text import split_text
from tests.helpers import serve_app

TEXT = "Hello there. The quick brown fox jumps over the lazy dog. How are you today?"


class GatedPiper(PiperEngine):
    """The real engine; the fronts of pieces starting with "Later" wait for ``gate`` (so a test
    can observe what happened before they were synthesised), and every item is logged in run
    order: ``front:<piece>`` or ``decode:<piece>``."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.gate.set()
        self.events: list[str] = []
        self.frames: dict[str, int] = {}  # the frames of each request's first segment, by piece

    def _make(self, voice: Any, item: Item) -> np.ndarray:
        text = item.job.pieces[item.piece]
        if item.front and text.startswith("Later"):
            self.events.append("waiting")
            self.events.append("later_synth" if self.gate.wait(30) else "gate_timeout")
        self.events.append(f"{'front' if item.front else 'decode'}:{text}")
        if item.segment == 0:
            self.frames[text] = item.stop
        return super()._make(voice, item)


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


# -- text --------------------------------------------------------------------------------------
def test_split_text_keeps_words_in_order_and_short_first_piece() -> None:
    text = "This is a fairly long first sentence, with a clause, that keeps going for a while. Second one! Third?"
    pieces = split_text(text, max_chars=300, first_chars=40)
    assert pieces[0] == "This is a fairly long first sentence,"
    assert " ".join(pieces).split() == text.split()
    long = "word " * 200
    assert all(len(p) <= 120 for p in split_text(long, max_chars=120))
    assert " ".join(split_text(long, max_chars=120)).split() == long.split()
    assert split_text("  \n ") == []
    assert split_text("one two three four five six seven.", first_chars=14) == ["one two three", "four five six seven."]


# -- engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> Iterator[GatedPiper]:
    eng = GatedPiper(workers=2, threads=1)
    run(eng.start())
    yield eng
    run(eng.shutdown())


def _collect(engine: PiperEngine, req: TTSRequest) -> np.ndarray:
    async def go() -> np.ndarray:
        return np.concatenate([c async for c in engine.stream(req)])

    return run(go())  # type: ignore[return-value]


def test_engine_streams_segments_and_honours_speed_and_rate(engine: GatedPiper) -> None:
    async def chunks() -> list[np.ndarray]:
        return [c async for c in engine.stream(TTSRequest(TEXT))]

    parts = run(chunks())
    # The audio comes in segments, the first FIRST_FRAMES latent frames long.
    assert len(parts) >= 3 and all(p.dtype == np.float32 and p.size for p in parts)
    assert parts[0].size == FIRST_FRAMES * 256
    audio = np.concatenate(parts)
    seconds = audio.size / engine.sample_rate
    assert engine.sample_rate == 22050 and 2.0 < seconds < 10.0, seconds
    assert np.abs(audio).max() <= 1.0 and np.abs(audio).std() > 0.01
    fast = _collect(engine, TTSRequest(TEXT, speed=2.0)).size
    slow = _collect(engine, TTSRequest(TEXT, speed=0.5)).size
    assert 2.5 < slow / fast < 6, (slow, fast)
    # Far from 1, a time-stretch does what the voice's length scale alone does not (it gave 2.15x at 4).
    fastest = _collect(engine, TTSRequest(TEXT, speed=4.0)).size
    assert 3.2 < audio.size / fastest < 4.8, (audio.size, fastest)
    rate_24k = _collect(engine, TTSRequest("Hello there.", sample_rate=24000)).size / 24000
    assert 0.3 < rate_24k < 2.0


@pytest.mark.parametrize("text", ["Hello there. ...", "... Hello there.", "..."])
def test_a_piece_with_nothing_to_say_is_skipped(engine: GatedPiper, text: str) -> None:
    async def go() -> int:
        return await asyncio.wait_for(_drain(engine, TTSRequest(text)), 30)

    samples = run(go())
    assert (samples > 0) == ("Hello" in text), samples


def test_a_failed_piece_fails_the_request_once_and_is_not_retried() -> None:
    """A piece whose synthesis raises ends its request with the error; nothing of that request
    is made again meanwhile, even while its client does not read."""
    eng = GatedPiper(workers=1, threads=1)
    fronts: list[str] = []
    make = eng._make

    def failing(voice: Any, item: Item) -> np.ndarray:
        text = item.job.pieces[item.piece]
        if item.front:
            fronts.append(text)
        if text.startswith("Boom"):
            raise RuntimeError("simulated synthesis failure")
        return make(voice, item)

    eng._make = failing  # type: ignore[method-assign]

    async def go() -> None:
        stream = eng.stream(TTSRequest("Hello there, this is the first piece. Boom. And more text after it."))
        assert (await stream.__anext__()).size
        await asyncio.sleep(0.5)  # the client pauses; the failed piece must not be retried
        with pytest.raises(RuntimeError, match="simulated"):
            async for _ in stream:
                pass
        await eng.shutdown()

    run(go())
    assert fronts.count("Boom.") == 1, fronts
    assert "And more text after it." not in fronts[fronts.index("Boom.") + 1 :], fronts
    assert eng.stats()["tts_requests_queued"] == 0


def test_engine_rejects_bad_input_before_audio(engine: GatedPiper) -> None:
    async def first(req: TTSRequest) -> None:
        async for _ in engine.stream(req):
            break

    for req, param in [
        (TTSRequest(""), "input"),
        (TTSRequest("x" * 5000), "input"),
        (TTSRequest("hi", voice="nobody"), "voice"),
        (TTSRequest("hi", speed=9.0), "speed"),
    ]:
        with pytest.raises(TTSInputError) as err:
            run(first(req))
        assert err.value.param == param


def test_first_pieces_of_new_requests_run_first_and_shrink_under_load() -> None:
    eng = GatedPiper(workers=1, threads=1)
    eng.gate.clear()

    async def go() -> None:
        old, first = await _blocked_on(eng, "Later A zero. A one. A two.")
        new = [
            asyncio.ensure_future(_drain(eng, TTSRequest(t)))
            for t in ("B zero. B one.", "C one two three four five six seven.")
        ]
        await asyncio.sleep(0.05)  # both requests queued behind the gate
        stats = eng.stats()  # (the gateway's queue_depth and running_batch_size)
        assert (stats["num_waiting"], stats["num_running"]) == (3, 0), stats  # (A's first chunk is held)
        eng.gate.set()
        await first
        await asyncio.gather(*new)
        rest = [c async for c in old]
        assert rest
        await eng.shutdown()

    run(go())
    # C arrived with two requests waiting for their first audio: its first piece was cut to
    # 60 // 3 = 20 characters and its first segment to FIRST_FRAMES // 3 latent frames.
    assert eng.frames == {"Later A zero.": 24, "B zero.": 12, "C one two three four": 8}, eng.frames
    _assert_order(
        eng,
        ["Later A zero.", "B zero.", "C one two three four"],
        [["Later A zero.", "A one.", "A two."], ["B zero.", "B one."], ["C one two three four", "five six seven."]],
    )
    assert eng.stats()["tts_first_pieces_pending"] == 0 and eng.stats()["num_waiting"] == 0


def test_a_live_turns_pieces_go_first_and_its_first_piece_spans_the_cores() -> None:
    """Priority below 0 (a live voice turn): its first piece runs before those queued earlier,
    on the session over every core, and its next one too while it has under ``LIVE_HORIZON_S``
    of audio in hand; other pieces run on the worker's own session."""
    eng = GatedPiper(workers=1, threads=1)
    eng.gate.clear()
    wide: dict[str, bool] = {}
    make = eng._make

    def spy(voice: Any, item: Item) -> np.ndarray:
        if item.front:
            wide[item.job.pieces[item.piece]] = voice is eng._wide
        return make(voice, item)

    eng._make = spy  # type: ignore[method-assign]

    async def go() -> None:
        old, first = await _blocked_on(eng, "Later A zero. A one.")
        queued = asyncio.ensure_future(_drain(eng, TTSRequest("B zero. B one.")))
        await asyncio.sleep(0.05)
        live = asyncio.ensure_future(_drain(eng, TTSRequest("V zero. V one.", priority=INTERACTIVE)))
        await asyncio.sleep(0.05)
        eng.gate.set()
        await first
        await asyncio.gather(queued, live)
        assert [c async for c in old]
        await eng.shutdown()

    run(go())
    _assert_order(
        eng,
        ["Later A zero.", "V zero.", "V one.", "B zero."],
        [["Later A zero.", "A one."], ["V zero.", "V one."], ["B zero.", "B one."]],
    )
    spans = (os.cpu_count() or 1) > 1  # one core: no wider session to run on
    assert wide == {text: spans and text == "V zero." for text in wide} and len(wide) == 6, wide


def test_only_a_first_piece_holds_the_foreground() -> None:
    """A request's first segment is made under ``FOREGROUND.hold()`` (yielding engines wait
    meanwhile); its later ones are not. One worker, so no other item overlaps."""
    eng = PiperEngine(workers=1, threads=1)
    seen: list[tuple[int | None, bool]] = []
    make = eng._make

    def spy(voice: Any, item: Item) -> np.ndarray:
        seen.append((item.segment, FOREGROUND.active))
        return make(voice, item)

    eng._make = spy  # type: ignore[method-assign]
    try:
        _collect(eng, TTSRequest(TEXT))
    finally:
        run(eng.shutdown())
    assert len(seen) >= 3 and seen[0] == (0, True) and not any(active for _, active in seen[1:]), seen
    assert not FOREGROUND.active


def _assert_order(eng: GatedPiper, heads: list[str], requests: list[list[str]]) -> None:
    """The one worker made the first segments of the requests' first pieces (``heads``) first;
    each request's pieces were fronted in order, each piece's decodes after its front. Which
    request goes next after the first segments depends on timing (when each would run dry)."""
    fronts = [e.removeprefix("front:") for e in eng.events if e.startswith("front:")]
    assert fronts[: len(heads)] == heads, eng.events
    assert sorted(fronts) == sorted(sum(requests, [])), eng.events
    for pieces in requests:
        assert [f for f in fronts if f in pieces] == pieces, eng.events
    for e in eng.events:
        if e.startswith("decode:"):
            assert f"front:{e.removeprefix('decode:')}" in eng.events[: eng.events.index(e)], eng.events
    assert any(e == "decode:Later A zero." for e in eng.events), eng.events  # cut in segments


async def _blocked_on(eng: GatedPiper, text: str) -> tuple[AsyncIterator[np.ndarray], asyncio.Future[np.ndarray]]:
    """Starts ``eng`` and a request for ``text`` (gated: it starts with "Later"); returns its
    stream and its first chunk's future once the worker is blocked inside its first piece."""
    await eng.start()
    stream = eng.stream(TTSRequest(text))
    first = asyncio.ensure_future(stream.__anext__())
    while not eng.events:
        await asyncio.sleep(0.01)
    return stream, first


async def _drain(eng: PiperEngine, req: TTSRequest) -> int:
    return sum([c.size async for c in eng.stream(req)])


def test_closing_the_stream_drops_queued_pieces() -> None:
    eng = GatedPiper(workers=1, threads=1)
    text = " ".join(f"Sentence number {i}." for i in range(12))

    async def go() -> None:
        await eng.start()
        gen = eng.stream(TTSRequest(text))
        await gen.__anext__()
        await gen.aclose()
        await asyncio.sleep(0.3)
        assert eng.stats()["tts_requests_queued"] == 0
        await eng.shutdown()

    run(go())
    assert eng.stats()["tts_pieces_done"] <= 3


def test_shutdown_fails_the_requests_it_leaves_unfinished() -> None:
    """A request mid-synthesis and one not started get ``EngineDeadError`` at shutdown instead of
    waiting forever; the item in synthesis still finishes."""
    eng = GatedPiper(workers=1, threads=1)

    async def rest(stream: AsyncIterator[np.ndarray]) -> int:
        return sum([c.size async for c in stream])

    async def go() -> None:
        eng.gate.clear()
        stream, first = await _blocked_on(eng, "Later one. Two more words here.")
        queued = eng.stream(TTSRequest("Hello there. And more."))
        waiting = asyncio.ensure_future(rest(queued))
        await asyncio.sleep(0.1)
        stopping = asyncio.ensure_future(eng.shutdown())
        await asyncio.sleep(0.1)
        eng.gate.set()  # the worker finishes its item, then stops
        await asyncio.wait_for(stopping, 30)
        assert (await asyncio.wait_for(first, 5)).size  # the first segment was made
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(rest(stream), 5)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(waiting, 5)

    run(go())
    assert eng.stats()["tts_requests_queued"] == 0


def test_shutdown_during_the_first_start_leaves_the_engine_restartable() -> None:
    eng = GatedPiper(workers=1, threads=1)

    async def go() -> None:
        starting = asyncio.ensure_future(eng.start())
        await asyncio.sleep(0)  # the start holds its lock, loading the voice
        await eng.shutdown()  # waits for the start, then stops its workers
        await starting
        assert not eng._threads
        assert await asyncio.wait_for(_drain(eng, TTSRequest("Hello there.")), 30) > 0  # started again
        await eng.shutdown()

    run(go())


# -- HTTP ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_url(engine: GatedPiper) -> Iterator[str]:
    from gateway.app import create_app
    from modalities.tts.api import router

    app = create_app({engine.model_name: engine}, routers=[router], aliases={"piper": engine.model_name})
    with serve_app(app) as url:
        yield url


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_model_names_have_the_default_engines_card() -> None:
    """``tts-1`` and OpenAI's other TTS names: aliases of the plugin's first engine, so the
    official client's ``models.retrieve("tts-1")`` gets a card (it was a 404)."""
    import argparse

    from gateway.app import create_app
    from modalities.tts.api import router
    from modalities.tts.plugin import build
    from modalities.tts.protocol import OPENAI_MODELS

    built = build(argparse.Namespace())  # the default Piper voice; its sessions load on first use
    (name,) = built.engines
    assert {m: built.aliases.get(m) for m in OPENAI_MODELS} == dict.fromkeys(OPENAI_MODELS, name)
    with serve_app(create_app(built.engines, routers=[router], aliases=built.aliases)) as url:
        card = _client(url).models.retrieve("tts-1")
        assert card.id == "tts-1" and card.model_extra["root"] == name
        with pytest.raises(openai.NotFoundError):
            _client(url).models.retrieve("tts-2")


def test_openai_client_streams_wav_first_chunk_before_later_text_is_synthesised(
    base_url: str, engine: GatedPiper
) -> None:
    engine.events.clear()
    engine.gate.clear()
    text = "Hello from the first piece. Later comes the second piece."
    client = _client(base_url)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=text, response_format="wav"
    ) as resp:
        assert resp.headers["content-type"] == "audio/wav"
        chunks = resp.iter_bytes()
        body = next(chunks)
        engine.events.append("client_first_chunk")
        engine.gate.set()
        body += b"".join(chunks)
    assert engine.events.index("client_first_chunk") < engine.events.index("later_synth")
    audio = decode_audio(body, rate=None)
    assert audio.rate == 22050
    assert 1.5 < audio.duration < 8.0, audio.duration


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus", "aac"])
def test_compressed_formats_decode(base_url: str, fmt: str) -> None:
    resp = _client(base_url).audio.speech.create(model="piper", voice="joe", input="Hello there.", response_format=fmt)
    audio = decode_audio(resp.content, rate=None)
    assert 0.4 < audio.duration < 3.0
    assert resp.response.headers["x-sample-rate"] == str(audio.rate)  # (opus: 48 kHz)


@pytest.mark.parametrize("fmt", ["mp3", "aac"])
def test_a_rate_the_codec_lacks_is_resampled_not_a_broken_body(base_url: str, fmt: str) -> None:
    body = {"model": "piper", "voice": "joe", "input": "Hello there.", "response_format": fmt, "sample_rate": 9000}
    resp = httpx.post(f"{base_url}/v1/audio/speech", json=body, timeout=60)
    assert resp.status_code == 200
    audio = decode_audio(resp.content, rate=None)
    assert audio.rate == 8000 and 0.4 < audio.duration < 3.0  # the nearest rate mp3/aac take
    assert resp.headers["x-sample-rate"] == "8000"  # the rate written, not the one asked for


def test_pcm_is_24khz_and_sse_carries_the_same_audio(base_url: str) -> None:
    pcm = _client(base_url).audio.speech.create(model="tts-1", voice="joe", input="Hello there.", response_format="pcm")
    seconds = len(from_pcm16(pcm.content)) / 24000
    assert 0.4 < seconds < 3.0
    with httpx.stream(
        "POST",
        f"{base_url}/v1/audio/speech",
        json={"input": "Hello there. Bye.", "response_format": "pcm", "stream_format": "sse"},
        timeout=60,
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    import base64
    import json

    events = [json.loads(line[6:]) for line in lines]
    assert events[-1]["type"] == "speech.audio.done"
    # OpenAI's done event requires usage: Piper reads phoneme ids (with its pads, ~2 a letter) and generates no tokens.
    usage = events[-1]["usage"]
    assert usage["input_tokens"] > len("Hello there. Bye.") and usage["output_tokens"] == 0
    assert usage["total_tokens"] == usage["input_tokens"]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2
    assert len(b"".join(base64.b64decode(e["audio"]) for e in deltas)) > 24000


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": "x" * 4097}, 400, "input"),
        ({"input": "hi", "voice": "nobody"}, 400, "voice"),
        ({"input": "hi", "response_format": "ogg-vorbis"}, 400, "response_format"),
        ({"input": "hi", "speed": 0.1}, 400, "speed"),
        ({"input": "hi", "speed": "fast"}, 400, "speed"),
        ({"input": "hi", "speed": True}, 400, "speed"),
        ({"input": "hi", "model": "no-such-model"}, 404, "model"),
        ({"voice": "joe"}, 400, "input"),
        ({"input": 5}, 400, "input"),
    ],
)
def test_bad_input_is_openai_error_json(base_url: str, body: dict, status: int, param: str) -> None:
    resp = httpx.post(f"{base_url}/v1/audio/speech", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"]


def test_a_text_that_crashes_the_phonemiser_is_a_400_and_the_server_lives_on(base_url: str) -> None:
    resp = httpx.post(f"{base_url}/v1/audio/speech", json={"input": "s'" * 220}, timeout=60)  # espeak-ng#2495
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "input"
    resp = httpx.post(f"{base_url}/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm"}, timeout=60)
    assert resp.status_code == 200 and len(resp.content) > 4000


def test_unicode_edge_inputs(base_url: str) -> None:
    """A NUL is spoken around (eSpeak's bridge takes none); a lone surrogate is no character (400,
    even where the field is an unknown model's name); zero-width characters alone say nothing (400,
    not an empty file)."""
    url = f"{base_url}/v1/audio/speech"
    resp = httpx.post(url, json={"input": "Hello\u0000world.", "response_format": "pcm"}, timeout=60)
    assert resp.status_code == 200 and len(resp.content) > 8000
    for raw, param in [
        ('{"input": "Hello \\ud800 world"}', "input"),
        ('{"input": "Hi", "model": "\\ud800"}', "model"),
        ('{"input": "\\u200b\\ufeff", "response_format": "mp3"}', "input"),
    ]:
        resp = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert resp.status_code == 400, (raw, resp.text)
        assert resp.json()["error"]["param"] == param and resp.json()["error"]["code"] == "invalid_value"
    resp = httpx.post(url, json={"input": "Hi", "stream_format": "bogus"}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_format"


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_a_later_sentence_that_cannot_be_spoken_is_a_400_before_any_audio(base_url: str, stream_format: str) -> None:
    """The later pieces are phonemised while the first is synthesised: one the phonemiser fails on
    fails the request before its status line (not a stream cut short after a 200)."""
    body = {
        "input": "Hello there. " + "s'" * 220 + " And more.",
        "response_format": "pcm",
        "stream_format": stream_format,
    }
    resp = httpx.post(f"{base_url}/v1/audio/speech", json=body, timeout=60)
    assert resp.status_code == 400, resp.text[:200]
    err = resp.json()["error"]
    assert err["param"] == "input" and "phonemiser" in err["message"], err
    again = httpx.post(f"{base_url}/v1/audio/speech", json={**body, "input": "Hello there. And more."}, timeout=60)
    assert again.status_code == 200 and again.content


def test_openai_client_raises_bad_request_for_unknown_voice(base_url: str) -> None:
    with pytest.raises(openai.BadRequestError):
        _client(base_url).audio.speech.create(model="tts-1", voice="nobody", input="hi")  # type: ignore[arg-type]


def test_wav_stream_header_is_readable_by_soundfile(base_url: str) -> None:
    import soundfile as sf

    resp = httpx.post(f"{base_url}/v1/audio/speech", json={"input": "Hi.", "response_format": "wav"}, timeout=60)
    data, rate = sf.read(io.BytesIO(resp.content))
    assert rate == 22050 and len(data) > 2000


def test_client_disconnect_cancels_queued_pieces(base_url: str, engine: GatedPiper) -> None:
    engine.gate.clear()
    text = "First piece here. " + " ".join(f"Later piece {i}." for i in range(10))
    try:
        with httpx.stream("POST", f"{base_url}/v1/audio/speech", json={"input": text, "response_format": "pcm"}) as r:
            assert r.status_code == 200
            next(r.iter_bytes())  # the first piece's audio; the workers are now held at the gate
        deadline = time.monotonic() + 20
        while engine.stats()["tts_requests_active"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.stats()["tts_requests_active"] == 0
        assert engine.stats()["tts_requests_queued"] == 0  # the 8+ pieces not yet started were dropped
    finally:
        engine.gate.set()


def test_a_client_gone_before_the_first_audio_frees_its_request(base_url: str, engine: GatedPiper) -> None:
    """A client that leaves while its first piece waits (here at the gate) has its request ended
    at once, not when that piece's audio is made for nobody."""
    engine.gate.clear()
    try:
        body = {"input": "Later, a piece held at the gate.", "response_format": "pcm"}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base_url}/v1/audio/speech", json=body, timeout=httpx.Timeout(30, read=0.5))
        deadline = time.monotonic() + 10
        while engine.stats()["tts_requests_active"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.stats()["tts_requests_active"] == 0  # (its piece still waits at the gate)
    finally:
        engine.gate.set()


def test_past_its_bound_a_speech_request_is_a_429_and_a_job_or_live_turn_waits(
    base_url: str, engine: GatedPiper
) -> None:
    """At ``max_requests`` held, the route's request is refused before any work (429, OpenAI
    error JSON, ``Retry-After``); an engine request that is not ``refusable`` (a job's, a live
    turn's) still runs; once the held stream ends, the route's requests are served again."""
    engine.gate.clear()
    engine._admission.limit = 1
    text = "First piece here. " + " ".join(f"Later piece {i}." for i in range(10))
    try:
        with httpx.stream("POST", f"{base_url}/v1/audio/speech", json={"input": text, "response_format": "pcm"}) as r:
            assert r.status_code == 200
            chunks = r.iter_bytes()  # (kept: a dropped iterator closes the response)
            next(chunks)  # held: its later pieces wait at the gate
            with pytest.raises(openai.RateLimitError) as info:
                _client(base_url).audio.speech.create(model="tts-1", voice="alloy", input="Hi.")
            assert 1 <= int(info.value.response.headers["retry-after"]) <= 60  # (engine.admission's advice)
            body: dict[str, Any] = info.value.body  # type: ignore[assignment]
            assert body["code"] == "rate_limit_exceeded" and "1 requests are already in progress" in body["message"]
            assert engine.stats()["tts_requests_active"] == 1  # the refused one held nothing
            engine.gate.set()
        deadline = time.monotonic() + 20
        while engine.stats()["tts_requests_active"] and time.monotonic() < deadline:
            time.sleep(0.02)  # the held stream ends once the server sees its client gone
        engine._admission.limit = 0  # every refusable request is refused now ...
        assert _collect(engine, TTSRequest("Hi.", priority=INTERACTIVE)).size > 0  # ... not this one
        engine._admission.limit = 1
        resp = httpx.post(f"{base_url}/v1/audio/speech", json={"input": "Hi.", "response_format": "wav"}, timeout=60)
        assert resp.status_code == 200 and len(resp.content) > 2000
    finally:
        engine._admission.limit = None
        engine.gate.set()
