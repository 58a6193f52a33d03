"""``/v1/realtime`` end to end: a real uvicorn server with SmolLM2, Whisper tiny.en and the Piper
voice; a real ``websockets`` client streams speech synthesised by Piper (faster than real time)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.helpers import serve_app

websockets = pytest.importorskip("websockets")
RATE = 24_000
BETA = {"OpenAI-Beta": "realtime=v1"}  # the beta event protocol (without it a client speaks GA)


def spoken(*phrases: str, gap_s: float = 0.3, tail_s: float = 3.0) -> bytes:
    """``phrases`` spoken by the Piper voice as 24 kHz pcm16, ``gap_s`` of silence between them
    and ``tail_s`` after them."""
    from modalities.asr.speech_corpus import synth_piper
    from modalities.audio import to_pcm16

    parts = [np.zeros(RATE * 3 // 10, np.float32)]
    for i, audio in enumerate(synth_piper(list(phrases), RATE)):
        parts += [np.zeros(int(RATE * gap_s), np.float32)] if i else []
        parts.append(audio)
    parts.append(np.zeros(int(RATE * tail_s), np.float32))
    return to_pcm16(np.concatenate(parts))


def speech(text: str) -> bytes:
    """``text`` spoken by the Piper voice as pcm16 at 24 kHz, with 0.3 s of silence before and 1 s after."""
    return spoken(text, tail_s=1.0)


@pytest.fixture(scope="module")
def server(smollm2_dir: Any) -> Iterator[dict[str, Any]]:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from gateway.app import create_app
    from modalities.asr.api import router as asr_router
    from modalities.asr.engine import AsrConfig, AsrEngine
    from modalities.tts.piper_engine import PiperEngine
    from pipelines.plugin import router, warm_up

    llm = AsyncEngine.from_config(EngineConfig(model=str(smollm2_dir)))
    asr = AsrEngine.from_config(AsrConfig(max_num_seqs=4))
    tts = PiperEngine(workers=1)
    engines = {"smollm2": llm, asr.model_name: asr, tts.model_name: tts}
    app = create_app(engines, routers=[router, asr_router], warm_ups=[warm_up])  # (to hear replies)
    with serve_app(app) as url:
        ws_url = url.replace("http://", "ws://") + "/v1/realtime"
        warmed = {"llm": llm.stats(), "asr": asr.stats(), "tts": tts.stats()}  # before any test's request
        yield {"url": ws_url, "http": url, "llm": llm, "tts": tts, "question": speech(QUESTION), "warmed": warmed}


QUESTION = "What is the capital of France?"


class Client:
    """Collects server events; ``until`` waits for one matching event."""

    def __init__(self, ws: Any) -> None:
        self.ws, self.events = ws, []

    async def send(self, type_: str, **fields: Any) -> None:
        await self.ws.send(json.dumps({"type": type_, **fields}))

    async def until(self, type_: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        async def wait() -> dict[str, Any]:
            while True:
                ev = json.loads(await self.ws.recv())
                self.events.append(ev)
                if ev["type"] == type_ and all(_get(ev, k) == v for k, v in match.items()):
                    return ev

        return await asyncio.wait_for(wait(), timeout)

    async def stream(self, pcm: bytes, chunk_ms: int = 100, pace: float = 0.25) -> None:
        """Append ``pcm`` in ``chunk_ms`` pieces, ``pace`` x real time."""
        step = RATE * chunk_ms // 1000 * 2
        for i in range(0, len(pcm), step):
            await self.send("input_audio_buffer.append", audio=base64.b64encode(pcm[i : i + step]).decode())
            await asyncio.sleep(chunk_ms / 1000 * pace)

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    def index(self, type_: str) -> int:
        return self.types().index(type_)


TURN_ORDER = [
    "input_audio_buffer.speech_started",
    "input_audio_buffer.speech_stopped",
    "input_audio_buffer.committed",
    "conversation.item.input_audio_transcription.completed",
    "response.created",
    "response.audio.delta",
    "response.audio.done",
    "response.done",
]


def assert_voice_turn(c: Client, done: dict[str, Any]) -> None:
    """One voice turn of QUESTION: its events in order, the question heard, the reply ended."""
    positions = [c.index(t) for t in TURN_ORDER]
    assert positions == sorted(positions), c.types()
    transcript = next(e for e in c.events if e["type"].endswith("transcription.completed"))["transcript"]
    assert "capital" in transcript.lower() and "france" in transcript.lower()
    assert done["response"]["status"] in ENDED


# A response that ran to its end: "completed", or "incomplete" when its text reached its
# max_response_output_tokens (the tests' short limits often cut it).
ENDED = ("completed", "incomplete")


def user_item(text: str) -> dict[str, Any]:
    """A ``conversation.item.create`` text message from the user."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def text_session(c: Client, max_tokens: int) -> None:
    """After ``session.created``: text-only replies of at most ``max_tokens``."""
    await c.until("session.created")
    await c.send("session.update", session={"modalities": ["text"], "max_response_output_tokens": max_tokens})


async def manual_session(c: Client) -> None:
    """After connecting: no turn detection (the client commits), text-only replies."""
    await c.until("session.created")
    await c.send("session.update", session={"turn_detection": None, "modalities": ["text"]})
    await c.until("session.updated")


def sdk_until(conn: Any, events: list[Any]) -> Any:
    """``until(type)`` for an ``openai`` realtime connection: the next event of that type (or an
    error), every event received kept in ``events``."""

    async def until(type_: str) -> Any:
        async def wait() -> Any:
            async for ev in conn:
                events.append(ev)
                if ev.type in (type_, "error"):
                    return ev
            raise AssertionError("connection closed")

        return await asyncio.wait_for(wait(), 60)

    return until


@contextlib.asynccontextmanager
async def ga_connection(server: dict[str, Any]) -> AsyncIterator[tuple[Any, list[Any], Any]]:
    """``openai``'s GA realtime client on ``server``: ``(conn, events, until)`` (``sdk_until``)."""
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=server["http"] + "/v1", api_key="unused")
    async with client.realtime.connect(model="smollm2") as conn:
        events: list[Any] = []
        yield conn, events, sdk_until(conn, events)


def _get(ev: dict[str, Any], path: str) -> Any:
    for key in path.split("__"):
        ev = ev.get(key) if isinstance(ev, dict) else None  # type: ignore[assignment]
    return ev


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _stand_in(services: Any, sent: list[dict[str, Any]]) -> Any:
    """A ``RealtimeSession`` over a stand-in socket that receives nothing and puts each event it
    sends into ``sent``: session state only, no server."""
    import types

    from pipelines.realtime import RealtimeSession

    class Socket:
        app = types.SimpleNamespace(state=types.SimpleNamespace())
        state = types.SimpleNamespace()  # (no tenant: audio is not charged)

        async def send_text(self, text: str) -> None:
            sent.append(json.loads(text))

    return RealtimeSession(Socket(), services, "m")  # type: ignore[arg-type]


def test_voice_turn_then_warm_second_turn(server: dict[str, Any]) -> None:
    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            created = await c.until("session.created")
            assert created["session"]["modalities"] == ["text", "audio"]
            await c.send("session.update", session={"temperature": 0, "max_response_output_tokens": 24})
            await c.until("session.updated")
            feeder = asyncio.create_task(c.stream(server["question"]))
            done = await c.until("response.done")
            limits = await c.until("rate_limits.updated")  # (right after it: sent together)
            await feeder
            # one at its start too, with its prompt and max tokens reserved of the context window
            started = next(e for e in c.events if e["type"] == "rate_limits.updated")
            assert c.index("response.created") < c.index("rate_limits.updated") < c.index("response.audio.delta")
            assert_voice_turn(c, done)
            # The response shows the settings it ran with: the session's.
            keys = ("modalities", "voice", "output_audio_format", "temperature", "max_output_tokens")
            settings = [["text", "audio"], created["session"]["voice"], "pcm16", 0, 24]
            assert [done["response"][k] for k in keys] == settings
            assert c.events[c.index("response.done") + 1] is limits
            window = server["llm"].max_model_len
            prompt = done["response"]["usage"]["input_tokens"]
            assert started["rate_limits"][1]["remaining"] == window - prompt - 24
            assert limits["rate_limits"][1] == {
                "name": "tokens",
                "limit": window,
                "remaining": window - done["response"]["usage"]["total_tokens"],
                "reset_seconds": 0.0,
            }
            queue = limits["rate_limits"][0]
            assert queue["name"] == "requests" and 0 < queue["remaining"] <= queue["limit"] == server["llm"].max_waiting
            assert (
                c.index("response.created")
                < c.index("response.audio_transcript.delta")
                < c.index("response.audio.delta")
            )
            audio = b"".join(base64.b64decode(e["delta"]) for e in c.events if e["type"] == "response.audio.delta")
            assert len(audio) / 2 / RATE > 0.3  # at least a word of 24 kHz pcm16
            said = "".join(e["delta"] for e in c.events if e["type"] == "response.audio_transcript.delta")
            assert said and said == done["response"]["output"][0]["content"][0]["transcript"]
            assert "paris" in said.lower()
            metrics = httpx.get(server["http"] + "/metrics").text
            assert "realtime_turn_to_first_audio_seconds_count" in metrics and "realtime_sessions_total" in metrics

            # The client says it played only 300 ms of the reply: the item is cut there.
            item_id = done["response"]["output"][0]["id"]
            await c.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=300)
            cut = await c.until("conversation.item.truncated")
            assert cut["item_id"] == item_id and cut["audio_end_ms"] == 300
            await c.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=600)
            longer = await c.until("error")  # (a truncation only shortens: the rest is gone)
            assert longer["error"]["param"] == "audio_end_ms" and "truncated" in longer["error"]["message"]

            # Items read back: the reply as heard (cut), the user's speech as its transcript.
            await c.send("conversation.item.retrieve", item_id=item_id)
            got = (await c.until("conversation.item.retrieved"))["item"]
            assert got["id"] == item_id and got["role"] == "assistant" and got["status"] == "completed"
            heard = got["content"][0]
            words = heard["transcript"].split()
            assert heard["type"] == "audio" and words == said.split()[: len(words)] and len(words) < len(said.split())
            user_id = next(e for e in c.events if e["type"].endswith("transcription.completed"))["item_id"]
            await c.send("conversation.item.retrieve", item_id=user_id)
            got = (await c.until("conversation.item.retrieved"))["item"]
            assert got["role"] == "user" and got["content"][0]["type"] == "input_audio"
            assert "france" in got["content"][0]["transcript"].lower()
            await c.send("conversation.item.retrieve", item_id="item_nope")
            err = await c.until("error")
            assert err["error"]["code"] == "item_not_found" and err["error"]["param"] == "item_id"

            # Second turn: the conversation so far is a cached prefix of the new prompt.
            hits = server["llm"].stats()["prefix_cache_hits"]
            item = user_item("And of Italy?")
            await c.send("conversation.item.create", item=item)
            await c.send("response.create")
            done2 = await c.until("response.done")
            assert [done2["response"][k] for k in keys] == settings
            usage = done2["response"]["usage"]
            assert usage["input_token_details"]["cached_tokens"] >= done["response"]["usage"]["input_tokens"] - 16
            assert usage["input_tokens"] > usage["input_token_details"]["cached_tokens"] > 0
            assert server["llm"].stats()["prefix_cache_hits"] > hits

    run(go())


def test_the_server_warmed_up_with_a_voice_turn_before_ready(server: dict[str, Any]) -> None:
    """Before ``/ready``, a spoken turn ran through the voice pipeline: Piper spoke the
    question and the reply, Whisper transcribed it, SmolLM2 answered (stats read before any
    test's request)."""
    warmed = server["warmed"]
    assert warmed["asr"]["windows_total"] >= 1
    assert warmed["llm"]["generation_tokens_total"] >= 1
    assert warmed["tts"]["tts_pieces_done"] >= 2  # the question, then the reply


def test_the_official_openai_client_speaks_the_ga_protocol(server: dict[str, Any]) -> None:
    """``openai``'s ``client.realtime.connect`` (the GA protocol): a GA ``session.update``
    switches the session's dialect; a spoken turn then comes back with GA event names and
    shapes, a text-only response as ``output_text``, and a bad GA field gets an error event."""

    async def go() -> None:
        async with ga_connection(server) as (conn, events, until):
            td = {"type": "server_vad", "silence_duration_ms": 500}
            session = {"type": "realtime", "output_modalities": ["audio"], "max_output_tokens": 24}
            include = ["item.input_audio_transcription.logprobs"]
            await conn.session.update(
                session={**session, "audio": {"input": {"turn_detection": td}}, "include": include}
            )
            updated = await until("session.updated")
            assert updated.type == "session.updated" and updated.session.type == "realtime"
            assert updated.session.include == include
            assert updated.session.output_modalities == ["audio"] and updated.session.audio.input.format.rate == RATE
            pcm = server["question"]
            step = RATE // 10 * 2  # 100 ms appends
            for i in range(0, len(pcm), step):
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + step]).decode())
            done = await until("response.done")
            types = [e.type for e in events]
            assert done.type == "response.done" and done.response.status in ENDED, types
            for t in ("conversation.item.added", "conversation.item.done", "response.output_audio.delta"):
                assert t in types, (t, types)
            beta = {"response.audio.delta", "response.audio_transcript.delta", "conversation.item.created"}
            assert not beta & set(types)
            heard = next(e for e in events if e.type.endswith("input_audio_transcription.completed"))
            assert "capital" in heard.transcript.lower() and "france" in heard.transcript.lower()
            assert heard.usage.type == "duration" and 1.0 < heard.usage.seconds < 4.0
            assert heard.logprobs and "".join(lp.token for lp in heard.logprobs).strip() == heard.transcript
            said = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
            [part] = done.response.output[0].content
            assert part.type == "output_audio" and said and part.transcript == said

            events.clear()  # a text-only response in the audio session, then a text-only session
            item = user_item("And of Italy?")
            await conn.conversation.item.create(item=item)
            await conn.response.create(response={"output_modalities": ["text"]})
            done = await until("response.done")
            types = [e.type for e in events]
            assert "response.output_text.delta" in types and "response.output_audio.delta" not in types, types
            assert [c.type for c in done.response.output[0].content] == ["output_text"]
            events.clear()
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            await until("session.updated")
            await conn.conversation.item.create(item=item)
            await conn.response.create()
            await until("response.done")
            types = [e.type for e in events]
            assert "response.output_text.delta" in types and "response.output_audio.delta" not in types, types
            await conn.response.create(response={"output_modalities": ["text", "audio"]})
            err = await until("response.done")
            assert err.type == "error" and err.error.param == "response.output_modalities"

            fmt = {"type": "audio/pcmu"}  # G.711 mu-law at 8 kHz, as a phone gateway plays it
            await conn.session.update(session={"type": "realtime", "audio": {"output": {"format": fmt}}})
            updated = await until("session.updated")
            assert updated.type == "session.updated" and updated.session.audio.output.format.type == "audio/pcmu"
            assert updated.session.audio.input.format.type == "audio/pcm"
            fmt = {"type": "audio/pcm", "rate": 16000}
            await conn.session.update(session={"type": "realtime", "audio": {"output": {"format": fmt}}})
            err = await until("session.updated")
            assert err.type == "error" and err.error.param == "session.audio.output.format"

    run(go())


def test_a_client_that_does_not_ask_for_beta_speaks_ga_from_its_first_event(server: dict[str, Any]) -> None:
    """As with OpenAI: ``openai``'s GA client, with no ``session.update``, gets ``session.created``
    in the GA shape and GA events, and its GA ``response.create`` fields are read; a beta-only
    session field is refused, naming where GA has it."""

    async def go() -> None:
        async with ga_connection(server) as (conn, events, until):
            created = await until("session.created")
            assert created.session.type == "realtime" and created.session.output_modalities == ["audio"]
            assert created.session.audio.output.voice == server["tts"].voices[0]  # (the one that speaks, not null)
            await conn.conversation.item.create(item=user_item("What is the capital of France?"))
            await conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 8})
            done = await until("response.done")
            types = [e.type for e in events]
            assert done.type == "response.done" and done.response.status in ENDED, types
            # Its own settings, the session's where it set none, in the GA shape; then the limits.
            started = next(e for e in events if e.type == "response.created").response
            for response in (started, done.response):
                assert (response.output_modalities, response.max_output_tokens) == (["text"], 8)
                assert response.audio.output.voice == created.session.audio.output.voice
                assert response.audio.output.format.type == "audio/pcm" and response.audio.output.format.rate == RATE
            limits = await until("rate_limits.updated")
            assert [limit.name for limit in limits.rate_limits] == ["requests", "tokens"]
            assert limits.rate_limits[1].limit == server["llm"].max_model_len
            assert "temperature" not in done.response.model_dump()  # (GA's response has none)
            assert "conversation.item.added" in types and "response.output_text.delta" in types, types
            assert not {"conversation.item.created", "response.text.delta"} & set(types)
            await conn.session.update(session={"voice": "alloy"})  # type: ignore[typeddict-unknown-key]
            err = await until("session.updated")
            assert err.type == "error" and "audio.output.voice" in err.error.message

    run(go())


