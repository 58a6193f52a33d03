"""The speech processors: resample → VAD → ASR → LLM → sentences → TTS.

Each does one thing and passes every frame it does not handle through unchanged. The services
they call (``Services``: an ASR transcribe function, the LLM ``AsyncEngine``, a TTS engine) are
plain objects, so the same processors run in the real-time session and in the Celery stages.
In a concurrent run, a pause in the user's speech starts the turn's work speculatively
(``pipelines.speculation``): ASR, LLM and the first sentence's TTS, reused if the turn commits
with the same prompt, aborted if speech resumes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineError
from engine.offload import OFF_LOOP_CHARS, run_sized
from gateway.errors import from_engine_error
from modalities.audio import ASR_RATE, Resampler
from modalities.llm.tools import ToolCallStream, declared
from modalities.tts.text import SentenceSplitter
from pipelines.conversation import Conversation, Item
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
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    ToolCall,
    Transcript,
    TTSAudio,
    TTSDone,
    UserAudio,
)
from pipelines.processor import Processor
from pipelines.services import Services
from pipelines.speculation import Buffered, LLMSpeculation, SpeechPrefetch
from pipelines.vad import BufferFull, VADConfig, VADSegmenter

logger = logging.getLogger("mmserve.pipelines")


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
    """Turn detection on 16 kHz audio. With ``config.server_vad`` it emits ``SpeechStarted`` (and,
    with ``interrupt_response``, an ``Interrupt``: barge-in), then ``SpeechStopped`` and the
    utterance as ``UserAudio`` after ``silence_duration_ms`` of silence; after a shorter pause
    (``eager_ms``) a tentative ``UserAudio`` of the speech so far, and ``SpeechResumed`` if speech
    follows it. ``CommitFrame`` turns the buffered audio into one utterance (manual turns);
    ``ClearFrame`` drops it. Audio frames are consumed."""

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
                    if self.config.interrupt_response:
                        yield Interrupt("speech_started")
                elif ev.kind == "resume":
                    yield SpeechResumed()
                else:  # "pause": a tentative utterance for speculation; "stop": the committed one
                    if ev.kind == "stop":
                        yield SpeechStopped(ev.ms, item_id=self.item_id)
                    yield UserAudio(
                        ev.samples,
                        ASR_RATE,
                        ev.start_ms,
                        ev.ms,
                        item_id=self.item_id,
                        respond=self.config.create_response,
                        tentative=ev.kind == "pause",
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


@dataclass
class ASROptions:
    language: str | None = None  # None: English for an English-only model, else detected
    prompt: str | None = None  # Whisper's prompt: names and terms the speech may use
    priority: int = 0  # of its transcriptions (``TranscriptionRequest.priority``)


class ASR(Processor):
    """``UserAudio`` → ``Transcript`` (the audio is consumed). A tentative utterance starts its
    transcription in the background; the final one with the same ``turn_key`` takes that result
    (the silence wait and the ASR overlap) if the language and prompt are still those it ran
    with, any other discards it, and so does ``SpeechResumed``.
    In a concurrent run, a background transcript still unclaimed when it is ready is also passed
    on as a tentative ``Transcript`` (the LLM may start the reply speculatively)."""

    def __init__(self, services: Services, options: ASROptions | None = None) -> None:
        self.services = services
        self.options = options or ASROptions()  # live: a session.update changes it in place
        self.early: tuple[tuple[int, str | None, str | None], asyncio.Task[str]] | None = None

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, SpeechResumed):
            self.close()
            yield frame
            return
        if not isinstance(frame, UserAudio):
            yield frame
            return
        early, self.early = self.early, None
        key = (frame.turn_key, self.options.language, self.options.prompt)
        if early is not None and (frame.tentative or early[0] != key):
            early[1].cancel()
            early = None
        if frame.tentative:
            self.early = (key, asyncio.create_task(self._early(frame)))
            return
        text = await (early[1] if early is not None else self._transcribe(frame))
        yield Transcript(text.strip(), frame.start_ms, frame.end_ms, item_id=frame.item_id, respond=frame.respond)

    async def _transcribe(self, frame: UserAudio) -> str:
        o = self.options
        return await self.services.transcribe(frame.samples, o.priority, o.language, o.prompt)

    async def _early(self, frame: UserAudio) -> str:
        text = await self._transcribe(frame)
        unclaimed = self.early is not None and self.early[1] is asyncio.current_task()
        if unclaimed and self.emit is not None and frame.respond:
            self.emit(Transcript(text.strip(), frame.start_ms, frame.end_ms, item_id=frame.item_id, tentative=True))
        return text

    def close(self) -> None:
        early, self.early = self.early, None
        if early is not None:
            early[1].cancel()


@dataclass
class LLMOptions:
    max_tokens: int = 64
    temperature: float = 0.0
    priority: int = 0  # of the engine requests (lower first under the engine's priority policy)
    # Parse replies for calls of these functions (the conversation's tools; None: off).
    tool_calls: frozenset[str] | None = None


class LLM(Processor):
    """Adds transcripts to the conversation and streams replies: on a ``Transcript`` that asks
    for one, or on ``ResponseRequest``. Cancelling ``process`` (barge-in) aborts the engine
    request at once (``AsyncEngine.generate`` aborts when its consumer leaves).

    A tentative ``Transcript`` starts a speculative reply (and, with ``prefetch``, the synthesis
    of its first sentence) in the background; the next reply takes it if its prompt and sampling
    parameters are the same, otherwise (and on ``SpeechResumed`` or a barge-in) it is aborted."""

    interruptible = True

    def __init__(
        self,
        services: Services,
        conversation: Conversation,
        options: LLMOptions | None = None,
        prefetch: SpeechPrefetch | None = None,
    ) -> None:
        self.services = services
        self.conversation = conversation
        self.options = options or LLMOptions()
        self.prefetch = prefetch
        self.active: str | None = None
        self.speculation: LLMSpeculation | None = None

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, Transcript) and frame.tentative:
            self._speculate(frame.text)
        elif isinstance(frame, SpeechResumed):
            self.close()
        elif isinstance(frame, Transcript):
            self.conversation.add("user", frame.text, frame.item_id or None, audio=True)
            yield frame
            if frame.respond and frame.text:  # nothing was said (noise): no reply
                async for out in self._reply(ResponseRequest()):
                    yield out
            else:
                self.close()
        elif isinstance(frame, ResponseRequest):
            async for out in self._reply(frame):
                yield out
        else:
            yield frame

    def _params(self, req: ResponseRequest | None = None) -> tuple[int, float]:
        """(max_tokens, temperature) of a reply: ``req``'s where it sets them, else the options'."""
        o = self.options
        if req is None:
            return o.max_tokens, o.temperature
        return req.max_tokens or o.max_tokens, o.temperature if req.temperature is None else req.temperature

    def _prompt(self, conv: Conversation, max_tokens: int | None = None) -> list[int]:
        engine = self.services.llm
        max_len = getattr(engine, "max_model_len", None)
        max_tokens = max_tokens or self.options.max_tokens
        return conv.prompt_ids(engine.tokenizer, max_len - max_tokens if max_len else None, max_tokens)

    def _generate(self, request_id: str, ids: list[int], params: tuple[int, float] | None = None) -> AsyncIterator[Any]:
        from engine.sampling_params import SamplingParams

        max_tokens, temperature = params or self._params()
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        # Response ids count per session; the engine is shared by every session, so its request
        # id needs a process-unique suffix.
        request_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
        return self.services.llm.generate(request_id, ids, sampling, priority=self.options.priority)

    def _speculate(self, text: str) -> None:
        """Start the reply the conversation would get if the turn ended with ``text``."""
        self.close()
        if not text or self.conversation.chars() > OFF_LOOP_CHARS:  # a long render would hold the loop
            return
        try:
            ids = self._prompt(self.conversation.answering(text))
        except Exception:  # noqa: BLE001 - the committed turn will report it, not a speculation
            logger.debug("no speculative reply", exc_info=True)
            return
        splitter = SentenceSplitter()
        calls = None if self.options.tool_calls is None else ToolCallStream(self.options.tool_calls)  # not spoken

        def first_sentence(out: Any) -> None:
            """Synthesise the reply's first sentence (the one ``Sentences`` will send) early."""
            if self.prefetch is None or spec.prefetch is not None:
                return
            delta = out.outputs[0].delta_text or ""
            first = splitter.feed(calls.feed(delta) if calls is not None else delta)
            if not first and out.finished:
                first = [splitter.flush()]
            if first and first[0]:
                spec.prefetch = self.prefetch
                self.prefetch.start(first[0])

        spec = LLMSpeculation(ids, self._params(), Buffered(self._generate("spec", ids), first_sentence))
        self.speculation = spec

    async def _reply(self, req: ResponseRequest) -> AsyncIterator[Frame]:
        """A reply to the conversation, or to ``req.input``, under ``req.instructions`` if given
        (for this reply only); an out-of-band one is not added to the conversation and leaves a
        speculative reply for the next turn alone."""
        conv = self.conversation
        response_id = conv.new_id("resp")
        item = Item(conv.new_id(), "assistant") if req.out_of_band else conv.add("assistant")
        prompt = conv
        if req.out_of_band or req.input is not None or req.instructions or req.tools is not None:
            prompt = conv.context(req.input, item, req.instructions, req.tools)
        names = self.options.tool_calls if req.tools is None else declared(req.tools) if req.tools else None
        self.active = response_id
        yield LLMStarted(
            response_id, item.id, req.audio, req.out_of_band, req.metadata, req.voice, calls=names is not None
        )
        final, error, mapped = None, None, None
        ids: list[int] = []
        spec = None
        if not req.out_of_band:
            spec, self.speculation = self.speculation, None
        try:
            # A long render runs on a thread, over a snapshot: the session may add or delete items
            # meanwhile; the items the render left out stay out of the live conversation.
            rendered, params = prompt.snapshot(), self._params(req)
            ids = await run_sized(rendered.chars(), self._prompt, rendered, params[0])
            if prompt is conv:
                conv.keep_from(rendered)
            if spec is not None and not spec.matches(ids, params):
                spec.cancel()
                spec = None
            outputs = spec.outputs.replay() if spec is not None else self._generate(response_id, ids, params)
            calls = None if names is None else ToolCallStream(names)
            async for out in outputs:
                final = out
                delta = out.outputs[0].delta_text
                if calls is not None:  # the text of a call is not said: it becomes a ToolCall
                    delta = calls.feed(delta)
                if delta:
                    if not item.truncated:
                        item.text += delta
                    yield TextDelta(response_id, delta)
            if calls is not None:
                async for frame in self._calls(response_id, item, calls, req.out_of_band):
                    yield frame
        except Exception as exc:  # noqa: BLE001 - refused (prompt too long, queue full) or failed: the reply fails
            error = f"{type(exc).__name__}: {exc}"
            mapped = from_engine_error(exc) if isinstance(exc, EngineError) else None
        finally:
            if spec is not None:
                spec.outputs.cancel()  # a barge-in left the replay: stop the generation too
        self.active = None
        yield LLMDone(
            response_id,
            item.text,
            prompt_tokens=len(ids),
            completion_tokens=len(final.outputs[0].token_ids) if final else 0,
            cached_tokens=final.num_cached_tokens if final else 0,
            error=error,
            error_type=mapped.type if mapped is not None else "server_error",
            error_code=mapped.code if mapped is not None else None,
        )

    async def _calls(
        self, response_id: str, item: Item, calls: ToolCallStream, out_of_band: bool
    ) -> AsyncIterator[Frame]:
        """The reply's held-back text, then its calls: each a conversation item after the reply's
        (not for an out-of-band reply) and a ``ToolCall``."""
        tail, found = calls.finish()
        if tail:
            if not item.truncated:
                item.text += tail
            yield TextDelta(response_id, tail)
        after = item.id
        for call in found:
            fields = {"kind": "function_call", "call_id": call.id, "name": call.name, "response_id": response_id}
            if out_of_band:
                call_item = Item(self.conversation.new_id(), "assistant", call.arguments, **fields)
            else:
                call_item = self.conversation.add("assistant", call.arguments, after=after, **fields)
            after = call_item.id
            yield ToolCall(response_id, call_item.id, call.id, call.name, call.arguments)

    async def on_interrupt(self) -> None:
        self.active = None
        self.close()

    def close(self) -> None:
        spec, self.speculation = self.speculation, None
        if spec is not None:
            spec.cancel()


