"""The speech processors: resample → VAD → ASR → LLM → sentences → TTS.

Each does one thing and passes every frame it does not handle through unchanged. The services
they call (``Services``: an ASR transcribe function, the LLM ``AsyncEngine``, a TTS engine) are
plain objects, so the same processors run in the real-time session and in the Celery stages.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from modalities.audio import ASR_RATE, Resampler
from pipelines.conversation import Conversation
from pipelines.frames import (
    AudioFrame,
    ClearFrame,
    CommitFrame,
    ErrorFrame,
    Frame,
    Interrupt,
    LLMDone,
    LLMStarted,
    ResponseRequest,
    Sentence,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    Transcript,
    TTSAudio,
    TTSDone,
    UserAudio,
)
from pipelines.processor import Processor
from pipelines.services import Services
from pipelines.vad import BufferFull, VADConfig, VADSegmenter


class Resample(Processor):
    """``AudioFrame``s to ``rate`` Hz (streaming: no clicks at chunk boundaries)."""

    def __init__(self, rate: int = ASR_RATE) -> None:
        self.rate = rate
        self._streams: dict[int, Resampler] = {}

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, AudioFrame) and frame.sample_rate != self.rate:
            rs = self._streams.setdefault(frame.sample_rate, Resampler(frame.sample_rate, self.rate))
            yield AudioFrame(rs(frame.samples), self.rate, created=frame.created)
        else:
            yield frame


class VAD(Processor):
    """Turn detection on 16 kHz audio. With ``config.server_vad`` it emits ``SpeechStarted`` (and
    an ``Interrupt``: barge-in), then ``SpeechStopped`` and the utterance as ``UserAudio`` after
    ``silence_duration_ms`` of silence. ``CommitFrame`` turns the buffered audio into one
    utterance (manual turns); ``ClearFrame`` drops it. Audio frames are consumed."""

    def __init__(self, config: VADConfig | None = None) -> None:
        self.config = config or VADConfig()
        self.seg = VADSegmenter(self.config)
        self._ids = itertools.count(1)
        self.item_id = ""

    def _next_item(self) -> str:
        self.item_id = f"item_in_{next(self._ids):06d}"
        return self.item_id

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, AudioFrame):
            try:
                events = self.seg.feed(frame.samples)
            except BufferFull as exc:
                yield ErrorFrame(str(exc), stage=self.name, code="input_audio_buffer_full")
                return
            for ev in events:
                if ev.kind == "start":
                    yield SpeechStarted(ev.ms, item_id=self._next_item())
                    yield Interrupt("speech_started")
                elif ev.kind == "pause":
                    yield UserAudio(
                        ev.samples, ASR_RATE, ev.start_ms, ev.ms, item_id=self.item_id, tentative=True, turn_key=ev.key
                    )
                else:
                    yield SpeechStopped(ev.ms, item_id=self.item_id)
                    yield UserAudio(
                        ev.samples,
                        ASR_RATE,
                        ev.start_ms,
                        ev.ms,
                        item_id=self.item_id,
                        respond=self.config.create_response,
                        turn_key=ev.key,
                    )
        elif isinstance(frame, CommitFrame):
            samples, start_ms, end_ms = self.seg.take()
            if samples.size:
                yield UserAudio(samples, ASR_RATE, start_ms, end_ms, item_id=frame.item_id, respond=False)
        elif isinstance(frame, ClearFrame):
            self.seg.take()
        else:
            yield frame


class ASR(Processor):
    """``UserAudio`` → ``Transcript`` (the audio is consumed). A tentative utterance starts its
    transcription in the background; the final one with the same ``turn_key`` takes that result
    (the silence wait and the ASR overlap), any other discards it."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.early: tuple[int, asyncio.Task[str]] | None = None

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if not isinstance(frame, UserAudio):
            yield frame
            return
        early, self.early = self.early, None
        if early is not None and (frame.tentative or early[0] != frame.turn_key):
            early[1].cancel()
            early = None
        if frame.tentative:
            self.early = (frame.turn_key, asyncio.create_task(self.services.transcribe(frame.samples)))
            return
        text = await (early[1] if early is not None else self.services.transcribe(frame.samples))
        yield Transcript(text.strip(), frame.start_ms, frame.end_ms, item_id=frame.item_id, respond=frame.respond)


@dataclass
class LLMOptions:
    max_tokens: int = 64
    temperature: float = 0.0