def test_a_beta_client_is_told_of_its_conversation(server: dict[str, Any]) -> None:
    """``openai``'s beta client (the ``OpenAI-Beta: realtime=v1`` header) gets
    ``conversation.created`` after ``session.created``, with the id its responses name, and so
    does a browser's (the subprotocol ``openai-beta.realtime-v1``); a GA client does not."""
    openai = pytest.importorskip("openai")

    async def first_events(connect: Any) -> list[Any]:
        async with connect(model="smollm2") as conn:
            await conn.session.update(session={"instructions": "Be brief."})
            events = []
            async for ev in conn:
                events.append(ev)
                if ev.type in ("session.updated", "error"):
                    return events
        raise AssertionError("connection closed")

    async def go() -> None:
        http = server["http"] + "/v1"
        client = openai.AsyncOpenAI(base_url=http, websocket_base_url=http.replace("http", "ws", 1), api_key="unused")
        beta = await asyncio.wait_for(first_events(client.beta.realtime.connect), 30)
        assert [e.type for e in beta] == ["session.created", "conversation.created", "session.updated"]
        assert beta[1].conversation.id.startswith("conv_") and beta[1].conversation.object == "realtime.conversation"
        ga = await asyncio.wait_for(first_events(client.realtime.connect), 30)
        assert [e.type for e in ga] == ["session.created", "session.updated"]
        browser = ["realtime", "openai-beta.realtime-v1"]  # (a browser can set no header)
        async with websockets.connect(server["url"], subprotocols=browser) as ws:  # type: ignore[arg-type]
            c = Client(ws)
            created = await c.until("conversation.created", timeout=10)
            assert c.types()[:2] == ["session.created", "conversation.created"] and created["conversation"]["id"]

    run(go())


def test_a_whole_recording_in_one_append_is_one_turn(server: dict[str, Any]) -> None:
    """Server VAD over a single append holding the question and its trailing silence."""

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await text_session(c, 4)
            await c.send("input_audio_buffer.append", audio=base64.b64encode(server["question"]).decode())
            done = await c.until("conversation.item.input_audio_transcription.completed")
            assert "capital" in done["transcript"].lower() and "france" in done["transcript"].lower()
            await c.until("response.done")
            # transcription null: no transcription events, but the turn is heard and answered
            await c.send("session.update", session={"input_audio_transcription": None})
            await c.until("session.updated")
            first = len(c.events)
            await c.send("input_audio_buffer.append", audio=base64.b64encode(server["question"]).decode())
            done = await c.until("response.done")
            assert done["response"]["status"] in ENDED and done["response"]["output"]
            assert not [t for t in c.types()[first:] if "input_audio_transcription" in t], c.types()[first:]

    run(go())


def hears(server: dict[str, Any], audio: np.ndarray, rate: int, said: str) -> None:
    """Whisper (the server's ``/v1/audio/transcriptions``) hears in ``audio`` at least half the
    words of ``said``: the audio is what it claims to be."""
    from modalities.audio import encode_audio

    files = {"file": ("reply.wav", encode_audio(audio, rate, "wav"), "audio/wav")}
    heard = httpx.post(server["http"] + "/v1/audio/transcriptions", files=files, data={"model": "whisper-tiny.en"})
    assert heard.status_code == 200, heard.text
    words = set(re.findall(r"[a-z]+", said.lower()))
    assert said and len(words & set(re.findall(r"[a-z]+", heard.json()["text"].lower()))) >= len(words) / 2, (
        said,
        heard.text,
    )


def test_a_telephone_session_speaks_g711_at_8_khz(server: dict[str, Any]) -> None:
    """A phone gateway's session: the question comes as G.711 mu-law at 8 kHz and is heard; the
    reply's audio leaves as A-law at 8 kHz, and Whisper hears in it the words the reply says."""
    from modalities import g711
    from modalities.audio import from_pcm16, resample

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await c.until("session.created")
            formats = {"input_audio_format": "g711_ulaw", "output_audio_format": "g711_alaw"}
            await c.send("session.update", session={**formats, "temperature": 0, "max_response_output_tokens": 16})
            updated = await c.until("session.updated")
            assert {k: updated["session"][k] for k in formats} == formats
            phone = g711.encode(resample(from_pcm16(server["question"]), RATE, 8000), "ulaw")
            await c.send("input_audio_buffer.append", audio=base64.b64encode(phone).decode())
            done = await c.until("response.done")
            assert_voice_turn(c, done)
            reply = b"".join(base64.b64decode(e["delta"]) for e in c.events if e["type"] == "response.audio.delta")
            said = done["response"]["output"][0]["content"][0]["transcript"]
            assert len(reply) / 8000 > 0.5 and said
            hears(server, g711.decode(reply, "alaw"), 8000, said)

            # One response in a format of its own: pcm16 at 24 kHz.
            c.events.clear()
            await c.send("conversation.item.create", item=user_item("And of Italy?"))
            await c.send("response.create", response={"output_audio_format": "pcm16"})
            done = await c.until("response.done")
            reply = b"".join(base64.b64decode(e["delta"]) for e in c.events if e["type"] == "response.audio.delta")
            hears(server, from_pcm16(reply), RATE, done["response"]["output"][0]["content"][0]["transcript"])

            await c.send("session.update", session={"output_audio_format": "pcm8"})
            err = await c.until("error")
            assert err["error"]["param"] == "session.output_audio_format" and "g711_alaw" in err["error"]["message"]

    run(go())


def test_items_can_be_deleted_from_the_conversation(server: dict[str, Any]) -> None:
    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await text_session(c, 4)
            text = "Remember the secret word: pineapple. " * 8
            item = user_item(text)
            await c.send("conversation.item.create", item=item)
            created = await c.until("conversation.item.created")
            await c.send("conversation.item.delete", item_id=created["item"]["id"])
            deleted = await c.until("conversation.item.deleted")
            assert deleted["item_id"] == created["item"]["id"]
            await c.send("conversation.item.delete", item_id=created["item"]["id"])
            err = await c.until("error")
            assert err["error"]["code"] == "item_not_found" and err["error"]["param"] == "item_id"
            short = user_item("Hi!")
            await c.send("conversation.item.create", item=short)
            await c.send("response.create")
            done = await c.until("response.done")
            assert done["response"]["usage"]["input_tokens"] < 40  # the long item is not in the prompt

    run(go())