class Sentences(Processor):
    """Reply text → ``Sentence`` frames as soon as each sentence is complete (TTS starts on the
    first one); the rest is flushed at ``LLMDone``. Text deltas pass through."""

    interruptible = True

    def __init__(self) -> None:
        self.splitter = SentenceSplitter()

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, LLMStarted):
            self.splitter = SentenceSplitter()
            yield frame
        elif isinstance(frame, TextDelta):
            yield frame
            first = self.splitter.index
            for k, text in enumerate(self.splitter.feed(frame.text)):
                yield Sentence(frame.response_id, text, first + k)
        elif isinstance(frame, LLMDone | ToolCall):  # (the text before a call is whole)
            index = self.splitter.index
            if rest := self.splitter.flush():
                yield Sentence(frame.response_id, rest, index)
            yield frame
        else:
            yield frame

    async def on_interrupt(self) -> None:
        self.splitter = SentenceSplitter()


@dataclass
class TTSOptions:
    enabled: bool = True
    voice: str | None = None
    sample_rate: int = 24_000
    priority: int = 0  # of the synthesis requests (``TTSRequest.priority``)
    speed: float = 1.0  # ``TTSRequest.speed``


def spoken(asked: bool | None, options: TTSOptions, services: Services) -> bool:
    """Whether a reply is spoken: as its ``response.create`` asks (``asked``), else as the
    session's options say; never without a TTS engine."""
    return (options.enabled if asked is None else asked) and services.tts is not None