class LLM(Processor):
    """Adds transcripts to the conversation and streams replies: on a ``Transcript`` that asks
    for one, or on ``ResponseRequest``. Cancelling ``process`` (barge-in) aborts the engine
    request at once (``AsyncEngine.generate`` aborts when its consumer leaves)."""

    interruptible = True

    def __init__(self, services: Services, conversation: Conversation, options: LLMOptions | None = None) -> None:
        self.services = services
        self.conversation = conversation
        self.options = options or LLMOptions()
        self.active: str | None = None

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, Transcript):
            self.conversation.add("user", frame.text, frame.item_id or None)
            yield frame
            if frame.respond and frame.text:  # nothing was said (noise): no reply
                async for out in self._reply(None):
                    yield out
        elif isinstance(frame, ResponseRequest):
            async for out in self._reply(frame.instructions):
                yield out
        else:
            yield frame

    async def _reply(self, instructions: str | None) -> AsyncIterator[Frame]:
        from engine.sampling_params import SamplingParams

        conv = self.conversation
        response_id = conv.new_id("resp")
        engine = self.services.llm
        if instructions:
            conv.instructions = instructions
        item = conv.add("assistant")
        self.active = response_id
        yield LLMStarted(response_id, item_id=item.id)
        params = SamplingParams(max_tokens=self.options.max_tokens, temperature=self.options.temperature)
        final, error = None, None
        ids: list[int] = []
        try:
            max_len = getattr(engine, "max_model_len", None)
            ids = conv.prompt_ids(engine.tokenizer, max_len - self.options.max_tokens if max_len else None)
            # Response ids count per session; the engine is shared by every session, so its request
            # id needs a process-unique suffix.
            async for out in engine.generate(f"{response_id}-{uuid.uuid4().hex[:12]}", ids, params):
                final = out
                delta = out.outputs[0].delta_text
                if delta:
                    if not item.truncated:
                        item.text += delta
                    yield TextDelta(response_id, delta)
        except Exception as exc:  # noqa: BLE001 - refused (prompt too long, queue full) or failed: the reply fails
            error = f"{type(exc).__name__}: {exc}"
        self.active = None
        yield LLMDone(
            response_id,
            item.text,
            prompt_tokens=len(ids),
            completion_tokens=len(final.outputs[0].token_ids) if final else 0,
            cached_tokens=final.num_cached_tokens if final else 0,
            error=error,
        )

    async def on_interrupt(self) -> None:
        self.active = None


_SENTENCE_END = re.compile(r"[.!?;:](?:[\"')\]]*)\s+|\n+")
_CLAUSE_END = re.compile(r",\s+")
FIRST_CLAUSE_WORDS = 4  # the reply's first clause of at least this many words is spoken on its own


class Sentences(Processor):
    """Reply text → ``Sentence`` frames as soon as each sentence is complete (TTS starts on the
    first one); the rest is flushed at ``LLMDone``. Text deltas pass through."""

    interruptible = True

    def __init__(self) -> None:
        self.buf = ""
        self.index = 0

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, LLMStarted):
            self.buf, self.index = "", 0
            yield frame
        elif isinstance(frame, TextDelta):
            yield frame
            self.buf += frame.text
            while (m := self._boundary()) is not None:
                text, self.buf = self.buf[: m.end()].strip(), self.buf[m.end() :]
                if text:
                    yield Sentence(frame.response_id, text, self.index)
                    self.index += 1
        elif isinstance(frame, LLMDone):
            if self.buf.strip():
                yield Sentence(frame.response_id, self.buf.strip(), self.index)
            self.buf, self.index = "", 0
            yield frame
        else:
            yield frame

    def _boundary(self) -> re.Match[str] | None:
        """End of the next sentence; for the first piece also a clause (sooner first audio)."""
        m = _SENTENCE_END.search(self.buf)
        if self.index == 0:
            c = _CLAUSE_END.search(self.buf)
            if (
                c is not None
                and (m is None or c.start() < m.start())
                and len(self.buf[: c.start()].split()) >= FIRST_CLAUSE_WORDS
            ):
                return c
        return m

    async def on_interrupt(self) -> None:
        self.buf, self.index = "", 0


@dataclass
class TTSOptions:
    enabled: bool = True
    voice: str | None = None
    sample_rate: int = 24_000


class TTS(Processor):
    """``Sentence`` → ``TTSAudio`` chunks at ``options.sample_rate`` (consumed); after the
    reply's ``LLMDone``, ``TTSDone``. Cancelling ``process`` closes the TTS stream, which stops
    that request inside the TTS engine."""

    interruptible = True

    def __init__(self, services: Services, options: TTSOptions | None = None) -> None:
        self.services = services
        self.options = options or TTSOptions()

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, Sentence):
            if not (self.options.enabled and self.services.tts is not None):
                return
            first = True
            async for chunk in self.services.speak(frame.text, self.options.voice, self.options.sample_rate):
                if chunk.size:
                    yield TTSAudio(
                        frame.response_id, chunk, self.options.sample_rate, frame.index, frame.text if first else ""
                    )
                    first = False
        elif isinstance(frame, LLMDone):
            yield frame
            yield TTSDone(frame.response_id)
        else:
            yield frame
