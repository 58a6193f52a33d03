"""Transcription sessions (``/v1/realtime?intent=transcription``) end to end: a real uvicorn
server that serves Whisper tiny.en only, a real ``websockets`` client streaming speech
synthesised by Piper; the beta dialect, and the GA one through the official `openai` client."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.helpers import serve_app
from tests.test_realtime import BETA, QUESTION, RATE, Client, sdk_until, speech

websockets = pytest.importorskip("websockets")


@pytest.fixture(scope="module")
def asr_server() -> Iterator[dict[str, Any]]:
    from gateway.app import create_app
    from modalities.asr.engine import AsrConfig, AsrEngine
    from pipelines.plugin import router

    asr = AsrEngine.from_config(AsrConfig(max_num_seqs=2))
    with serve_app(create_app({asr.model_name: asr}, routers=[router])) as url:
        yield {"url": url.replace("http://", "ws://") + "/v1/realtime", "http": url, "question": speech(QUESTION)}


def _heard(transcript: str) -> bool:
    return "capital" in transcript.lower() and "france" in transcript.lower()


def test_a_beta_transcription_session_hears_each_turn_and_makes_no_replies(asr_server: dict[str, Any]) -> None:
    async def go() -> Client:
        url = asr_server["url"] + "?intent=transcription"
        async with websockets.connect(url, additional_headers=BETA, max_size=None) as ws:
            c = Client(ws)
            created = await c.until("transcription_session.created")
            assert created["session"]["object"] == "realtime.transcription_session"
            assert "create_response" not in created["session"]["turn_detection"]
            update = {"input_audio_transcription": {"model": "whisper-1", "language": "en"}}
            await c.send("transcription_session.update", session=update)
            updated = await c.until("transcription_session.updated")
            assert updated["session"]["input_audio_transcription"]["language"] == "en"
            refusals = (
                {"turn_detection": {"create_response": True}},
                {"instructions": "hi"},
                {"turn_detection": {"type": "semantic_vad"}},  # (no LLM served to judge the turns)
                {"include": ["item.input_audio_transcription.tokens"]},
            )
            for refused in (*refusals, {"input_audio_transcription": None}):
                await c.send("transcription_session.update", session=refused)
                assert (await c.until("error"))["error"]["param"].startswith("session.")
            await c.send("response.create")
            assert (await c.until("error"))["error"]["code"] == "unsupported"
            await c.send("session.update", session={"instructions": "hi"})  # (a conversation session's)
            assert (await c.until("error"))["error"]["param"] == "session.type"
            await c.stream(asr_server["question"])
            done = await c.until("conversation.item.input_audio_transcription.completed")
            assert _heard(done["transcript"]) and "logprobs" not in done  # (not asked for)
            await c.send("conversation.item.retrieve", item_id=done["item_id"])
            item = (await c.until("conversation.item.retrieved"))["item"]
            assert item["content"][0]["transcript"] == done["transcript"]
            await asyncio.sleep(0.3)  # (a reply would have started by now)
            return c

    c = asyncio.run(go())
    turn = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.created",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",
    ]
    positions = [c.index(t) for t in turn]
    assert positions == sorted(positions), c.types()
    delta = c.events[c.index("conversation.item.input_audio_transcription.delta")]
    assert delta["delta"] == c.events[c.index("conversation.item.input_audio_transcription.completed")]["transcript"]
    assert not [t for t in c.types() if t.startswith("response.")]


def test_the_official_client_runs_a_ga_transcription_session_in_g711(asr_server: dict[str, Any]) -> None:
    """``openai``'s ``client.realtime.connect`` with ``intent=transcription`` (GA): a
    ``session.created`` of type "transcription", a ``session.update`` of that type (the input in
    G.711 mu-law; a bad language refused, naming the GA field; the transcript's logprobs
    included), GA item events; a session of another type is refused."""
    openai = pytest.importorskip("openai")
    from modalities.audio import resample
    from pipelines.realtime_audio import FORMATS

    pcmu = FORMATS["g711_ulaw"]
    samples = np.frombuffer(asr_server["question"], np.int16).astype(np.float32) / 32768
    audio = pcmu.encode(resample(samples, RATE, pcmu.rate))

    async def go() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=asr_server["http"] + "/v1", api_key="unused")
        query = {"intent": "transcription"}
        async with client.realtime.connect(model="whisper-1", extra_query=query) as conn:
            events: list[Any] = []
            until = sdk_until(conn, events)

            created = await until("session.created")
            assert created.type == "session.created" and created.session.type == "transcription"
            beta = {"type": "transcription_session.update", "session": {"turn_detection": None}}
            await conn.send_raw(json.dumps(beta))  # (beta's event: a GA session has none)
            refused = await until("error")
            assert refused.error.type == "invalid_request_error" and refused.error.param == "type"
            assert refused.error.code == "invalid_value" and "transcription_session.update" in refused.error.message
            await conn.session.update(session={"type": "realtime", "instructions": "hi"})
            assert (await until("error")).error.param == "session.type"
            audio_in: dict[str, Any] = {"format": {"type": "audio/pcmu"}, "transcription": {"language": "xx"}}
            await conn.session.update(session={"type": "transcription", "audio": {"input": audio_in}})
            bad = await until("error")
            assert bad.error.param.startswith("session.audio.input.transcription"), bad
            audio_in["transcription"] = {"model": "whisper-1", "language": "en"}
            include = ["item.input_audio_transcription.logprobs"]
            await conn.session.update(session={"type": "transcription", "audio": {"input": {"include": include}}})
            assert (await until("error")).error.param == "session.audio.input.include"  # (the session's field)
            await conn.session.update(
                session={"type": "transcription", "audio": {"input": audio_in}, "include": include}
            )
            updated = (await until("session.updated")).session
            assert updated.type == "transcription" and updated.audio.input.format.type == "audio/pcmu"
            assert updated.include == include
            step = pcmu.rate // 10  # 100 ms
            for i in range(0, len(audio), step):
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i : i + step]).decode())
                await asyncio.sleep(0.025)
            done = await until("conversation.item.input_audio_transcription.completed")
            assert done.type.endswith(".completed") and _heard(done.transcript), done
            assert done.logprobs and all(lp.logprob <= 0 for lp in done.logprobs)
            assert "".join(lp.token for lp in done.logprobs).strip() == done.transcript
            delta = next(e for e in events if e.type.endswith("transcription.delta"))
            assert delta.logprobs == done.logprobs
            return events

    types = [e.type for e in asyncio.run(go())]
    assert "conversation.item.added" in types and "conversation.item.created" not in types
    assert "conversation.item.input_audio_transcription.delta" in types


def test_a_session_with_no_llm_served_needs_the_transcription_intent(asr_server: dict[str, Any]) -> None:
    async def go(query: str) -> dict[str, Any]:
        async with websockets.connect(asr_server["url"] + query) as ws:
            return json.loads(await ws.recv())

    for query, param in (("", "model"), ("?intent=translation", "intent")):
        first = asyncio.run(go(query))
        assert first["type"] == "error" and first["error"]["param"] == param, first


def test_a_committed_buffer_of_silence_is_heard_as_nothing(asr_server: dict[str, Any]) -> None:
    """Manual turns: no session VAD judged the audio, so the ASR's own does (Whisper makes "you"
    of silence); speech committed the same way is heard."""

    async def go() -> list[str]:
        url = asr_server["url"] + "?intent=transcription"
        async with websockets.connect(url, additional_headers=BETA, max_size=None) as ws:
            c = Client(ws)
            await c.until("transcription_session.created")
            await c.send("transcription_session.update", session={"turn_detection": None})
            await c.until("transcription_session.updated")
            heard = []
            for pcm in (bytes(RATE * 2), asr_server["question"]):  # 1 s of silence, then the question
                await c.send("input_audio_buffer.append", audio=base64.b64encode(pcm).decode())
                await c.send("input_audio_buffer.commit")
                done = await c.until("conversation.item.input_audio_transcription.completed")
                heard.append(done["transcript"])
                c.events.clear()
            return heard

    silence, question = asyncio.run(go())
    assert silence == "" and _heard(question)


def test_noise_reduction_ends_a_turn_spoken_in_noise(asr_server: dict[str, Any]) -> None:
    """The question in white noise (10 dB below it, from 1.5 s before it to the end): with
    ``noise_reduction`` near_field the turn ends once the question does, and is heard (without
    it webrtcvad takes the noise for speech: tests/test_pipeline_core.py). Both dialects show it."""
    from modalities.asr.speech_corpus import in_noise
    from modalities.audio import to_pcm16

    question = np.frombuffer(asr_server["question"], "<i2").astype(np.float32) / 32768
    audio = np.concatenate([np.zeros(RATE * 3 // 2, np.float32), question])
    voiced = np.flatnonzero(np.abs(audio) > 0.01)
    noisy = to_pcm16(in_noise(audio, 10, np.random.default_rng(0), rate=RATE))
    near = {"type": "near_field"}

    async def go() -> Client:
        url = asr_server["url"] + "?intent=transcription"
        async with websockets.connect(url, additional_headers=BETA, max_size=None) as ws:
            c = Client(ws)
            await c.until("transcription_session.created")
            await c.send("transcription_session.update", session={"input_audio_noise_reduction": near})
            assert (await c.until("transcription_session.updated"))["session"]["input_audio_noise_reduction"] == near
            await c.send(
                "session.update", session={"type": "transcription", "audio": {"input": {"noise_reduction": near}}}
            )
            assert (await c.until("session.updated"))["session"]["audio"]["input"]["noise_reduction"] == near
            # GA from here on: the beta event is refused, as OpenAI's GA server refuses it
            await c.send("transcription_session.update", session={"input_audio_noise_reduction": None})
            refused = (await c.until("error"))["error"]
            assert refused["code"] == "invalid_value" and "'transcription_session.update'" in refused["message"]
            await c.stream(noisy)
            await c.until("conversation.item.input_audio_transcription.completed", timeout=30)
            return c

    c = asyncio.run(go())
    (started,) = (e["audio_start_ms"] for e in c.events if e["type"] == "input_audio_buffer.speech_started")
    (stopped,) = (e["audio_end_ms"] for e in c.events if e["type"] == "input_audio_buffer.speech_stopped")
    onset_ms, end_ms = voiced[0] * 1000 // RATE, (voiced[-1] + 1) * 1000 // RATE
    assert onset_ms - 400 <= started <= onset_ms and end_ms < stopped <= end_ms + 800, (started, stopped)
    # (tiny.en in this much noise: a word may go amiss when the speculative transcript's batch differs)
    assert "capital" in c.events[-1]["transcript"].lower()