def test_a_response_create_sets_its_own_modalities_limit_temperature_and_voice(server: dict[str, Any]) -> None:
    """Per reply, in a text session: audio asked for is spoken, the token limit and temperature
    hold for that reply only; values the session would refuse are refused here too."""

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await text_session(c, 12)
            await c.send("conversation.item.create", item=user_item("Tell me about the sea."))
            await c.until("conversation.item.created")
            first = len(c.events)
            spoken = {"modalities": ["audio", "text"], "max_response_output_tokens": 3, "voice": "alloy"}
            await c.send("response.create", response={**spoken, "temperature": 0})
            done = await c.until("response.done")
            assert done["response"]["status"] == "incomplete" and done["response"]["usage"]["output_tokens"] <= 3
            assert done["response"]["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
            kinds = c.types()[first:]
            assert "response.audio.delta" in kinds and "response.audio_transcript.delta" in kinds, kinds
            first = len(c.events)
            await c.send("response.create", response={"conversation": "none"})  # the session's again
            done = await c.until("response.done")
            assert 3 < done["response"]["usage"]["output_tokens"] <= 12
            assert "response.text.delta" in c.types()[first:] and "response.audio.delta" not in c.types()[first:]
            for bad, param in (
                ({"temperature": 9}, "response.temperature"),
                ({"max_response_output_tokens": 0}, "response.max_response_output_tokens"),
                ({"voice": "nobody"}, "response.voice"),
                ({"voice": 5}, "response.voice"),
            ):
                await c.send("response.create", response=bad)
                assert (await c.until("error"))["error"]["param"] == param, bad
            await c.send("response.create", response={"max_response_output_tokens": "inf"})
            assert (await c.until("response.done"))["response"]["status"] == "completed"

    run(go())


def test_an_out_of_band_response_stays_out_of_the_conversation(server: dict[str, Any]) -> None:
    """Out-of-band replies and per-response context (input, instructions) leave the conversation as it was."""
    from pipelines.conversation import DEFAULT_INSTRUCTIONS, Conversation

    tokenizer = server["llm"].tokenizer

    def prompt_tokens(instructions: str, *user_texts: str) -> int:
        conv = Conversation(instructions)
        for text in user_texts:
            conv.add("user", text)
        return len(conv.prompt_ids(tokenizer))

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await text_session(c, 6)
            said = "My favourite colour is green."
            await c.send("conversation.item.create", item=user_item(said))
            ref = {"type": "item_reference", "id": (await c.until("conversation.item.created"))["item"]["id"]}
            question = "Did I name a colour?"
            response = {"conversation": "none", "metadata": {"purpose": "check"}, "instructions": "Answer yes or no."}
            await c.send("response.create", response={**response, "input": [ref, user_item(question)]})
            done = await c.until("response.done")
            assert done["response"]["status"] in ENDED and done["response"]["metadata"] == {"purpose": "check"}
            assert done["response"]["conversation_id"] is None  # out of band
            # Its prompt: its own instructions and input, nothing else.
            assert done["response"]["usage"]["input_tokens"] == prompt_tokens("Answer yes or no.", said, question)
            oob = done["response"]["output"][0]
            assert oob["content"][0]["text"]
            assert not any(e["type"] == "conversation.item.created" and e["item"]["id"] == oob["id"] for e in c.events)
            await c.send("conversation.item.retrieve", item_id=oob["id"])
            assert (await c.until("error"))["error"]["code"] == "item_not_found"

            await c.send("response.create", response={"conversation": "elsewhere"})
            assert (await c.until("error"))["error"]["param"] == "response.conversation"
            await c.send("response.create", response={"input": [{"type": "item_reference", "id": "item_nope"}]})
            err = await c.until("error")
            assert err["error"]["code"] == "item_not_found" and err["error"]["param"] == "response.input[0].id"

            # The conversation did not change: the next reply's prompt is the user's item alone,
            # under that reply's own instructions.
            await c.send("response.create", response={"instructions": "Answer in one word."})
            done = await c.until("response.done")
            assert done["response"]["usage"]["input_tokens"] == prompt_tokens("Answer in one word.", said)
            assert done["response"]["metadata"] is None
            assert done["response"]["conversation_id"].startswith("conv_")
            reply = done["response"]["output"][0]["content"][0]["text"]

            # After another out-of-band reply, the latest reply in the conversation is still the
            # one a client truncates; the out-of-band item is not.
            in_band = done["response"]["output"][0]["id"]
            await c.send("response.create", response={"conversation": "none"})
            oob = (await c.until("response.done"))["response"]["output"][0]["id"]
            await c.send("conversation.item.truncate", item_id=oob, content_index=0, audio_end_ms=0)
            assert (await c.until("error"))["error"]["code"] == "item_not_found"
            await c.send("conversation.item.truncate", item_id=in_band, content_index=0, audio_end_ms=0)
            assert (await c.until("conversation.item.truncated"))["item_id"] == in_band

            # Those instructions were that reply's only: the next one is under the session's.
            await c.send("response.create")
            done = await c.until("response.done")
            expected = Conversation(DEFAULT_INSTRUCTIONS)
            expected.add("user", said)
            expected.add("assistant", reply)
            assert done["response"]["usage"]["input_tokens"] == len(expected.prompt_ids(tokenizer))

    run(go())


def test_barge_in_aborts_the_engine_and_truncates(server: dict[str, Any]) -> None:
    llm, tts = server["llm"], server["tts"]

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await c.until("session.created")
            await c.send("session.update", session={"temperature": 0, "max_response_output_tokens": 400})
            story = "Tell me a very long story about a dragon and a knight."
            item = user_item(story)
            await c.send("conversation.item.create", item=item)
            await c.send("response.create")
            first = await c.until("response.audio.delta")
            rid, item_id = first["response_id"], first["item_id"]
            feeder = asyncio.create_task(c.stream(server["question"]))  # the user talks over the reply
            await c.until("input_audio_buffer.speech_started")
            truncated = await c.until("conversation.item.truncated")
            cancelled = await c.until("response.done", response__id=rid)
            generated = llm.stats()["generation_tokens_total"]
            assert cancelled["response"]["status"] == "cancelled"
            assert cancelled["response"]["status_details"]["reason"] == "turn_detected"
            usage = cancelled["response"]["usage"]  # (what it took until cut: the prompt, the tokens sent)
            assert usage["input_tokens"] > 10 and 0 < usage["output_tokens"] < 400, usage
            assert truncated["item_id"] == item_id
            sent_ms = sum(len(base64.b64decode(e["delta"])) for e in c.events if e["type"] == "response.audio.delta")
            assert truncated["audio_end_ms"] <= sent_ms / 2 / RATE * 1000 + 1
            heard = cancelled["response"]["output"][0]["content"][0]["transcript"]
            streamed = "".join(e["delta"] for e in c.events if e["type"] == "response.audio_transcript.delta")
            assert len(heard) < len(streamed) and streamed.startswith(heard.split(" ")[0] if heard else "")
            # The part is closed as OpenAI closes an interrupted one, with what was heard.
            closing = [e for e in c.events if e.get("response_id") == rid and e["type"].endswith(".done")]
            assert [e["type"] for e in closing] == [
                "response.audio.done",
                "response.audio_transcript.done",
                "response.content_part.done",
                "response.output_item.done",
            ]
            assert closing[1]["transcript"] == heard == closing[2]["part"]["transcript"]
            await c.send("conversation.item.retrieve", item_id=item_id)
            got = (await c.until("conversation.item.retrieved"))["item"]
            assert got["status"] == "incomplete" and got["content"][0]["transcript"] == heard
            await asyncio.sleep(0.5)
            stats = llm.stats()
            assert stats["num_running"] == 0  # the decode was aborted inside the engine
            assert stats["generation_tokens_total"] - generated <= 2
            assert generated < 400
            assert tts.stats()["tts_requests_active"] == 0  # and the synthesis was closed
            # The user's turn goes on: transcribed, answered; cancel that answer by event.
            await c.until("conversation.item.input_audio_transcription.completed")
            created = await c.until("response.created")
            await c.send("response.cancel")
            done = await c.until("response.done", response__id=created["response"]["id"])
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"]["reason"] == "client_cancelled"
            if done["response"]["output"]:  # its message was opened: its part is closed too
                kinds = [e["type"] for e in c.events if e.get("response_id") == created["response"]["id"]]
                assert "response.content_part.done" in kinds and "response.audio_transcript.done" in kinds
            await feeder

    run(go())


def test_with_interrupt_response_off_the_reply_plays_out_then_the_turn_is_answered(server: dict[str, Any]) -> None:
    """``turn_detection.interrupt_response: false``: the user speaking over a reply does not
    cancel or truncate it; their turn is answered once it is done."""

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await c.until("session.created")
            td = {"type": "server_vad", "interrupt_response": False}
            await c.send(
                "session.update", session={"temperature": 0, "max_response_output_tokens": 8, "turn_detection": td}
            )
            assert (await c.until("session.updated"))["session"]["turn_detection"]["interrupt_response"] is False
            await c.send(
                "conversation.item.create", item=user_item("Tell me a very long story about a dragon and a knight.")
            )
            await c.send("response.create", response={"max_response_output_tokens": 60})  # (the turn's: 8)
            rid = (await c.until("response.audio.delta"))["response_id"]
            await c.stream(server["question"])  # the user talks over the reply
            first = await c.until("response.done", response__id=rid)
            assert c.index("input_audio_buffer.speech_started") < c.events.index(first)  # ... while it played
            assert first["response"]["status"] in ENDED
            # the transcript is sent once heard, not after the reply it was spoken over
            assert c.index("conversation.item.input_audio_transcription.completed") < c.events.index(first)
            second = await c.until("response.done")
            assert second["response"]["status"] in ENDED and second["response"]["id"] != rid
            assert "conversation.item.truncated" not in c.types()

    run(go())


def test_a_reply_calls_a_function_and_the_client_sends_its_output(
    server: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session tools on the real SmolLM2, first with its own template (which cannot show tools:
    refused), then with mmserve's ChatML template with tools. Two calls the client adds to the
    conversation teach the model the format; asked about a third city it calls the function
    itself: its own output item, its arguments streamed, the call in ``response.done``; the client then
    adds the function's output."""
    from modalities.llm.tools import CHATML_TOOLS

    weather = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }

    def call(city: str, k: int) -> dict[str, Any]:
        args = json.dumps({"city": city})
        return {"type": "function_call", "call_id": f"call_{k}", "name": "get_weather", "arguments": args}

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await text_session(c, 40)
            await c.send("session.update", session={"tools": [weather]})
            assert (await c.until("error"))["error"]["param"] == "session.tools"  # its own template
            monkeypatch.setattr(server["llm"].tokenizer, "chat_template", CHATML_TOOLS.read_text())
            unknown = {"type": "function", "name": "get_time"}  # not among the tools
            await c.send("session.update", session={"tools": [weather], "tool_choice": unknown})
            assert (await c.until("error"))["error"]["param"] == "session.tool_choice"
            await c.send("session.update", session={"tools": [weather], "temperature": 0})
            updated = await c.until("session.updated", session__tool_choice="auto")
            assert updated["session"]["tools"] == [weather]
            for k, city in enumerate(["Paris", "Rome"]):
                await c.send("conversation.item.create", item=user_item(f"Weather in {city}?"))
                await c.send("conversation.item.create", item=call(city, k))
            await c.send("conversation.item.create", item=user_item("Weather in Oslo?"))
            await c.send("response.create")
            done = await c.until("response.done")
            assert done["response"]["status"] == "completed", done
            [fn] = done["response"]["output"]  # a call alone: no message item (as OpenAI's)
            assert fn["type"] == "function_call" and fn["name"] == "get_weather" and fn["status"] == "completed"
            assert json.loads(fn["arguments"]) == {"city": "Oslo"}
            args = next(e for e in c.events if e["type"] == "response.function_call_arguments.done")
            assert (args["item_id"], args["call_id"], args["output_index"]) == (fn["id"], fn["call_id"], 0)
            deltas = [e["delta"] for e in c.events if e["type"] == "response.function_call_arguments.delta"]
            assert len(deltas) > 3 and "".join(deltas) == fn["arguments"]  # streamed as written
            added = [e["item"]["type"] for e in c.events if e["type"] == "response.output_item.added"]
            assert added == ["function_call"]
            created = [e for e in c.events if e["type"] == "conversation.item.created"]
            assert created[-1]["item"]["id"] == fn["id"]  # after the question, not after a message never sent
            assert created[-1]["previous_item_id"] == created[-2]["item"]["id"]
            assert not any("<tool_call>" in e.get("delta", "") for e in c.events)  # not sent as text
            await c.send("conversation.item.retrieve", item_id=fn["id"])
            assert (await c.until("conversation.item.retrieved"))["item"] == fn
            output = {"type": "function_call_output", "call_id": fn["call_id"], "output": '{"celsius": 21}'}
            await c.send("conversation.item.create", item=output)
            created = await c.until("conversation.item.created", item__type="function_call_output")
            assert created["previous_item_id"] == fn["id"] and created["item"]["output"] == '{"celsius": 21}'
            # a response's own tool_choice: checked; "required" makes a call (a grammar holds the
            # tokens to one); "none" shows the model no tools (no call parsed)
            await c.send("response.create", response={"tool_choice": unknown})
            assert (await c.until("error"))["error"]["param"] == "response.tool_choice"
            await c.send("response.create", response={"tool_choice": "required"})
            done = await c.until("response.done")
            [fn] = done["response"]["output"]
            assert fn["type"] == "function_call" and fn["name"] == "get_weather"
            assert isinstance(json.loads(fn["arguments"])["city"], str)
            await c.send("response.create", response={"tool_choice": "none"})
            done = await c.until("response.done")
            assert [i["type"] for i in done["response"]["output"]] == ["message"]

    run(go())


def test_a_replys_text_then_its_call_and_a_cancelled_call() -> None:
    """Session state only: a reply's message is done before its call's item is added (output
    indexes 0 and 1), the call's arguments stream, and the conversation renders the two as one
    assistant turn; a reply cancelled after its call was made but before the client heard of it
    leaves no call behind; one cancelled while its call is written leaves it, incomplete."""
    from pipelines.frames import (
        Interrupt,
        LLMDone,
        LLMStarted,
        TextDelta,
        ToolCall,
        ToolCallArguments,
        ToolCallStarted,
        TTSDone,
    )
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        await s._handle(json.dumps({"type": "session.update", "session": {"modalities": ["text"]}}))
        reply = s.conv.add("assistant", "Let me check.")
        call = s.conv.add("assistant", "{}", kind="function_call", call_id="c1", name="f", response_id="resp_1")
        sent.clear()
        await s._on_frame(LLMStarted("resp_1", item_id=reply.id, calls=True))
        assert [e["type"] for e in sent] == ["response.created"]  # no message yet: it may be a call alone
        for frame in (
            TextDelta("resp_1", "Let me check."),
            ToolCallStarted("resp_1", call.id, "c1", "f"),
            ToolCallArguments("resp_1", call.id, "{"),
            ToolCallArguments("resp_1", call.id, "}"),
            ToolCall("resp_1", call.id, "c1", "f", "{}"),
        ):
            await s._on_frame(frame)
        deltas = [e["delta"] for e in sent if e["type"] == "response.function_call_arguments.delta"]
        assert (
            deltas == ["{", "}"] and [e for e in sent if e["type"].endswith("arguments.done")][0]["arguments"] == "{}"
        )
        await s._on_frame(LLMDone("resp_1", "Let me check."))
        await s._on_frame(TTSDone("resp_1"))
        order = [(e["type"], e.get("output_index")) for e in sent if e["type"].startswith("response.output_item")]
        assert order == [("response.output_item.added", 0), ("response.output_item.done", 0)] + [
            ("response.output_item.added", 1),
            ("response.output_item.done", 1),
        ]
        assert [i["type"] for i in sent[-1]["response"]["output"]] == ["message", "function_call"]
        tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        assert s.conv.messages()[1:] == [{"role": "assistant", "content": "Let me check.", "tool_calls": [tool_call]}]
        # a call made, its frame dropped by a cancel: it leaves the conversation with its reply
        reply = s.conv.add("assistant")
        late = s.conv.add("assistant", "{}", kind="function_call", call_id="c2", name="f", response_id="resp_2")
        await s._on_frame(LLMStarted("resp_2", item_id=reply.id, calls=True))
        await s._on_frame(Interrupt("client_cancelled"))
        assert sent[-1]["response"]["status"] == "cancelled" and s.conv.get(late.id) is None
        assert sent[-1]["response"]["output"] == [] and s.conv.get(reply.id) is None  # no empty message either
        # cancelled while its call is written: the client was told of it, so it stays, incomplete
        reply = s.conv.add("assistant")
        cut = s.conv.add("assistant", '{"x": 1', kind="function_call", call_id="c3", name="f", response_id="resp_3")
        await s._on_frame(LLMStarted("resp_3", item_id=reply.id, calls=True))
        await s._on_frame(ToolCallStarted("resp_3", cut.id, "c3", "f"))
        await s._on_frame(ToolCallArguments("resp_3", cut.id, '{"x": 1'))
        await s._on_frame(Interrupt("client_cancelled"))
        [out] = sent[-1]["response"]["output"]
        assert out["status"] == "incomplete" and out["arguments"] == '{"x": 1' and sent[-2]["item"] == out
        assert s.conv.get(cut.id) is not None and s.conv.get(cut.id).status == "incomplete"
        assert not any(m.get("tool_calls") and m["tool_calls"][0]["id"] == "c3" for m in s.conv.messages())  # unsaid
        await s._handle(json.dumps({"type": "conversation.item.retrieve", "item_id": cut.id}))
        assert sent[-1]["item"]["status"] == "incomplete"
        # cut at max_output_tokens while its call is written: the call and the response are incomplete
        reply = s.conv.add("assistant")
        cut = s.conv.add("assistant", '{"x"', kind="function_call", call_id="c4", name="f", response_id="resp_4")
        for frame in (
            LLMStarted("resp_4", item_id=reply.id, calls=True),
            ToolCallStarted("resp_4", cut.id, "c4", "f"),
            ToolCallArguments("resp_4", cut.id, '{"x"'),
            LLMDone("resp_4", "", cut=True),
            TTSDone("resp_4"),
        ):
            await s._on_frame(frame)
        done = sent[-1]["response"]
        assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens"
        assert [(o["status"], o["arguments"]) for o in done["output"]] == [("incomplete", '{"x"')]

    run(go())


def test_response_input_renders_function_items() -> None:
    """Session state only: ``response.input`` may reference a function call in the conversation
    and give a function's output inline; both render as the template's tool messages."""
    from pipelines.realtime_events import EventError
    from pipelines.realtime_items import response_items
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        call = {"type": "function_call", "id": "fc", "call_id": "c1", "name": "f", "arguments": "{}"}
        await s._handle(json.dumps({"type": "conversation.item.create", "item": call}))
        assert sent[-1]["item"] == {**call, "object": "realtime.item", "status": "completed"}
        output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
        items = response_items([{"type": "item_reference", "id": "fc"}, output], s.conv)
        tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        assert [i.message() for i in items] == [
            {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]
        with pytest.raises(EventError) as err:
            response_items([{"type": "function_call_output", "call_id": "c1"}], s.conv)
        assert err.value.param == "response.input[0].output"

    run(go())


def test_bad_events_get_errors_and_the_session_goes_on(server: dict[str, Any]) -> None:
    bad = [
        "not json",
        json.dumps([1, 2]),
        json.dumps({"type": "no.such.event"}),
        json.dumps({"type": "input_audio_buffer.append", "audio": "@@@"}),
        json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}),
        json.dumps({"type": "session.update", "session": {"modalities": ["video"]}}),
        json.dumps({"type": "session.update", "session": {"modalities": ["audio"]}}),
        json.dumps({"type": "session.update", "session": {"turn_detection": {"type": "server_vad", "threshold": 7}}}),
        json.dumps(
            {"type": "session.update", "session": {"turn_detection": {"type": "server_vad", "eagerness": "low"}}}
        ),
        json.dumps(
            {
                "type": "session.update",
                "session": {"turn_detection": {"type": "semantic_vad", "silence_duration_ms": 9}},
            }
        ),
        json.dumps({"type": "session.update", "session": {"input_audio_format": "opus"}}),
        json.dumps({"type": "session.update", "session": {"output_audio_format": {"type": "audio/pcmu"}}}),
        json.dumps({"type": "response.create", "response": {"output_audio_format": "mp3"}}),
        json.dumps({"type": "response.create", "response": []}),
        json.dumps({"type": "input_audio_buffer.commit"}),
        json.dumps({"type": "response.cancel"}),
        json.dumps({"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0, "audio_end_ms": 0}),
        json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": []}}),
        b"\x00\x01 a binary frame",
        json.dumps({"type": "session_update", "session": {}}),  # no alias of session.update
        json.dumps({"type": "session.update", "session": {"modalities": [["text"]]}}),
        json.dumps({"type": "session.update", "session": {"voice": "nobody"}}),
        json.dumps({"type": "session.update", "session": {"instructions": "Say \ud800"}}),
        json.dumps({"type": "session.update", "session": {"include": ["item.input_audio_transcription.tokens"]}}),
        json.dumps({"type": "conversation.item.create", "item": user_item("Say \ud800 hello.")}),
    ]

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await c.until("session.created")
            for raw in bad:
                await ws.send(raw)
                err = await c.until("error")
                assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
            # Still usable: manual turns, text-only replies.
            session = {
                "turn_detection": None,
                "modalities": ["text"],
                "temperature": 0,
                "max_response_output_tokens": 8,
                "voice": "alloy",  # OpenAI's names play the default voice
            }
            await c.send("session.update", session=session)
            updated = await c.until("session.updated")
            assert updated["session"]["turn_detection"] is None
            await c.stream(server["question"], pace=0.0)
            await c.send("input_audio_buffer.commit")
            committed = await c.until("input_audio_buffer.committed")
            text = await c.until("conversation.item.input_audio_transcription.completed")
            assert text["item_id"] == committed["item_id"] and "france" in text["transcript"].lower()
            assert "input_audio_buffer.speech_started" not in c.types()
            await c.send("response.create")
            done = await c.until("response.done")
            assert done["response"]["status"] in ENDED
            assert "response.text.delta" in c.types() and "response.audio.delta" not in c.types()
            assert c.index("response.text.done") < c.index("response.done")

    run(go())


def test_a_refused_reply_fails_and_the_next_turn_works(server: dict[str, Any]) -> None:
    """Instructions too long for the model: the engine refuses the request, the response ends as
    failed (not active forever) and a later turn with short instructions completes."""
    session = {"turn_detection": None, "modalities": ["text"], "temperature": 0, "max_response_output_tokens": 8}
    huge = "\U0001f600" * 16_000  # several tokens per character: far past the 8k context

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await c.until("session.created")
            await c.send("session.update", session={**session, "instructions": "x" * 16_385})
            err = await c.until("error")
            assert err["error"]["code"] == "string_above_max_length"
            await c.send("session.update", session={**session, "instructions": huge})
            await c.until("session.updated")
            await c.send("response.create")
            err = await c.until("error")
            assert "maximum context length" in err["error"]["message"]
            failed = await c.until("response.done")
            assert failed["response"]["status"] == "failed"
            await c.send("session.update", session={"instructions": "Answer briefly."})
            await c.until("session.updated")
            item = user_item(QUESTION)
            await c.send("conversation.item.create", item=item)
            await c.until("conversation.item.created")
            await c.send("response.create")
            done = await c.until("response.done")
            assert done["response"]["status"] in ENDED and done["response"]["usage"]["output_tokens"] > 0

    run(go())


def test_a_response_cancelled_before_it_started_ends_cancelled(server: dict[str, Any]) -> None:
    """response.cancel right behind response.create: the request is still on its way to the LLM;
    it ends at once, and a response.create right behind the cancel is the session's next reply."""

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await text_session(c, 200)
            await c.send("conversation.item.create", item=user_item("Tell me a long story about a dragon."))
            await c.send("response.create")
            await c.send("response.cancel")
            await c.send("response.create", response={"max_response_output_tokens": 4})  # (a short reply)
            done = await c.until("response.done")
            assert done["response"]["status"] == "cancelled", done
            assert done["response"]["status_details"]["reason"] == "client_cancelled"
            assert all(o["status"] == "incomplete" for o in done["response"]["output"])  # (none if not started)
            second = await c.until("response.done")
            assert second["response"]["status"] in ENDED and second["response"]["id"] != done["response"]["id"]
            assert "error" not in c.types()
            assert len([e for e in c.events if e["type"] == "response.created"]) == 2  # (the first's start unseen)

    run(go())


def test_a_user_item_too_long_for_the_context_is_refused_not_dropped(server: dict[str, Any]) -> None:
    """The reply fails: an error naming the response.create, and a failed response.done that
    says why (OpenAI's status_details.error)."""

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await text_session(c, 8)
            await c.send("conversation.item.create", item=user_item("hello " * 12_000))  # > 8k tokens
            await c.send("response.create", event_id="evt_long")
            err = await c.until("error")
            assert err["error"]["code"] == "context_length_exceeded"
            assert err["error"]["type"] == "invalid_request_error"
            assert err["error"]["event_id"] == "evt_long"
            done = (await c.until("response.done"))["response"]
            assert done["status"] == "failed"
            assert done["status_details"] == {
                "type": "failed",
                "error": {"type": "invalid_request_error", "code": "context_length_exceeded"},
            }

    run(go())


def test_a_huge_item_is_judged_by_its_length_and_holds_no_other_session(server: dict[str, Any]) -> None:
    """A 5 MB user item: refused by its length alone (a render would tokenize it on the event
    loop: ~5 s here during which every other session and request waited); once an older item,
    it is left out of later prompts unrendered."""

    async def go() -> None:
        async with (
            websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws,
            websockets.connect(server["url"], max_size=None, additional_headers=BETA) as other_ws,
        ):
            c, other = Client(ws), Client(other_ws)
            await text_session(c, 4)
            await other.until("session.created")
            await c.send("conversation.item.create", item=user_item("hello world, " * 400_000))
            await c.send("response.create")
            waits = []
            for _ in range(5):  # the other session's round trips meanwhile
                t0 = time.monotonic()
                await other.send("session.update", session={"temperature": 0.7})
                await other.until("session.updated")
                waits.append(time.monotonic() - t0)
            err = await c.until("error")
            assert (
                err["error"]["code"] == "context_length_exceeded" and "characters, at least" in err["error"]["message"]
            )
            assert (await c.until("response.done"))["response"]["status"] == "failed"
            assert max(waits) < 2.0, waits
            await c.send("conversation.item.create", item=user_item("Say hi."))
            await c.send("response.create")
            assert (await c.until("response.done"))["response"]["status"] in ENDED

    run(go())


def test_an_append_of_up_to_15_mib_fits_one_frame(server: dict[str, Any]) -> None:
    """uvicorn's default frame limit (16 MiB) would close the socket at ~12 MiB of base64 audio."""

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await manual_session(c)
            await c.send("input_audio_buffer.append", audio=base64.b64encode(bytes(14 << 20)).decode())
            await c.send("input_audio_buffer.clear")
            await c.until("input_audio_buffer.cleared")
            await c.send("input_audio_buffer.append", audio=base64.b64encode(bytes(31 << 19)).decode())  # 15.5 MiB
            err = await c.until("error")
            assert err["error"]["param"] == "audio" and "too large" in err["error"]["message"]
            assert [e["type"] for e in c.events].count("error") == 1

    run(go())


def test_an_append_over_the_frame_size_of_a_15_mib_one_is_refused_not_cut_off(server: dict[str, Any]) -> None:
    """An append larger than the largest one (a 20 MiB recording: ~27 MiB of base64) is read and
    refused with an ``error`` event, the session going on; only a frame over the transport's
    bound (``WS_MAX_BYTES``, 32 MiB) closes the socket, with 1009 (message too big)."""
    from pipelines.realtime_events import WS_MAX_BYTES

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await manual_session(c)
            await c.send("input_audio_buffer.append", event_id="big", audio=base64.b64encode(bytes(20 << 20)).decode())
            err = await c.until("error")
            assert (err["error"]["type"], err["error"]["param"]) == ("invalid_request_error", "audio")
            assert "too large" in err["error"]["message"] and err["error"]["event_id"] == "big"
            await c.send("input_audio_buffer.clear")  # the session goes on
            await c.until("input_audio_buffer.cleared")
            await ws.send("x" * (WS_MAX_BYTES + 1))
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                await c.until("never")
            assert ws.close_code == 1009

    run(go())


def test_input_audio_buffer_is_capped_at_15_mib(server: dict[str, Any]) -> None:
    chunk = base64.b64encode(bytes(4 << 20)).decode()  # 4 MiB of pcm16 silence (~87 s)

    async def go() -> None:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await manual_session(c)
            for _ in range(4):  # the fourth goes past 15 MiB
                await c.send("input_audio_buffer.append", audio=chunk)
            err = await c.until("error")
            assert err["error"]["code"] == "input_audio_buffer_full"
            await c.send("input_audio_buffer.clear")
            await c.until("input_audio_buffer.cleared")
            assert [e for e in c.events if e["type"] == "error"] == [err]

    run(go())


def test_input_audio_is_charged_to_the_tenant(tiny_model_dir: Any) -> None:
    """Input audio pays from the tenant's ``audio_seconds`` budget: over it, the chunk is dropped
    with a ``rate_limit_exceeded`` error event and the session stays usable. A chunk the full
    buffer refuses is not charged."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from gateway.app import create_app
    from gateway.auth import KeyStore, hash_key
    from modalities.asr.engine import AsrConfig, AsrEngine
    from pipelines.plugin import router

    keys = KeyStore()
    keys.add_tenant("small", [hash_key("k-small")], {"audio_seconds": 440})
    llm = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir("llama"))))
    asr = AsrEngine.from_config(AsrConfig(max_num_seqs=1))
    app = create_app({"tiny": llm, asr.model_name: asr}, routers=[router], keys=keys)
    chunk = base64.b64encode(bytes(RATE * 2 * 100)).decode()  # 100 s of pcm16 silence

    async def go(ws_url: str) -> None:
        protocols = ["realtime", "openai-insecure-api-key.k-small"]
        async with websockets.connect(ws_url, max_size=None, subprotocols=protocols, additional_headers=BETA) as ws:
            c = Client(ws)
            await manual_session(c)
            for _ in range(4):  # 300 s buffered, then the buffer (328 s) refuses the fourth
                await c.send("input_audio_buffer.append", audio=chunk)
            full = await c.until("error")
            assert full["error"]["code"] == "input_audio_buffer_full"
            await c.send("input_audio_buffer.clear")
            await c.until("input_audio_buffer.cleared")
            await c.send("input_audio_buffer.append", audio=chunk)  # 400 of 440 s: accepted
            await c.send("input_audio_buffer.append", audio=chunk)  # 500 s > budget (+ its refill): dropped
            err = await c.until("error")
            assert err["error"]["code"] == "rate_limit_exceeded"
            assert "retry after" in err["error"]["message"]
            await c.send("input_audio_buffer.clear")
            await c.until("input_audio_buffer.cleared")
            assert [e for e in c.events if e["type"] == "error"] == [full, err]
        async with websockets.connect(ws_url, subprotocols=protocols[1:]) as ws:  # the key alone (a browser)
            assert ws.subprotocol == protocols[1] and json.loads(await ws.recv())["type"] == "session.created"

    with serve_app(app) as url:
        run(go(url.replace("http://", "ws://") + "/v1/realtime"))


@contextlib.contextmanager
def limited_llm(tiny_model_dir: Any, llm_tokens: float) -> Iterator[tuple[str, Any, Requests]]:
    """A server of the tiny LLM (chat completions and ``/v1/realtime``) whose tenant (key
    ``k-small``) has ``llm_tokens`` a minute: ``(base URL, app, the engine's requests)``. Every
    reply runs to its max tokens, so that what it uses is what it reserved."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from gateway.app import create_app
    from gateway.auth import KeyStore, hash_key
    from modalities.llm.api import router as llm_router
    from pipelines.plugin import router

    keys = KeyStore()
    keys.add_tenant("small", [hash_key("k-small")], {"llm_tokens": llm_tokens})
    llm = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir("llama"))))
    requests = Requests(llm, ignore_eos=True)
    llm.generate = requests.generate  # type: ignore[method-assign]
    app = create_app({"tiny": llm}, routers=[router, llm_router], keys=keys)
    with serve_app(app) as url:
        yield url, app, requests