class TTS(Processor):
    """``Sentence`` → ``TTSAudio`` chunks at ``options.sample_rate`` (consumed); after the
    reply's ``LLMDone``, ``TTSDone``. Cancelling ``process`` closes the TTS stream, which stops
    that request inside the TTS engine. A first sentence that ``prefetch`` already synthesises
    (a speculative reply's) is taken from there."""

    interruptible = True

    def __init__(
        self, services: Services, options: TTSOptions | None = None, prefetch: SpeechPrefetch | None = None
    ) -> None:
        self.services = services
        self.options = options or TTSOptions()
        self.prefetch = prefetch
        self.silent: set[str] = set()  # replies not spoken: text only, asked so or as the session says
        self.voices: dict[str, str] = {}  # replies asked for in a voice of their own

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, LLMStarted):
            if not spoken(frame.audio, self.options, self.services):
                self.silent.add(frame.response_id)
            elif frame.voice is not None:
                self.voices[frame.response_id] = frame.voice
            yield frame
        elif isinstance(frame, Sentence):
            if frame.response_id in self.silent:
                if self.prefetch is not None and frame.index == 0:
                    self.prefetch.cancel()  # a speculative first sentence nobody will hear
                return
            o, voice = self.options, self.voices.get(frame.response_id)
            early = None
            if self.prefetch is not None and frame.index == 0:
                if voice is None:
                    early = self.prefetch.take(frame.text)
                else:  # made in the session's voice: nobody will hear it
                    self.prefetch.cancel()
            chunks = (
                early.replay()
                if early is not None
                else self.services.speak(frame.text, voice or o.voice, o.sample_rate, o.priority, o.speed)
            )
            first = True
            try:
                async for chunk in chunks:
                    if chunk.size:
                        yield TTSAudio(
                            frame.response_id, chunk, o.sample_rate, frame.index, frame.text if first else ""
                        )
                        first = False
            finally:
                if early is not None:
                    early.cancel()  # a barge-in left the replay: stop the synthesis too
        elif isinstance(frame, LLMDone):
            self.silent.discard(frame.response_id)
            self.voices.pop(frame.response_id, None)
            yield frame
            yield TTSDone(frame.response_id)
        else:
            yield frame

    async def on_interrupt(self) -> None:
        self.silent.clear()  # the cut replies' LLMDone may never come
        self.voices.clear()
        self.close()

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.cancel()