KEYED = ["realtime", "openai-insecure-api-key.k-small"]  # (the key as a browser sends it)


def test_replies_are_charged_to_the_tenant_as_chat_completions_are(tiny_model_dir: Any) -> None:
    """A reply pays from the tenant's ``llm_tokens`` budget, the one chat completions pay from
    (prompt + max tokens at its start, settled to its usage), so a tenant at its limit on
    ``/v1/chat/completions`` is at it on ``/v1/realtime`` too. Over the limit the response fails
    as OpenAI's does (an ``error`` ``rate_limit_exceeded``, then ``response.done`` "failed" with
    it in ``status_details``), and the session and its conversation go on: a smaller reply fits
    and answers the conversation as it was."""
    limit = 1000.0

    async def go(url: str, app: Any, requests: Requests) -> None:
        headers = {"Authorization": "Bearer k-small"}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
        start = time.monotonic()
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
            resp = await http.post("/v1/chat/completions", json=chat)
        assert resp.status_code == 200, resp.text
        spent = resp.json()["usage"]["total_tokens"]  # ~530 of the 1000
        ws_url = url.replace("http://", "ws://") + "/v1/realtime"
        async with websockets.connect(ws_url, subprotocols=KEYED, additional_headers=BETA) as ws:  # type: ignore[list-item]
            c = Client(ws)
            await manual_session(c)
            await c.send("conversation.item.create", item=user_item("hello there"))
            await c.until("conversation.item.created")
            # ~30 + 900 (under the limit: not too large for it) > the ~470 left, and ~28 s of its refill
            await c.send("response.create", event_id="ask_1", response={"max_response_output_tokens": 900})
            err = await c.until("error")
            assert (err["error"]["type"], err["error"]["code"]) == ("rate_limit_error", "rate_limit_exceeded")
            assert err["error"]["event_id"] == "ask_1" and "small" in err["error"]["message"]
            failed = (await c.until("response.done"))["response"]
            assert failed["status"] == "failed" and failed["status_details"]["error"] == {
                "type": "rate_limit_error",
                "code": "rate_limit_exceeded",
            }
            assert len(requests.calls) == 1  # (the chat's: the refused reply never reached the engine)
            await c.send("response.create", response={"max_response_output_tokens": 16})  # fits
            done = (await c.until("response.done"))["response"]
            assert done["status"] == "incomplete" and "hello there" in requests.calls[-1]["prompt"]
            used = done["usage"]["total_tokens"]
        level = await app.state.ratelimiter.level("small:llm_tokens", limit)
        refilled = (time.monotonic() - start) * limit / 60
        assert limit - spent - used <= level <= limit - spent - used + refilled  # (the failed one took nothing)

    with limited_llm(tiny_model_dir, limit) as (url, app, requests):
        run(go(url, app, requests))


def test_rate_limits_report_the_tenants_budget_at_a_replys_start_and_end(tiny_model_dir: Any) -> None:
    """With a tenant limited in ``llm_tokens``, ``rate_limits.updated`` reports its budget: at the
    reply's start (after ``response.created``, before its first delta) with the reply's prompt and
    max tokens reserved, and right after ``response.done`` with what it used (a cancelled reply
    gives back the rest); ``requests`` stays the engine's waiting queue (tenants have no budget of
    requests)."""
    limit = 5000.0

    async def go(url: str, llm: Any) -> None:
        start = time.monotonic()
        async with websockets.connect(url.replace("http://", "ws://") + "/v1/realtime", subprotocols=KEYED) as ws:  # type: ignore[list-item]
            c = Client(ws)  # (GA: no beta header; the event's shape is the same)
            await c.until("session.created")
            await c.send("conversation.item.create", item=user_item("hello there"))
            await c.send("response.create", response={"output_modalities": ["text"], "max_output_tokens": 1500})
            reserved = await c.until("rate_limits.updated")
            await c.until("response.output_text.delta")
            await c.send("response.cancel")  # (1500 tokens take the tiny model seconds)
            done = (await c.until("response.done"))["response"]
            ended = await c.until("rate_limits.updated")
        refilled = (time.monotonic() - start) * limit / 60
        types = c.types()
        assert (
            types.index("response.created")
            < types.index("rate_limits.updated")
            < types.index("response.output_text.delta")
        )
        assert types[-2:] == ["response.done", "rate_limits.updated"]  # (the one at the end: right after it)
        assert done["status"] == "cancelled"
        requests, tokens = reserved["rate_limits"]
        assert requests["name"] == "requests" and 0 < requests["remaining"] <= requests["limit"] == llm.max_waiting
        prompt = done["usage"]["input_tokens"]
        assert tokens["name"] == "tokens" and tokens["limit"] == limit
        assert limit - prompt - 1500 <= tokens["remaining"] <= limit - prompt - 1500 + refilled
        assert tokens["reset_seconds"] == pytest.approx((limit - tokens["remaining"]) * 60 / limit, abs=0.1)
        tokens, used = ended["rate_limits"][1], done["usage"]["total_tokens"]
        assert used < prompt + 1500 and limit - used - 1 <= tokens["remaining"] <= limit - used + refilled

    with limited_llm(tiny_model_dir, limit) as (url, app, _):
        run(go(url, next(iter(app.state.engines.values()))))


class Requests:
    """Wraps the LLM engine's ``generate``: each request's id, prompt text and whether it finished."""

    def __init__(self, llm: Any, ignore_eos: bool = False) -> None:
        self.llm, self.generate_ = llm, llm.generate
        self.ignore_eos = ignore_eos  # every reply runs to max_tokens
        self.calls: list[dict[str, Any]] = []

    async def generate(self, request_id: str, prompt: Any, params: Any, priority: int = 0) -> Any:
        call = {"id": request_id, "prompt": self.llm.tokenizer.decode(prompt), "finished": False}
        self.calls.append(call)
        if self.ignore_eos:
            params = dataclasses.replace(params, ignore_eos=True)
        async for out in self.generate_(request_id, prompt, params, priority):
            call["finished"] = out.finished
            yield out


async def _voice_turn(url: str, pcm: bytes, max_tokens: int = 24) -> Client:
    """One voice turn at real-time pace: a 150 ms pause starts the turn speculatively, 2 s of
    silence commits it (plenty of time for the speculation to finish first). A reply longer than
    24 tokens is cancelled at its first audio."""
    async with websockets.connect(url, max_size=None, additional_headers=BETA) as ws:
        c = Client(ws)
        await c.until("session.created")
        td = {"type": "server_vad", "silence_duration_ms": 2000, "speculative_silence_ms": 150}
        td["silence_floor_dbfs"] = -50
        session = {"temperature": 0, "max_response_output_tokens": max_tokens, "turn_detection": td}
        await c.send("session.update", session=session)
        updated = await c.until("session.updated")
        assert updated["session"]["turn_detection"]["speculative_silence_ms"] == 150
        assert updated["session"]["turn_detection"]["silence_floor_dbfs"] == -50
        feeder = asyncio.create_task(c.stream(pcm, pace=1.0))
        if max_tokens > 24:
            await c.until("response.audio.delta")
            await c.send("response.cancel")
        await c.until("response.done")
        await feeder
        return c


EXPECTED_ORDER = [
    "session.created",
    "conversation.created",
    "session.updated",
    "input_audio_buffer.speech_started",
    "input_audio_buffer.speech_stopped",
    "input_audio_buffer.committed",
    "conversation.item.created",
    "conversation.item.input_audio_transcription.completed",
    "response.created",
    "response.output_item.added",
    "conversation.item.created",
    "response.content_part.added",
]


def test_speculative_reply_is_reused_and_unseen_until_the_commit(
    server: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = Requests(server["llm"])
    monkeypatch.setattr(server["llm"], "generate", requests.generate)
    c = run(_voice_turn(server["url"], server["question"] + bytes(RATE * 2 * 2)))  # 3 s of silence after
    # The client sees exactly the usual events (nothing of the speculation before the commit).
    assert c.types()[: len(EXPECTED_ORDER)] == EXPECTED_ORDER
    assert c.types()[-1] == "response.done" and c.events[-1]["response"]["status"] == "completed"
    # The reply is the speculative request, started before the turn was committed.
    assert [r["id"].split("-")[0] for r in requests.calls] == ["spec"]
    said = "".join(e["delta"] for e in c.events if e["type"] == "response.audio_transcript.delta")
    assert "paris" in said.lower() and "france" in requests.calls[0]["prompt"].lower()


def test_speech_resuming_after_a_pause_aborts_the_speculation(
    server: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long reply (no EOS: a short answer to the first phrase could finish within the gap): a
    # speculation started in the gap is still generating when speech resumes.
    requests = Requests(server["llm"], ignore_eos=True)
    monkeypatch.setattr(server["llm"], "generate", requests.generate)
    c = run(_voice_turn(server["url"], spoken("What is the capital", "of France?", gap_s=1.0), max_tokens=400))
    assert c.types()[: len(EXPECTED_ORDER)] == EXPECTED_ORDER, c.types()  # one turn: the pause did not end it
    transcript = next(e for e in c.events if e["type"].endswith("transcription.completed"))["transcript"]
    # Both phrases heard ("of France" itself may be misheard: tiny.en once heard "My friends?")
    words = re.findall(r"[a-z]+", transcript.lower())
    assert "capital" in words and len(words) > 4, transcript
    *stale, reply = requests.calls
    assert words[-1] in reply["prompt"].lower(), requests.calls  # the answer is to the whole question
    # A speculation on the first phrase (if its transcript was ready before speech resumed) was
    # aborted inside the engine; nothing of it reached the client.
    assert all(not r["finished"] and words[-1] not in r["prompt"].lower() for r in stale), requests.calls
    # The cancelled reply leaves the engine at its next step, which may come after response.done.
    deadline = time.monotonic() + 2.0
    while server["llm"].stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server["llm"].stats()["num_running"] == 0


def test_a_response_cancelled_before_it_started_ends_at_once() -> None:
    """Session state only (a stand-in socket): response.create, then response.cancel before it
    started: it ends for the client at once and the session is free for the next request;
    when the cancelled one starts after all, it is stopped unseen and its item leaves the
    conversation, and the next one is not cancelled. A barge-in that drops the cancelled one
    leaves nothing to stop."""
    from pipelines.frames import Interrupt, LLMStarted
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        await s._handle(json.dumps({"type": "response.create"}))
        first = s.inbox.get_nowait()  # (the pipeline takes the request)
        await s._handle(json.dumps({"type": "response.cancel"}))
        assert [e["type"] for e in sent] == ["response.created", "response.done"] and not s.active
        assert sent[-1]["response"]["status_details"]["reason"] == "client_cancelled"
        await s._handle(json.dumps({"type": "response.create"}))  # (not refused)
        second = s.inbox.get_nowait()
        assert sent[-1]["type"] == "response.done" and s.active
        assert first.cancelled  # (the reply stage skips it; here it started before it could)
        s.conv.add("assistant", "", "item_9")  # the cancelled one's item, as the reply stage adds it
        s.conv.add("assistant", "{}", "item_7", kind="function_call", call_id="c", name="f", response_id="resp_8")
        await s._on_frame(LLMStarted("resp_8", item_id="item_9", request=first.number))
        stop = s.inbox.get_nowait()
        assert isinstance(stop, Interrupt) and stop.response_id == "resp_8"
        assert s.conv.get("item_9") is None and s.conv.get("item_7") is None
        assert s.active and sent[-1]["type"] == "response.done"  # (told nothing more)
        await s._on_frame(stop)
        assert not s.silenced
        await s._on_frame(LLMStarted("resp_10", item_id="item_11", request=second.number))
        assert [e["response"]["id"] for e in sent if e["type"] == "response.created"][-1] == "resp_10"
        assert s.inbox.empty()  # no Interrupt for the next reply
        # A barge-in drops a cancelled request that had not started: nothing is left to stop.
        s.reply.done = True  # (resp_10 ended)
        await s._handle(json.dumps({"type": "response.create"}))
        third = s.inbox.get_nowait()
        await s._handle(json.dumps({"type": "response.cancel"}))
        await s._on_frame(Interrupt("speech_started"))
        assert third.number not in s.withdrawn

    run(go())


def test_a_request_sent_after_the_speech_started_outlives_the_barge_in() -> None:
    """Stand-in: the barge-in's ``Interrupt`` is stamped with the audio in which the VAD heard
    speech start (wire order): a ``response.create`` sent after that audio, but before the VAD
    got to it, is not cancelled; one sent before it is."""
    from pipelines.frames import Interrupt
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        spoke = time.monotonic()  # (the audio's arrival)
        await s._handle(json.dumps({"type": "response.create"}))
        asked = s.inbox.get_nowait()
        await s._on_frame(Interrupt("speech_started", created=spoke))
        assert s.requested is asked and not [e for e in sent if e["type"] == "response.done"]
        await s._on_frame(Interrupt("speech_started"))  # (speech heard in later audio)
        assert s.requested is None and sent[-1]["response"]["status_details"]["reason"] == "turn_detected"

    run(go())


def test_errors_of_a_reply_already_ended_do_not_reach_the_client() -> None:
    """Stand-in: the TTS failing on a reply the client was told ended (cancelled before it
    started, so stopped unseen; or cancelled while it played) sends no ``error``; failing on
    the reply in progress does."""
    from pipelines.frames import ErrorFrame, LLMStarted
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        await s._handle(json.dumps({"type": "response.create"}))
        first = s.inbox.get_nowait()
        await s._handle(json.dumps({"type": "response.cancel"}))
        await s._on_frame(LLMStarted("resp_8", item_id="item_9", request=first.number))  # (stopped unseen)
        await s._on_frame(ErrorFrame("TTS failed", "TTS", response_id="resp_8"))
        assert not [e for e in sent if e["type"] == "error"]
        s.inbox.get_nowait()  # (the Interrupt stopping it)
        await s._handle(json.dumps({"type": "response.create"}))
        second = s.inbox.get_nowait()
        await s._on_frame(LLMStarted("resp_10", item_id="item_11", request=second.number))
        await s._on_frame(ErrorFrame("TTS failed", "TTS", response_id="resp_10"))
        assert [e["error"]["message"] for e in sent if e["type"] == "error"] == ["TTS failed"]
        await s._on_frame(
            ErrorFrame(
                "can't be spoken",
                "TTS",
                "invalid_value",
                response_id="resp_10",
                param="input",
                error_type="invalid_request_error",
            )
        )
        assert sent[-1]["error"]["param"] == "input" and sent[-1]["error"]["type"] == "invalid_request_error"
        sent.pop()
        await s._on_frame(
            ErrorFrame("busy", "TTS", "rate_limit_exceeded", response_id="resp_10", error_type="rate_limit_error")
        )
        assert (sent[-1]["error"]["type"], sent[-1]["error"]["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        sent.pop()
        await s._handle(json.dumps({"type": "response.cancel"}))
        await s._on_frame(ErrorFrame("TTS failed again", "TTS", response_id="resp_10"))
        assert len([e for e in sent if e["type"] == "error"]) == 1

    run(go())


def test_a_clients_cancel_leaves_the_turn_still_to_be_answered() -> None:
    """Stand-in: a response.cancel names the reply it cancels; a turn that ended meanwhile
    (interrupt_response off) still expects its reply, and a cancel that comes after its reply
    ended leaves the next one alone."""
    from pipelines.frames import Interrupt, LLMStarted, SpeechStopped
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        await s._on_frame(LLMStarted("resp_1", item_id="item_1"))
        await s._on_frame(SpeechStopped(900, item_id="item_in_1"))
        await s._handle(json.dumps({"type": "response.cancel"}))
        cancel = s.inbox.get_nowait()
        assert isinstance(cancel, Interrupt) and cancel.response_id == "resp_1" and not cancel.takes_turn
        await s._on_frame(cancel)
        assert sent[-1]["type"] == "response.done" and sent[-1]["response"]["status"] == "cancelled"
        assert s.expected == "item_in_1" and s.active  # its reply is still to come
        await s._on_frame(LLMStarted("resp_2", item_id="item_2"))
        await s._on_frame(Interrupt("client_cancelled", "resp_1"))  # (a second cancel, late)
        assert s.reply is not None and s.reply.id == "resp_2" and not s.reply.done and s.active
        # A cancel ends the reply for the client at once: a response.create right behind it is taken.
        await s._handle(json.dumps({"type": "response.cancel"}))
        assert sent[-1]["type"] == "response.done" and s.reply.done and not s.active
        await s._handle(json.dumps({"type": "response.create"}))
        assert sent[-1]["type"] == "response.done" and s.requested is not None
        stop = s.inbox.get_nowait()
        await s._on_frame(stop)  # (the pipeline's, coming out: the reply is already done)
        assert sent[-1]["type"] == "response.done" and s.requested is not None

    run(go())


def test_a_cancel_naming_a_response_cancels_only_that_one() -> None:
    """Stand-in: a response.cancel with a ``response_id`` that is not the reply in progress (one
    that ended, or none such) is an error and the reply goes on; with its id, it is cancelled."""
    from pipelines.frames import LLMStarted
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        await s._on_frame(LLMStarted("resp_2", item_id="item_2"))
        for rid in ("resp_1", "resp_bogus", 7):
            await s._handle(json.dumps({"type": "response.cancel", "response_id": rid, "event_id": "e1"}))
            err = sent[-1]
            assert err["type"] == "error" and err["error"]["param"] == "response_id", err
            assert err["error"]["event_id"] == "e1" and s.inbox.empty() and not s.reply.done
        assert sent[-1]["error"]["code"] == "invalid_value"  # (the id is no string)
        assert sent[-2]["error"]["code"] == "response_cancel_not_active"
        await s._handle(json.dumps({"type": "response.cancel", "response_id": "resp_2"}))
        assert sent[-1]["type"] == "response.done" and sent[-1]["response"]["status"] == "cancelled"
        assert s.reply.done and not s.active

    run(go())


def test_a_reply_that_starts_frees_only_what_it_answers() -> None:
    """Stand-in: a client's request started while a turn's automatic reply was still to come
    (the client asked as the user spoke): the session stays active until that turn's reply
    starts too."""
    from pipelines.frames import LLMStarted, SpeechStopped, TTSDone
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        await s._handle(json.dumps({"type": "response.create"}))
        request = s.inbox.get_nowait()
        await s._on_frame(SpeechStopped(900, item_id="item_in_1"))
        await s._on_frame(LLMStarted("resp_1", item_id="item_1", request=request.number))
        await s._on_frame(TTSDone("resp_1"))
        assert s.reply is not None and s.reply.done and s.requested is None
        assert s.active and s.expected == "item_in_1"  # the turn's reply is still to come
        await s._handle(json.dumps({"type": "response.create"}))
        assert sent[-1]["error"]["code"] == "conversation_already_has_active_response"
        await s._on_frame(LLMStarted("resp_2", item_id="item_2"))
        assert s.expected is None and s.reply.id == "resp_2"

    run(go())


def test_a_barge_in_cancels_a_response_asked_for_before_it() -> None:
    """Stand-in: a response.create the pipeline has not started when the user speaks is
    cancelled (frames.Interrupt drops it): the client gets its response.created and a
    response.done "cancelled" for "turn_detected", and the session is free; one asked for after
    the barge-in (the VAD saw the speech first) stays asked for."""
    from pipelines.frames import Interrupt
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        await s._handle(json.dumps({"type": "response.create", "response": {"metadata": {"k": "v"}}}))
        await s._on_frame(Interrupt("speech_started"))
        created, done = sent[-2:]
        assert created["type"] == "response.created" and done["type"] == "response.done"
        assert done["response"]["id"] == created["response"]["id"] and done["response"]["metadata"] == {"k": "v"}
        assert done["response"]["status"] == "cancelled" and done["response"]["output"] == []
        assert done["response"]["status_details"]["reason"] == "turn_detected" and not s.active
        barge_in = Interrupt("speech_started")
        await s._handle(json.dumps({"type": "response.create"}))  # after it (not yet at the session)
        await s._on_frame(barge_in)
        assert s.active and sent[-1]["type"] == "response.done"  # (no second one)

    run(go())


class _Bounds:
    """A stand-in LLM that shows only the bounds ``pipelines.realtime_limits`` reports."""

    tokenizer = None
    max_waiting, max_model_len = 64, 2048

    def stats(self) -> dict[str, float]:
        return {"num_waiting": 3}


@pytest.mark.parametrize("ga", [False, True])
def test_a_response_shows_its_settings_and_rate_limits_follow_it(ga: bool) -> None:
    """Stand-in: ``response.created`` and ``response.done`` show the settings the reply ran with
    (its ``response.create``'s, else the session's; a reply cancelled before it started too), in
    each dialect's shape; each ``response.done`` is followed by ``rate_limits.updated`` (the
    engine's queue and context window); the response, rate-limit and error events parse as the
    ``openai`` SDK's server events of the dialect. A reply's start (its tokens reserved) sends
    one too. A GA session refuses the beta-only ``transcription_session.update``."""
    from pydantic import TypeAdapter

    from pipelines.frames import LLMDone, LLMReserved, LLMStarted, TTSDone
    from pipelines.services import Services

    if ga:
        from openai.types.realtime import RealtimeServerEvent
    else:
        from openai.types.beta.realtime import RealtimeServerEvent
    sent: list[dict[str, Any]] = []
    alaw, ulaw = ({"type": "audio/pcma"}, {"type": "audio/pcmu"}) if ga else ("g711_alaw", "g711_ulaw")
    if ga:
        session = {"type": "realtime", "audio": {"output": {"format": alaw}}, "max_output_tokens": 100}
        own = {"max_output_tokens": "inf", "audio": {"output": {"format": ulaw, "voice": "amy"}}}
    else:
        session = {"output_audio_format": alaw, "max_response_output_tokens": 100}
        own = {"max_response_output_tokens": "inf", "output_audio_format": ulaw, "voice": "amy"}

    def shown(response: dict[str, Any]) -> tuple[Any, ...]:
        if ga:
            assert "temperature" not in response  # (GA's response has none)
            out = response["audio"]["output"]
            return response["output_modalities"], out["voice"], out["format"], response["max_output_tokens"]
        keys = ("modalities", "voice", "output_audio_format", "temperature", "max_output_tokens")
        return tuple(response[k] for k in keys)

    async def go() -> None:
        s = _stand_in(Services(llm=_Bounds()), sent)
        s.ga = ga
        await s._handle(json.dumps({"type": "session.update", "session": {**session, "temperature": 0.6}}))
        await s._handle(json.dumps({"type": "response.create", "response": {**own, "temperature": 1.0}}))
        asked = s.inbox.get_nowait()
        await s._on_frame(LLMStarted("resp_1", item_id="item_1", request=asked.number, audio_format=asked.audio_format))
        await s._on_frame(LLMReserved("resp_1", 10 + 256))
        await s._on_frame(LLMDone("resp_1", "Paris.", prompt_tokens=10, completion_tokens=2))
        await s._on_frame(TTSDone("resp_1"))
        await s._on_frame(LLMStarted("resp_2", item_id="item_2"))  # a turn's own reply: the session's
        await s._on_frame(TTSDone("resp_2"))
        await s._handle(json.dumps({"type": "response.create"}))
        await s._handle(json.dumps({"type": "response.cancel"}))  # (before it started)
        await s._handle(json.dumps({"type": "transcription_session.update", "session": {}}))

    run(go())
    events = TypeAdapter(RealtimeServerEvent)
    for event in sent:  # (the session objects name mmserve's models, which the beta SDK's Literal lacks)
        if event["type"].startswith(("response.", "rate_limits.", "error")):
            events.validate_python(event)
    created = [shown(e["response"]) for e in sent if e["type"] == "response.created"]
    done = [k for k, e in enumerate(sent) if e["type"] == "response.done"]
    assert created == [shown(sent[k]["response"]) for k in done]
    theirs = (["text"], "amy", ulaw, *([] if ga else [1.0]), "inf")  # (no TTS here: text replies)
    sessions = (["text"], None, alaw, *([] if ga else [0.6]), 100)
    assert created == [theirs, sessions, sessions]
    limits = [sent[k + 1] for k in done]
    assert all(e["type"] == "rate_limits.updated" for e in limits), [e["type"] for e in sent]
    at_start = [e for e in sent[: done[0]] if e["type"] == "rate_limits.updated"]
    assert [e["rate_limits"][1]["remaining"] for e in at_start] == [2048 - 266]  # (its tokens reserved)
    requests, tokens = limits[0]["rate_limits"]
    assert requests == {"name": "requests", "limit": 64, "remaining": 61, "reset_seconds": 0.0}
    assert tokens == {"name": "tokens", "limit": 2048, "remaining": 2048 - 12, "reset_seconds": 0.0}
    assert limits[2]["rate_limits"][1]["remaining"] == 2048  # (it used none)
    refused = sent[-1]["error"]
    if ga:
        assert refused["type"] == "invalid_request_error" and refused["code"] == "invalid_value"
        assert refused["param"] == "type" and "'transcription_session.update'" in refused["message"]
    else:  # (a beta transcription session's event, in a conversation session)
        assert refused["code"] == "unsupported"


def test_a_sessions_transcription_language_and_prompt_reach_its_asr() -> None:
    """Session state only (a stand-in socket and ASR): ``input_audio_transcription`` (beta) and
    ``audio.input.transcription`` (GA) set the live ASR options, field by field; a language the
    model lacks and a prompt that is no string are errors naming the field, and change nothing."""
    import types

    from modalities.asr.engine import AsrEngine
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    class EnglishOnly:  # AsrEngine.prompt_ids's checks, without a model
        prompt_ids = AsrEngine.prompt_ids
        whisper = types.SimpleNamespace(multilingual=False, tokenizer=None)
        model_name, _tok, _no_ts = "whisper-tiny.en", {"<|startoftranscript|>": 1}, 2

    async def go() -> None:
        s = _stand_in(Services(asr=EnglishOnly()), sent)
        hint = {"model": "whisper-1", "language": "en", "prompt": "Oslo and Bergen"}
        await s._handle(json.dumps({"type": "session.update", "session": {"input_audio_transcription": hint}}))
        assert sent[-1]["type"] == "session.updated" and sent[-1]["session"]["input_audio_transcription"] == hint
        assert (s.asr_options.language, s.asr_options.prompt) == ("en", "Oslo and Bergen")
        bad = {"input_audio_transcription": {"language": "de"}}
        await s._handle(json.dumps({"type": "session.update", "session": bad}))
        error = sent[-1]["error"]
        assert error["param"] == "session.input_audio_transcription.language" and "English-only" in error["message"]
        assert s.asr_options.language == "en"
        # a field the patch leaves out keeps its value (as OpenAI's updates); null clears one
        ga = {"type": "realtime", "audio": {"input": {"transcription": {"model": "x", "prompt": "Tromsø"}}}}
        await s._handle(json.dumps({"type": "session.update", "session": ga}))
        heard = {"model": "x", "language": "en", "prompt": "Tromsø"}
        assert sent[-1]["session"]["audio"]["input"]["transcription"] == heard
        assert (s.asr_options.language, s.asr_options.prompt) == ("en", "Tromsø")
        ga = {"type": "realtime", "audio": {"input": {"transcription": {"language": None}}}}
        await s._handle(json.dumps({"type": "session.update", "session": ga}))
        assert sent[-1]["session"]["audio"]["input"]["transcription"] == {"model": "x", "prompt": "Tromsø"}
        assert (s.asr_options.language, s.asr_options.prompt) == (None, "Tromsø")
        ga = {"type": "realtime", "audio": {"input": {"transcription": {"prompt": 7}}}}
        await s._handle(json.dumps({"type": "session.update", "session": ga}))
        assert sent[-1]["error"]["param"] == "session.audio.input.transcription.prompt"
        assert s.asr_options.prompt == "Tromsø"
        await s._handle(json.dumps({"type": "session.update", "session": {"type": "realtime", "instructions": "Hi"}}))
        assert sent[-1]["type"] == "session.updated" and s.asr_options.prompt == "Tromsø"  # kept

    run(go())


def test_transcription_events_follow_the_sessions_setting() -> None:
    """Stand-ins again: a transcript is sent unless the session set its transcription to null; a
    failed one is ``...transcription.failed`` for its item (a plain ``error`` when null); an ASR in
    another process cannot be asked, so a code Whisper does not know is refused at the update."""

    from pipelines.frames import ErrorFrame, Heard
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(asr=object()), sent)  # no prompt_ids: a remote engine
        for language, ok in (("xx", False), ("de", True)):
            patch = {"input_audio_transcription": {"language": language}}
            await s._handle(json.dumps({"type": "session.update", "session": patch}))
            assert (sent[-1]["type"] == "session.updated") == ok, sent[-1]
        assert s.asr_options.language == "de"
        # codes are read lower-cased, empty strings as absent; the patch's shape is checked first
        cased = {"input_audio_transcription": {"model": "", "language": " EN ", "prompt": ""}}
        await s._handle(json.dumps({"type": "session.update", "session": cased}))
        assert sent[-1]["session"]["input_audio_transcription"] == {"model": "whisper", "language": "en"}
        assert (s.asr_options.language, s.asr_options.prompt) == ("en", None)
        both = {"temperature": 9, "input_audio_transcription": {"language": "xx"}}
        await s._handle(json.dumps({"type": "session.update", "session": both}))
        assert sent[-1]["error"]["param"] == "session.temperature" and s.asr_options.language == "en"
        for null in (False, True):
            if null:
                await s._handle(json.dumps({"type": "session.update", "session": {"input_audio_transcription": None}}))
                assert sent[-1]["session"]["input_audio_transcription"] is None
            for item_id in ("item_a", "item_b"):  # committed (or stopped), not yet heard
                await s._user_item_created(item_id)
            sent.clear()
            await s._on_frame(Heard("hello", 0, 900, item_id="item_a"))
            await s._on_frame(ErrorFrame("ValueError: no", stage="ASR", item_id="item_b"))
            assert not s.unheard and s.failed == {"item_b"}  # the failed one stays, with no transcript
            if null:
                assert [e["type"] for e in sent] == ["error"]
            else:
                completed, failed = sent
                assert completed["type"] == "conversation.item.input_audio_transcription.completed"
                assert completed["item_id"] == "item_a" and completed["transcript"] == "hello"
                assert failed["type"] == "conversation.item.input_audio_transcription.failed"
                assert failed["item_id"] == "item_b" and failed["error"]["message"] == "ValueError: no"
            await s._handle(json.dumps({"type": "conversation.item.retrieve", "item_id": "item_b"}))
            assert sent[-1]["type"] == "conversation.item.retrieved" and sent[-1]["item"]["id"] == "item_b"
            await s._handle(json.dumps({"type": "conversation.item.delete", "item_id": "item_b"}))
            assert (sent[-1]["type"], sent[-1].get("item_id")) == ("conversation.item.deleted", "item_b")
            assert not s.failed

    run(go())


def test_items_keep_the_clients_ids_and_go_where_it_says() -> None:
    """Stand-ins: ``conversation.item.create`` keeps a client's ``item.id`` (a duplicate is an
    error) and inserts after ``previous_item_id`` ("root": first; an unknown one is an error)."""

    from pipelines.realtime import RealtimeSession
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def create(s: RealtimeSession, text: str, **fields: Any) -> dict[str, Any]:
        item = {**user_item(text), **fields.pop("item", {})}
        await s._handle(json.dumps({"type": "conversation.item.create", "item": item, **fields}))
        return sent[-1]

    async def go() -> None:
        s = _stand_in(Services(), sent)
        a = await create(s, "a", item={"id": "msg_a"})
        assert a["type"] == "conversation.item.created" and a["item"]["id"] == "msg_a" and a["previous_item_id"] is None
        assert (await create(s, "again", item={"id": "msg_a"}))["error"]["param"] == "item.id"
        assert (await create(s, "bad", item={"id": 5}))["error"]["param"] == "item.id"
        b = await create(s, "b")
        assert b["previous_item_id"] == "msg_a"
        first = await create(s, "first", previous_item_id="root")
        assert first["previous_item_id"] is None
        assert (await create(s, "x", item={"id": "item_000009"}))["error"]["param"] == "item.id"  # the server's kind
        middle = await create(s, "middle", item={"id": "msg_m"}, previous_item_id="msg_a")
        assert middle["previous_item_id"] == "msg_a"
        err = await create(s, "lost", previous_item_id="msg_nope")
        assert err["error"]["code"] == "item_not_found" and err["error"]["param"] == "previous_item_id"
        assert [i.text for i in s.conv.items] == ["first", "a", "middle", "b"]
        ids = [await create(s, f"n{k}") for k in range(12)]
        assert len({i.id for i in s.conv.items}) == len(s.conv.items) and all(e["item"]["id"] for e in ids)

    run(go())


def test_speech_is_an_item_before_it_is_heard() -> None:
    """Stand-ins: speech the VAD ended (or a commit) is a conversation item at once, so a
    client's item may follow it before its transcript comes; the transcript fills it in place
    (prompts leave it out until then), and speech deleted before it is heard stays out."""
    from pipelines.frames import ErrorFrame, Heard, SpeechStopped
    from pipelines.realtime_items import response_items
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(asr=object()), sent)
        await s._on_frame(SpeechStopped(900, item_id="item_in_000001"))
        assert sent[-1]["type"] == "conversation.item.created" and sent[-1]["previous_item_id"] is None
        assert s.conv.get("item_in_000001").message() is None  # not in a prompt yet
        for text, after in (("Answer in French.", "item_in_000001"), ("Thanks.", None)):
            item = {**user_item(text), "id": f"msg_{len(s.conv.items)}"}
            await s._handle(json.dumps({"type": "conversation.item.create", "item": item, "previous_item_id": after}))
            assert sent[-1]["type"] == "conversation.item.created", sent[-1]
        assert sent[-1]["previous_item_id"] == "msg_1"
        await s._handle(json.dumps({"type": "conversation.item.retrieve", "item_id": "item_in_000001"}))
        assert sent[-1]["item"]["content"] == [{"type": "input_audio", "transcript": None}]

        s.conv.hear("item_in_000001", "What is the capital of France?")  # (the reply stage's part)
        await s._on_frame(Heard("What is the capital of France?", 0, 900, item_id="item_in_000001"))
        assert [i.text for i in s.conv.items] == ["What is the capital of France?", "Answer in French.", "Thanks."]
        await s._handle(json.dumps({"type": "conversation.item.retrieve", "item_id": "item_in_000001"}))
        assert sent[-1]["item"]["content"][0]["transcript"] == "What is the capital of France?"

        s.appended_ms = 500.0
        await s._handle(json.dumps({"type": "input_audio_buffer.commit"}))
        committed = [e for e in sent if e["type"] == "input_audio_buffer.committed"][-1]
        assert committed["previous_item_id"] == "msg_2"
        # A reply asked for before this speech is heard goes before it (the reply stage has
        # heard all speech committed before the reply was asked for).
        reply = s.conv.add_reply()
        assert [i.id for i in s.conv.items[-2:]] == [reply.id, committed["item_id"]]
        s.conv.remove(reply.id)
        # A response's input may refer to it: the transcript reaches the reply's prompt.
        ref = [{"type": "item_reference", "id": committed["item_id"]}]
        (item,) = response_items(ref, s.conv)
        s.conv.hear(committed["item_id"], "And of Italy?")
        await s._on_frame(Heard("And of Italy?", 0, 900, item_id=committed["item_id"]))
        assert item.text == "And of Italy?"

        s.appended_ms = 500.0
        await s._handle(json.dumps({"type": "input_audio_buffer.commit"}))
        committed = [e for e in sent if e["type"] == "input_audio_buffer.committed"][-1]
        await s._handle(json.dumps({"type": "conversation.item.delete", "item_id": committed["item_id"]}))
        assert sent[-1]["type"] == "conversation.item.deleted"
        assert s.conv.hear(committed["item_id"], "late") is None and len(s.conv.items) == 4
        await s._on_frame(Heard("late", 0, 900, item_id=committed["item_id"]))
        await s._on_frame(ErrorFrame("late", stage="ASR", item_id=committed["item_id"]))
        assert sent[-1]["type"] == "conversation.item.deleted" and not s.unheard | s.failed  # nothing on it

    run(go())


def test_a_turns_automatic_reply_counts_as_active_from_speech_stopped() -> None:
    """Stand-ins: once server VAD ends a turn (create_response on), its reply is on its way: a
    client's response.create is refused as OpenAI refuses one during a response, and a
    response.cancel cancels that reply when it starts; a turn heard as nothing gets no reply,
    so the session is free again and the cancel is dropped."""
    from pipelines.frames import Heard, LLMStarted, SpeechStopped
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def event(s: Any, type_: str) -> dict[str, Any]:
        await s._handle(json.dumps({"type": type_}))
        return sent[-1]

    async def go() -> None:
        s = _stand_in(Services(asr=object()), sent)
        await s._on_frame(SpeechStopped(900, item_id="item_in_000001"))
        refused = await event(s, "response.create")
        assert refused["error"]["code"] == "conversation_already_has_active_response"
        sent.clear()
        await s._handle(json.dumps({"type": "response.cancel"}))
        assert sent == [] and s.cancel_pending  # (no error: it waits for the reply)
        await s._on_frame(Heard("", 0, 900, item_id="item_in_000001"))  # noise: no reply comes
        assert not s.active and not s.cancel_pending
        assert (await event(s, "response.cancel"))["error"]["code"] == "response_cancel_not_active"

        await s._on_frame(SpeechStopped(2900, item_id="item_in_000002"))
        await s._on_frame(LLMStarted("resp_1", "item_000003", False))  # its reply starts
        assert s.expected is None and s.reply is not None and not s.reply.done

    run(go())


def test_a_full_manual_buffer_is_refused_as_it_fills() -> None:
    """Stand-ins: with manual turns the session knows the buffer's fill and refuses a chunk
    that would overfill it; after server VAD (which trims the buffer unseen) it leaves that to
    the VAD stage until a commit or clear."""
    from pipelines.frames import ErrorFrame
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []
    minute = base64.b64encode(bytes(RATE * 2 * 60)).decode()  # pcm16 silence

    async def go() -> None:
        s = _stand_in(Services(asr=object()), sent)
        for k in range(6):  # 360 s under server VAD: its buffer holds the last second or so
            event = {"type": "input_audio_buffer.append", "audio": minute, "event_id": f"evt_{k}"}
            await s._handle(json.dumps(event))
        queued = [s.inbox.get_nowait() for _ in range(s.inbox.qsize())]
        assert [f.event_id for f in queued] == [f"evt_{k}" for k in range(6)]  # (a refusal names its event)
        await s._handle(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
        await s._handle(json.dumps({"type": "input_audio_buffer.append", "audio": minute}))
        assert "error" not in [e["type"] for e in sent]
        await s._handle(json.dumps({"type": "input_audio_buffer.clear"}))
        for k in range(6):  # the sixth goes past 328 s
            await s._handle(json.dumps({"type": "input_audio_buffer.append", "audio": minute}))
            assert (sent[-1]["type"] == "error") == (k == 5)
        assert sent[-1]["error"]["code"] == "input_audio_buffer_full" and s.appended_ms == 300_000
        late = ErrorFrame(
            "full", "VAD", "input_audio_buffer_full", event_id="evt_3", error_type="invalid_request_error"
        )
        await s._on_frame(late)  # (the VAD's, as it refuses audio)
        assert sent[-1]["error"]["code"] == "input_audio_buffer_full" and sent[-1]["error"]["event_id"] == "evt_3"

    run(go())


def test_a_retrieve_mid_reply_shows_what_the_client_was_sent() -> None:
    """Stand-ins: the reply stage writes the conversation ahead of the events; a retrieve of the
    active reply's message or call shows only the text and arguments already sent."""
    from pipelines.realtime_items import Reply
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def retrieve(s: Any, item_id: str) -> dict[str, Any]:
        await s._handle(json.dumps({"type": "conversation.item.retrieve", "item_id": item_id}))
        assert sent[-1]["type"] == "conversation.item.retrieved", sent[-1]
        return sent[-1]["item"]

    async def go() -> None:
        s = _stand_in(Services(), sent)
        said = s.conv.add("assistant", "Let me check the weather for")
        call = s.conv.add("assistant", '{"city": "Os', kind="function_call", call_id="call_1", name="get_weather")
        s.reply = r = Reply("resp_1", said.id, audio=False, text="Let me")
        sent_so_far = {"id": call.id, "type": "function_call", "status": "in_progress", "arguments": '{"ci'}
        r.writing = ({"response_id": r.id, "output_index": 1, "item_id": call.id, "call_id": "call_1"}, sent_so_far)
        got = await retrieve(s, said.id)
        assert got["status"] == "in_progress" and got["content"][0]["text"] == "Let me"
        assert await retrieve(s, call.id) == sent_so_far
        r.done = True  # once it ended, the items are whole
        assert (await retrieve(s, said.id))["content"][0]["text"] == "Let me check the weather for"
        assert (await retrieve(s, call.id))["arguments"] == '{"city": "Os'

    run(go())


def test_speed_and_other_fields_are_checked_in_both_shapes() -> None:
    """Stand-ins: the replies' ``speed`` (beta ``speed``, GA ``audio.output.speed``, 0.25 to 1.5)
    reaches the TTS options and requests; a GA session's ``type``, an ``event_id`` and a
    truncation's ``content_index`` that are not what the protocol allows are errors; an event
    without a string ``type`` gets its ``event_id`` back."""

    from modalities.tts.protocol import TTSRequest
    from pipelines.frames import LLMStarted, Sentence
    from pipelines.realtime import RealtimeSession
    from pipelines.services import Services
    from pipelines.speech import TTS

    sent: list[dict[str, Any]] = []
    asked: list[TTSRequest] = []

    class Voice:  # a TTS engine that records what it is asked
        voices = ["joe", "amy"]

        async def stream(self, req: TTSRequest) -> Any:
            asked.append(req)
            yield np.zeros(10, np.float32)

    async def update(s: RealtimeSession, session: dict[str, Any], **extra: Any) -> dict[str, Any]:
        await s._handle(json.dumps({"type": "session.update", "session": session, **extra}))
        return sent[-1]

    async def go() -> None:
        s = _stand_in(Services(tts=Voice()), sent)
        assert (await update(s, {"speed": 1.25}))["session"]["speed"] == 1.25 and s.tts_options.speed == 1.25
        assert [st.options for st in s.pipeline.stages if isinstance(st, TTS)][0] is s.tts_options  # live
        assert (await update(s, {"speed": 5}))["error"]["param"] == "session.speed" and s.tts_options.speed == 1.25
        tts = next(st for st in s.pipeline.stages if isinstance(st, TTS))  # the session's stage speaks so
        assert (await update(s, {"voice": "amy"}))["session"]["voice"] == "amy"
        assert (await update(s, {"voice": None}))["session"]["voice"] == "joe"  # (no voice chosen: the default)
        for reply, voice in (("r1", None), ("r2", "amy")):  # and a reply may have a voice of its own
            [f async for f in tts.process(LLMStarted(reply, voice=voice))]
            [f async for f in tts.process(Sentence(reply, "Hi.", 0))]
            assert (asked[-1].speed, asked[-1].voice) == (1.25, voice or "joe")  # (the session's: the first)
        ga = {"type": "realtime", "audio": {"output": {"speed": 0.5}}}
        assert (await update(s, ga))["session"]["audio"]["output"]["speed"] == 0.5 and s.tts_options.speed == 0.5
        ga["audio"]["output"]["speed"] = 0.1
        assert (await update(s, ga))["error"]["param"] == "session.audio.output.speed"
        assert (await update(s, {"type": "foo"}))["error"]["param"] == "session.type"
        error = await update(s, {"instructions": "x"}, event_id={"a": 1})
        assert error["error"]["param"] == "event_id" and error["error"]["event_id"] is None
        await s._handle(json.dumps({"type": "conversation.item.truncate", "item_id": "i", "content_index": "0"}))
        assert sent[-1]["error"]["param"] == "content_index"
        for typeless in ({"event_id": "e1"}, {"type": 5, "event_id": "e1"}):  # the id is echoed all the same
            await s._handle(json.dumps(typeless))
            assert sent[-1]["error"]["param"] == "type" and sent[-1]["error"]["event_id"] == "e1", sent[-1]

    run(go())


def test_a_client_truncation_only_shortens_but_a_barge_ins_estimate_does_not_bound_it() -> None:
    """Stand-in: after the server cut a reply at its own estimate of what was played (a
    barge-in), the client's truncate says what it really played, later or earlier; after a
    client's truncate, only a shorter one is taken."""
    from pipelines.realtime_items import Reply
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        reply = Reply("resp_1", "item_1", audio=True, audio_ms=2000.0)
        s.conv.add("assistant", "Hello there.", "item_1", audio=True)
        s.in_band = s.replies["item_1"] = reply
        await s._truncate(reply, 300.0)  # (the barge-in's estimate)

        async def truncate(ms: int) -> dict[str, Any]:
            event = {"type": "conversation.item.truncate", "item_id": "item_1", "content_index": 0, "audio_end_ms": ms}
            await s._handle(json.dumps(event))
            return sent[-1]

        assert (await truncate(450))["type"] == "conversation.item.truncated"
        refused = await truncate(600)
        assert refused["type"] == "error" and refused["error"]["param"] == "audio_end_ms", refused
        assert (await truncate(400))["audio_end_ms"] == 400

    run(go())


@pytest.mark.parametrize("how", ["cancel", "barge_in", "completed"])
def test_a_cut_after_a_client_truncation_keeps_what_the_client_heard(how: str) -> None:
    """Stand-in: a client truncates the reply still streaming to 100 ms, then cancels it (or the
    user speaks over it, or the reply ends): no second truncation at the server's estimate of
    what was played (two seconds since its first chunk), and the item keeps the words of those
    100 ms; the reply plays no more: the session is idle from its end, not from the end of
    its 4 s of audio."""
    from pipelines.conversation import Spoken
    from pipelines.frames import Interrupt, LLMStarted
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        s.conv.add("assistant", "", "item_1", audio=True)
        await s._on_frame(LLMStarted("resp_1", item_id="item_1", audio=True))
        r = s.reply
        assert r is not None and r is s.in_band
        r.spoken = [Spoken("One two.", 2000.0), Spoken("Three four.", 2000.0)]
        r.audio, r.audio_ms, r.first_audio = True, 4000.0, time.monotonic() - 2.0  # (spoken: no TTS here)
        await s._open(r)
        event = {"type": "conversation.item.truncate", "item_id": "item_1", "content_index": 0, "audio_end_ms": 100}
        await s._handle(json.dumps(event))
        assert sent[-1]["type"] == "conversation.item.truncated" and s.conv.get("item_1").text == ""
        sent.clear()
        if how == "cancel":
            await s._handle(json.dumps({"type": "response.cancel"}))
        elif how == "barge_in":
            await s._interrupted(Interrupt())
        else:
            await s._finish(r, "completed")
        assert "conversation.item.truncated" not in [e["type"] for e in sent], sent
        assert s.conv.get("item_1").text == "" and s.conv.get("item_1").truncated
        assert r.done and not r.playing() and r.played_ms() == 100.0
        if how != "barge_in":  # (the user speaking: not idle)
            assert s.idle_from is not None and s.idle_from <= time.monotonic()

    run(go())


def test_an_earlier_replys_audio_can_be_truncated() -> None:
    """Stand-in: a client playing a reply behind the latest truncates it (OpenAI's truncate takes
    a previous assistant message); its item keeps what was heard. A user's item, or an item
    not in the conversation, is an error naming ``item_id`` (the latter ``item_not_found``)."""
    from pipelines.conversation import Spoken
    from pipelines.frames import LLMStarted
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        s.conv.add("user", "Count.", "item_u", audio=True)
        for n in (1, 2):  # two replies, the first done
            s.conv.add("assistant", "One two. Three four.", f"item_{n}", audio=True)
            await s._on_frame(LLMStarted(f"resp_{n}", item_id=f"item_{n}", audio=True))
            s.reply.spoken = [Spoken("One two.", 1000.0), Spoken("Three four.", 1000.0)]
            s.reply.audio, s.reply.audio_ms, s.reply.done = True, 2000.0, True  # (spoken: no TTS here)
        assert s.in_band is not None and s.in_band.item_id == "item_2"

        async def truncate(item_id: str, ms: int) -> dict[str, Any]:
            event = {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0, "audio_end_ms": ms}
            await s._handle(json.dumps(event))
            return sent[-1]

        assert (await truncate("item_1", 1000))["type"] == "conversation.item.truncated"
        assert s.conv.get("item_1").text == "One two." and s.conv.get("item_2").text == "One two. Three four."
        user = await truncate("item_u", 0)
        assert (
            user["type"] == "error" and user["error"]["param"] == "item_id" and "assistant" in user["error"]["message"]
        )
        gone = await truncate("item_x", 0)
        assert gone["error"]["code"] == "item_not_found" and gone["error"]["param"] == "item_id"
        for kind in ("truncate", "retrieve", "delete"):  # no item_id, or not a string: said so
            await s._handle(json.dumps({"type": f"conversation.item.{kind}", "content_index": 0, "audio_end_ms": 0}))
            assert (sent[-1]["error"]["code"], sent[-1]["error"]["param"]) == ("missing_required_parameter", "item_id")
            await s._handle(json.dumps({"type": f"conversation.item.{kind}", "item_id": 7, "audio_end_ms": 0}))
            assert sent[-1]["error"]["message"] == "item_id must be a string"

    run(go())


def test_calls_asked_for_with_no_tools_are_refused() -> None:
    """Stand-in: a ``tool_choice`` that asks for a call ("required", a named function) with no
    tools is an error, for the session and for one response; "auto" and "none" are not, nor a
    response's own empty tools under the session's choice of a call."""
    from pipelines.realtime_response import response_request
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        for choice in ("required", {"type": "function", "name": "get_time"}):
            await s._handle(json.dumps({"type": "session.update", "session": {"tool_choice": choice}}))
            assert sent[-1]["type"] == "error" and sent[-1]["error"]["param"] == "session.tool_choice"
            await s._handle(json.dumps({"type": "response.create", "response": {"tool_choice": choice}}))
            assert sent[-1]["type"] == "error" and sent[-1]["error"]["param"] == "response.tool_choice"
            assert s.inbox.empty() and not s.active
        for choice in ("none", "auto"):
            await s._handle(json.dumps({"type": "session.update", "session": {"tool_choice": choice}}))
            assert sent[-1]["type"] == "session.updated" and sent[-1]["session"]["tool_choice"] == choice
        # A response with no tools of its own does not hold the session's choice of a call.
        s.config.tools, s.config.tool_choice = [{"type": "function", "name": "get_time"}], "required"
        request = response_request({"tools": []}, False, s.config, s.services, s.conv)
        assert request.tools == [] and request.grammar is None

    run(go())


def test_ga_audio_objects_are_objects_of_known_fields() -> None:
    """Stand-in, GA dialect: a session's ``audio`` (and each side) is null or an object holding
    GA's fields only, and so is a response's (its ``output``: format, voice) and a transcription
    session's (``input`` only); the error names the field as the client wrote it; a refused
    update changes nothing."""
    from pipelines.realtime_events import EventError
    from pipelines.realtime_transcription import ga_patch
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        await s._handle(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
        assert sent[-1]["type"] == "session.updated"
        bad = {
            "session.audio": [[], 0, False, "x"],
            "session.audio.input": [{"input": []}, {"input": ""}],
            "session.audio.output": [{"output": 0}],
            "session.audio.voice": [{"voice": "alloy"}],
            "session.audio.input.input_audio_format": [{"input": {"input_audio_format": "pcm16"}}],
            "session.audio.output.zzz": [{"output": {"zzz": 1}}],
        }
        for param, values in bad.items():
            for audio in values:
                await s._handle(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": audio}}))
                assert sent[-1]["type"] == "error" and sent[-1]["error"]["param"] == param, (audio, sent[-1])
        assert sent[-1]["error"]["message"] == "Unknown parameter: 'session.audio.output.zzz'."
        for audio, param in (({"output": {"speed": 1.0}}, "response.audio.output.speed"), ([], "response.audio")):
            await s._handle(json.dumps({"type": "response.create", "response": {"audio": audio}}))
            assert sent[-1]["type"] == "error" and sent[-1]["error"]["param"] == param, (audio, sent[-1])
        assert s.inbox.empty() and not s.active
        await s._handle(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": None}}))
        assert sent[-1]["type"] == "session.updated"  # (null: left as it is)

    run(go())
    for audio, param in (({"output": {"voice": "alloy"}}, "session.audio.output"), ("x", "session.audio")):
        with pytest.raises(EventError) as refused:
            ga_patch({"type": "transcription", "audio": audio})
        assert refused.value.param == param
    with pytest.raises(EventError) as beta_name:
        ga_patch({"type": "transcription", "audio": {"input": {"input_audio_transcription": {"language": "en"}}}})
    assert beta_name.value.param == "session.audio.input.input_audio_transcription"
    near = {"type": "near_field"}
    assert ga_patch({"type": "transcription", "audio": {"input": {"noise_reduction": None}}}) == {
        "input_audio_noise_reduction": None
    }
    assert ga_patch({"type": "transcription", "audio": {"input": {"noise_reduction": near}}}) == {
        "input_audio_noise_reduction": near
    }


def test_a_response_create_refuses_fields_it_does_not_have_and_checks_metadata() -> None:
    """Stand-in: a ``response`` field of neither shape (beta), or a beta one in a GA request, is
    an ``unknown_parameter`` error (the GA one's message says where GA has it), not ignored;
    ``metadata`` holds to OpenAI's limits (16 pairs of strings, keys up to 64 characters,
    values up to 512), and a request within them is taken."""
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)

        async def refused(response: dict[str, Any], param: str, code: str = "unknown_parameter") -> str:
            await s._handle(json.dumps({"type": "response.create", "response": response}))
            err = sent[-1]["error"]
            assert sent[-1]["type"] == "error" and (err["param"], err["code"]) == (param, code), sent[-1]
            assert s.inbox.empty() and not s.active
            return str(err["message"])

        await refused({"foo": 1}, "response.foo")
        await refused({"output_modalities": ["text"]}, "response.output_modalities")  # (GA's, in beta)
        for metadata in (
            {f"k{i}": "v" for i in range(17)},
            {"k" * 65: "v"},
            {"k": "v" * 513},
            {"k": 1},
            ["k"],
        ):
            await refused({"metadata": metadata}, "response.metadata", "invalid_value")
        ok = {f"k{i}": "v" * 512 for i in range(16)}
        await s._handle(json.dumps({"type": "response.create", "response": {"metadata": ok}}))
        assert s.inbox.get_nowait().metadata == ok and s.active
        s.requested = None  # (as if it ended)
        await s._handle(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))  # GA from here
        message = await refused({"modalities": ["text"]}, "response.modalities")
        assert "response.output_modalities" in message
        await refused({"max_response_output_tokens": 5}, "response.max_response_output_tokens")

    run(go())


def test_a_beta_session_refuses_fields_it_does_not_have() -> None:
    """Stand-in, beta dialect: a ``session.update`` field no beta session has (a misspelling) is
    an ``unknown_parameter`` error and the update is not applied; the session object the server
    sent, sent back whole with OpenAI's ``tracing``, is taken."""
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        await s._handle(json.dumps({"type": "session.update", "session": {"instructions": "A.", "temprature": 0}}))
        assert sent[-1]["type"] == "error" and sent[-1]["error"]["code"] == "unknown_parameter", sent[-1]
        assert sent[-1]["error"]["param"] == "session.temprature" and s.config.instructions != "A."
        await s._handle(json.dumps({"type": "session.update", "session": {"instructions": "A."}}))
        echoed = sent[-1]["session"]
        await s._handle(json.dumps({"type": "session.update", "session": {**echoed, "tracing": None}}))
        assert sent[-1]["type"] == "session.updated" and sent[-1]["session"]["instructions"] == "A."

    run(go())


def test_a_ga_session_refuses_the_fields_it_does_not_have() -> None:
    """Stand-in, GA dialect: a beta field at a GA session's top level (or one of neither shape)
    is an ``unknown_parameter`` error naming it as sent, and a beta one's message says where GA
    has it; the session is unchanged. GA's own fields and the session object the server sent,
    sent back whole, are accepted; a transcription session's GA update likewise."""
    from pipelines import realtime_ga
    from pipelines.realtime_events import EventError
    from pipelines.realtime_transcription import ga_patch
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(), sent)
        await s._handle(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
        echoed = sent[-1]["session"]
        for field, value, where in (
            ("voice", "ash", "session.audio.output.voice"),
            ("modalities", ["text"], "session.output_modalities"),
            ("input_audio_format", "pcm16", "session.audio.input.format"),
            ("max_response_output_tokens", 5, "session.max_output_tokens"),
            ("zzz", 1, None),
        ):
            session = {"type": "realtime", "instructions": "Be brief.", field: value}
            await s._handle(json.dumps({"type": "session.update", "session": session}))
            err = sent[-1]["error"]
            assert sent[-1]["type"] == "error" and err["param"] == f"session.{field}", sent[-1]
            assert err["code"] == "unknown_parameter" and (where is None or where in err["message"]), err
            assert err["message"].startswith(f"Unknown parameter: 'session.{field}'"), err  # (as a beta one's)
        # (a beta-shaped update after the switch to GA: refused too, not ignored)
        await s._handle(json.dumps({"type": "session.update", "session": {"voice": "ash"}}))
        assert sent[-1]["type"] == "error" and sent[-1]["error"]["param"] == "session.voice"
        assert s.config.instructions != "Be brief."
        await s._handle(json.dumps({"type": "session.update", "session": {**echoed, "instructions": "Be brief."}}))
        assert sent[-1]["type"] == "session.updated" and sent[-1]["session"]["instructions"] == "Be brief."
        ga_only = {"type": "realtime", "tracing": None, "truncation": "auto", "parallel_tool_calls": True}
        await s._handle(json.dumps({"type": "session.update", "session": ga_only}))
        assert sent[-1]["type"] == "session.updated"
        # A model is a string; noise reduction null or {"type": "near_field" | "far_field"} (the
        # last one, valid, is shown and applied).
        near = {"input": {"noise_reduction": {"type": "near_field"}}}
        for session, param in (
            ({"model": 5}, "session.model"),
            ({"audio": {"input": {"noise_reduction": "near"}}}, "session.audio.input.noise_reduction"),
            ({"audio": {"input": {"noise_reduction": {"type": "loud"}}}}, "session.audio.input.noise_reduction"),
            ({"audio": near, "model": "m"}, None),
        ):
            await s._handle(json.dumps({"type": "session.update", "session": {"type": "realtime", **session}}))
            got = sent[-1]
            assert (
                got["type"] == ("error" if param else "session.updated") and got.get("error", {}).get("param") == param
            )
        assert sent[-1]["session"]["audio"]["input"]["noise_reduction"] == {"type": "near_field"}
        assert s.vad_config.noise_reduction == "near_field"
        beta = _stand_in(Services(), sent)
        await beta._handle(json.dumps({"type": "session.update", "session": {"input_audio_noise_reduction": "x"}}))
        assert sent[-1]["error"]["param"] == "session.input_audio_noise_reduction"

    run(go())
    with pytest.raises(EventError) as refused:
        ga_patch({"type": "transcription", "input_audio_transcription": {"language": "en"}})
    assert refused.value.param == "session.input_audio_transcription" and "session.audio.input" in str(refused.value)
    echoed = {"type": "transcription", "object": "realtime.transcription_session", "id": "sess_1", "include": []}
    assert ga_patch(echoed) == {"include": []}
    with pytest.raises(EventError) as noisy:
        ga_patch({"type": "transcription", "audio": {"input": {"noise_reduction": {"type": "x"}}}})
    assert realtime_ga.ga_error(noisy.value).param == "session.audio.input.noise_reduction"


def test_the_llm_tells_a_finished_message_from_a_cut_off_one(server: dict[str, Any]) -> None:
    """``pipelines.turns.end_of_turn`` on the served SmolLM2: a pause after a cut-off sentence
    does not end the turn; one after a finished message does (eagerness "auto")."""
    from pipelines.conversation import Conversation
    from pipelines.turns import EAGERNESS, end_of_turn

    conv = Conversation("You are a helpful assistant.")
    # (as Whisper writes them: a cut-off sentence may end in "." or "?" too)
    finished = ["What is the capital of France?", "Tell me a story about a dragon.", "Okay.", "Thanks, that's all."]
    cut_off = ["What is the capital?", "I would like to order a", "My favorite city is.", "Tell me about the..."]
    cut_off += ["I...", "A"]  # (words the template itself writes later: "assistant")

    async def go() -> list[float]:
        return [await end_of_turn(server["llm"], conv, text) for text in finished + cut_off]

    p = run(go())
    threshold = EAGERNESS["auto"].end_p
    assert all(x >= threshold for x in p[: len(finished)]), p
    assert all(x < threshold for x in p[len(finished) :]), p


def test_semantic_vad_waits_through_a_pause_mid_sentence(server: dict[str, Any]) -> None:
    """semantic_vad: a 1 s pause after "What is the capital" (server_vad's 500 ms silence would
    end the turn there) does not end it; after "of France?" the turn ends well before the 4 s
    that eagerness "auto" waits for an unfinished one (the stream has at most 3.5 s of silence
    after it)."""

    async def go() -> Client:
        async with websockets.connect(server["url"], max_size=None, additional_headers=BETA) as ws:
            c = Client(ws)
            await c.until("session.created")
            session = {"temperature": 0, "max_response_output_tokens": 8, "turn_detection": {"type": "semantic_vad"}}
            await c.send("session.update", session=session)
            updated = await c.until("session.updated")
            assert updated["session"]["turn_detection"] == {
                "type": "semantic_vad",
                "eagerness": "auto",
                "create_response": True,
                "interrupt_response": True,
            }
            await _pause_mid_sentence(c, "response.done")
            return c

    _heard_as_one_turn(run(go()))


async def _pause_mid_sentence(c: Client, until: str) -> None:
    """Stream "What is the capital", 1 s of silence, "of France?" and 2 s of silence at real time,
    then trickle silence (20 ms each 250 ms) until ``until`` or 3.5 s of silence in all: the turn
    must end on the served LLM's verdict, which a loaded CPU may give seconds late, and never by
    the 4 s that eagerness "auto" waits for an unfinished turn (the VAD sees time in audio; with
    the voice's own ~0.2 s of quiet after the words it counts ~3.7 s, so keep this margin)."""

    async def feed() -> None:
        await c.stream(spoken("What is the capital", "of France?", gap_s=1.0, tail_s=2.0), pace=1.0)
        await c.stream(bytes(RATE * 3), chunk_ms=20, pace=12.5)  # (1.5 s of pcm16 over 19 s)

    feeder = asyncio.create_task(feed())
    try:
        await c.until(until, timeout=60)
    finally:
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeder


def _heard_as_one_turn(c: Client) -> None:
    assert c.types().count("input_audio_buffer.speech_stopped") == 1, c.types()
    transcript = next(e for e in c.events if e["type"].endswith("transcription.completed"))["transcript"]
    assert "capital" in transcript.lower() and "france" in transcript.lower(), transcript


def test_a_transcription_session_judges_its_pauses_with_the_served_llm(server: dict[str, Any]) -> None:
    """semantic_vad in a transcription session (no reply stage): the served LLM judges the pauses
    (``pipelines.turns.JudgeTurns``): the 1 s pause mid-sentence does not end the turn, and it
    ends after "of France?" before the 4 s that an unfinished one waits (the stream's silence
    after it is shorter: unjudged, the turn would never end)."""

    async def go() -> Client:
        async with websockets.connect(
            server["url"] + "?intent=transcription", max_size=None, additional_headers=BETA
        ) as ws:
            c = Client(ws)
            await c.until("transcription_session.created")
            await c.send("transcription_session.update", session={"turn_detection": {"type": "semantic_vad"}})
            assert (await c.until("transcription_session.updated"))["session"]["turn_detection"][
                "type"
            ] == "semantic_vad"
            await _pause_mid_sentence(c, "conversation.item.input_audio_transcription.completed")
            return c

    _heard_as_one_turn(run(go()))


async def _idle_through_vad(s: Any, vad: Any) -> None:
    """Stand-in pipeline: the session's inbox through a real VAD stage, its answers to an idle
    commit (and turn resets) back to the session; the other frames are dropped."""
    from pipelines.frames import TimedOut, TurnReset

    for _ in range(s.inbox.qsize()):  # (what the session puts meanwhile, a reply request, stays)
        async for out in vad.process(s.inbox.get_nowait()):
            if isinstance(out, TimedOut | TurnReset):
                await s._on_frame(out)


def test_idle_timeout_commits_the_silence_and_asks_for_a_reply_once_the_reply_has_played() -> None:
    """Stand-in, a real VAD stage, ``turn_detection.idle_timeout_ms`` (its OpenAI minimum of 5 s
    set under the checks here, to 50 ms): once a reply's audio has played (a real-time clock from
    its first chunk), that long without speech commits the input through the VAD (a moment of
    silence, the VAD having dropped the rest), then ``input_audio_buffer.timeout_triggered``,
    the commit's events and a reply request; speech stops the wait, an out-of-band reply does not
    start it, and a reply that only called functions leaves the session waiting for their output."""
    from pipelines.frames import AudioFrame, CommitFrame, ResponseRequest, SpeechStarted, SpeechStopped
    from pipelines.realtime_items import Reply
    from pipelines.services import Services
    from pipelines.speech import VAD

    sent: list[dict[str, Any]] = []

    async def go() -> None:
        s = _stand_in(Services(asr=object()), sent)
        s.config.turn_detection = {**s.config.turn_detection, "idle_timeout_ms": 50}
        vad = VAD(s.vad_config)
        async for _ in vad.process(AudioFrame(np.zeros(64_000, np.float32), 16_000)):  # 4 s of silence
            pass
        played = Reply("resp_1", "item_1", True, audio_ms=200.0, first_audio=time.monotonic(), done=True)
        s._reply_ended(played, "completed")
        await asyncio.sleep(0.15)  # (playing until 0.2 s)
        assert not sent and s.inbox.empty()
        await asyncio.sleep(0.4)
        commit = s.inbox.get_nowait()
        assert isinstance(commit, CommitFrame) and commit.idle and not sent  # the VAD decides
        s.inbox.put_nowait(commit)
        await _idle_through_vad(s, vad)
        assert [e["type"] for e in sent] == [
            "input_audio_buffer.timeout_triggered",
            "input_audio_buffer.committed",
            "conversation.item.created",
        ]
        timeout = sent[0]
        assert timeout["audio_end_ms"] == 4000 and 3000 <= timeout["audio_start_ms"] <= 3950
        assert sent[1]["item_id"] == timeout["item_id"] == commit.item_id == sent[2]["item"]["id"]
        request = s.inbox.get_nowait()
        assert isinstance(request, ResponseRequest) and s.requested is request and s.active
        s.requested = None

        sent.clear()
        s._reply_ended(Reply("resp_2", "item_2", False, done=True), "completed")
        await s._on_frame(SpeechStarted(4100, item_id="item_in_000001"))  # the user speaks: no timeout
        await asyncio.sleep(0.1)
        s._reply_ended(Reply("resp_3", "item_3", False, done=True), "cancelled")  # (a barge-in's)
        await asyncio.sleep(0.1)
        assert [e["type"] for e in sent] == ["input_audio_buffer.speech_started"] and s.inbox.empty()
        await s._on_frame(SpeechStopped(4500, item_id="item_in_000001"))
        s.expected = None  # (its reply came and went)
        s._reply_ended(Reply("resp_4", "item_4", False, out_of_band=True, done=True), "completed")
        calls = Reply("resp_5", "item_5", False, done=True, calls=[{"id": "item_6"}])
        s._reply_ended(calls, "completed")
        await asyncio.sleep(0.2)
        assert s.inbox.empty()  # no wait: an out-of-band reply, then one that called a function
        s._reply_ended(Reply("resp_7", "item_7", False, done=True), "completed")
        await asyncio.sleep(0.4)
        assert isinstance(s.inbox.get_nowait(), CommitFrame)

    run(go())


def test_idle_timeout_waits_after_an_unanswered_turn_and_takes_a_new_value_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stand-in, a real VAD stage (OpenAI's 5 s minimum lowered for the test): a turn that gets
    no reply (Whisper heard nothing in a cough) leaves the session idle, so the wait starts then,
    also when it ran out while the reply was still expected; an out-of-band reply leaves the wait
    alone; a ``session.update`` applies its value at once, counted from the same moment
    (shorter: sooner; null: never), and one that turns the timeout on after a reply starts the
    wait from that reply's end; speech the VAD hears when the wait's commit reaches it keeps the
    input uncommitted, and a clear that ends a turn the VAD had started leaves the session idle."""
    from pipelines import realtime_config
    from pipelines.frames import AudioFrame, Heard, SpeechStarted, SpeechStopped
    from pipelines.realtime_items import Reply
    from pipelines.services import Services
    from pipelines.speech import VAD

    monkeypatch.setattr(realtime_config, "IDLE_TIMEOUT_MS", (10, 30000))
    sent: list[dict[str, Any]] = []

    def timeouts() -> int:
        return sum(e["type"] == "input_audio_buffer.timeout_triggered" for e in sent)

    async def idle_ms(s: Any, ms: int | None) -> None:
        await s._handle(json.dumps({"type": "session.update", "session": {"turn_detection": {"idle_timeout_ms": ms}}}))
        assert sent[-1]["type"] == "session.updated", sent[-1]

    async def settle(s: Any, vad: Any, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await _idle_through_vad(s, vad)
        while not s.inbox.empty():  # (a timeout's reply request: it came and went)
            s.inbox.get_nowait()
        s.requested = None

    async def go() -> None:
        s = _stand_in(Services(asr=object()), sent)
        vad = VAD(s.vad_config)
        await idle_ms(s, 300)
        await s._on_frame(SpeechStarted(0, item_id="item_in_000001"))  # a cough ...
        await s._on_frame(SpeechStopped(600, item_id="item_in_000001"))
        await settle(s, vad, 0.5)
        assert timeouts() == 0 and s.active  # (its reply was expected)
        await s._on_frame(Heard("", 0, 600, item_id="item_in_000001"))  # ... heard as nothing: no reply
        await settle(s, vad, 0.1)
        assert timeouts() == 0
        await settle(s, vad, 0.5)
        assert timeouts() == 1

        # A wait that runs out while a turn's reply is expected goes on once the turn gets none.
        s._reply_ended(Reply("resp_1", "item_1", False, done=True), "completed")
        s.expected = "item_in_000002"
        await settle(s, vad, 0.5)
        assert timeouts() == 1
        s._no_reply("item_in_000002")
        await s._on_frame(Heard("", 0, 600, item_id="item_in_000002"))
        await settle(s, vad, 0.1)
        assert timeouts() == 2

        await idle_ms(s, 600)
        s._reply_ended(Reply("resp_2", "item_2", False, done=True), "completed")
        await asyncio.sleep(0.3)
        s._reply_ended(Reply("resp_3", "item_3", False, out_of_band=True, done=True), "completed")
        await settle(s, vad, 0.45)  # 0.75 s after resp_2's end: due at 0.6 s, not 0.6 s after resp_3's
        assert timeouts() == 3

        s._reply_ended(Reply("resp_4", "item_4", False, done=True), "completed")
        await idle_ms(s, 2000)
        await asyncio.sleep(0.3)
        await idle_ms(s, 500)  # 0.3 s in: due 0.2 s later, not 0.5 s or 2 s later
        await settle(s, vad, 0.35)
        assert timeouts() == 4

        await idle_ms(s, None)
        s._reply_ended(Reply("resp_5", "item_5", False, done=True), "completed")
        await settle(s, vad, 0.5)
        assert timeouts() == 4  # off
        await idle_ms(s, 600)  # on after the reply: the wait counts from its end
        await settle(s, vad, 0.6)
        assert timeouts() == 5

        # Speech the VAD hears (a tone it takes for a voice) as the wait's commit reaches it: no commit.
        tone = (0.3 * np.sin(2 * np.pi * 300 * np.arange(8000) / 16_000)).astype(np.float32)
        await idle_ms(s, 100)
        s._reply_ended(Reply("resp_6", "item_6", False, done=True), "completed")
        await asyncio.sleep(0.2)
        commit = s.inbox.get_nowait()
        s.inbox.put_nowait(AudioFrame(tone, 16_000))  # (the audio the client sent before it)
        s.inbox.put_nowait(commit)
        await _idle_through_vad(s, vad)
        assert timeouts() == 5 and vad.seg.voiced and not s.active
        # The client clears the buffer mid-speech: that turn ends unseen, and the session is idle.
        await s._on_frame(SpeechStarted(9000, item_id="item_in_000003"))  # (the tone's, late)
        await s._handle(json.dumps({"type": "input_audio_buffer.clear"}))
        await _idle_through_vad(s, vad)
        assert not s.speaking
        await settle(s, vad, 0.3)
        assert timeouts() == 6

    run(go())


def test_idle_timeout_is_checked_and_only_a_server_vad_setting() -> None:
    """Stand-in: ``idle_timeout_ms`` null or in OpenAI's [5000, 30000], echoed once set;
    semantic VAD and transcription sessions have none; a turn_detection field of neither
    kind (a misspelling) is an ``unknown_parameter`` error, not ignored."""
    from pipelines.services import Services

    sent: list[dict[str, Any]] = []

    async def update(s: Any, td: dict[str, Any], kind: str = "session.update") -> dict[str, Any]:
        await s._handle(json.dumps({"type": kind, "session": {"turn_detection": td}}))
        return sent[-1]

    async def go() -> None:
        s = _stand_in(Services(asr=object()), sent)
        ok = await update(s, {"type": "server_vad", "idle_timeout_ms": 6000})
        assert ok["type"] == "session.updated" and ok["session"]["turn_detection"]["idle_timeout_ms"] == 6000
        for bad in (4999, 30001, 6000.5, "6000", True):
            err = await update(s, {"type": "server_vad", "idle_timeout_ms": bad})
            assert err["type"] == "error" and err["error"]["param"] == "session.turn_detection.idle_timeout_ms", err
        assert (await update(s, {"idle_timeout_ms": None}))["session"]["turn_detection"]["idle_timeout_ms"] is None
        err = await update(s, {"type": "semantic_vad", "idle_timeout_ms": 6000})
        assert err["type"] == "error" and "not a semantic_vad setting" in err["error"]["message"]
        err = await update(s, {"type": "server_vad", "idle_timout_ms": 6000})
        assert err["error"]["code"] == "unknown_parameter"
        assert err["error"]["param"] == "session.turn_detection.idle_timout_ms"
        td = {"type": "server_vad", "idle_timout_ms": 6000}
        await s._handle(
            json.dumps(
                {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": td}}}}
            )
        )
        ga = sent[-1]["error"]  # (GA names it where GA has it, in the message too)
        assert ga["param"] == "session.audio.input.turn_detection.idle_timout_ms" and ga["param"] in ga["message"], ga
        t = _stand_in(Services(asr=object()), sent)
        t.transcription = True
        err = await update(t, {"type": "server_vad", "idle_timeout_ms": 6000}, "transcription_session.update")
        assert err["type"] == "error" and err["error"]["param"] == "session.turn_detection.idle_timeout_ms", err

    run(go())


def test_idle_timeout_prompts_a_reply_on_a_real_session(server: dict[str, Any]) -> None:
    """A real session, text replies: 5 s (OpenAI's minimum) after a reply without the user
    speaking, the server says so, commits the silence as the user's (empty) turn and replies."""

    async def go() -> None:
        async with websockets.connect(server["url"], additional_headers=BETA) as ws:
            c = Client(ws)
            await text_session(c, 8)
            await c.send("session.update", session={"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}})
            await c.until("session.updated", session__turn_detection__idle_timeout_ms=5000)
            await c.send("conversation.item.create", item=user_item("Hello!"))
            await c.send("response.create")
            await c.until("response.done")
            ended = time.monotonic()
            timeout = await c.until("input_audio_buffer.timeout_triggered", timeout=30)
            assert 4.5 <= time.monotonic() - ended <= 8.0
            await c.until("input_audio_buffer.committed", item_id=timeout["item_id"])
            heard = await c.until("conversation.item.input_audio_transcription.completed")
            assert heard["item_id"] == timeout["item_id"] and heard["transcript"] == ""
            done = await c.until("response.done")
            assert done["response"]["status"] in ENDED and done["response"]["output"]
            assert "response.created" in c.types()[c.index("input_audio_buffer.timeout_triggered") :]

    run(go())
