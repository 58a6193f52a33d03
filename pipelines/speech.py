"""The speech processors: resample → VAD → ASR → (the reply stage, ``pipelines.reply``) →
sentences → TTS.

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
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from modalities.audio import ASR_RATE
from modalities.stream_resample import Resampler
from modalities.tts.text import SentenceSplitter
from pipelines.frames import (
    AudioFrame,
    ClearFrame,
    CommitFrame,
    ErrorFrame,
    Frame,
    Heard,
    Interrupt,
    LLMDone,
    LLMStarted,
    Sentence,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    TimedOut,
    ToolCallStarted,
    Transcript,
    TTSAudio,
    TTSDone,
    TurnReset,
    UserAudio,
)
from pipelines.processor import Processor
from pipelines.services import Services
from pipelines.speculation import SpeechPrefetch
from pipelines.vad import BufferFull, VADConfig, VADSegmenter

if TYPE_CHECKING:
    from modalities.asr.types import Transcript as Transcription


class Resample(Processor):
    """``AudioFrame``s to ``rate`` Hz (streaming: no clicks at chunk boundaries)."""

    def __init__(self, rate: int = ASR_RATE) -> None:
        self.rate = rate
        self._streams: dict[int, Resampler] = {}

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, AudioFrame) and frame.sample_rate != self.rate:
            rs = self._streams.setdefault(frame.sample_rate, Resampler(frame.sample_rate, self.rate))
            yield replace(frame, samples=rs(frame.samples), sample_rate=self.rate)
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

    def end_turn(self, key: int) -> None:
        """The pause with ``key`` ends its turn (semantic VAD): once ``complete_ms`` silent, if no
        speech came since (a verdict on an older pause changes nothing)."""
        if key == self.seg.paused_key:
            self.seg.judged_key = key

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, AudioFrame):
            try:
                events = self.seg.feed(frame.samples)
            except BufferFull as exc:
                if frame.refund is not None:
                    await frame.refund()
                yield ErrorFrame(
                    f"{exc}; this audio was dropped",
                    stage=self.name,
                    code="input_audio_buffer_full",
                    error_type="invalid_request_error",
                    event_id=frame.event_id,
                )
                return
            for ev in events:
                if ev.kind == "start":
                    yield SpeechStarted(ev.ms, item_id=self._next_item())
                    if self.config.interrupt_response:
                        yield Interrupt("speech_started", created=frame.created)  # (wire order: the audio's)
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
        elif isinstance(frame, CommitFrame) and frame.idle and self.seg.voiced:
            yield TimedOut(frame.item_id, committed=False)  # (the user speaks: the timeout is off)
        elif isinstance(frame, CommitFrame):
            speaking = self.seg.speaking
            samples, start_ms, end_ms = self.seg.take()
            if speaking:
                yield TurnReset()
            if frame.idle:  # (server VAD dropped the silence: a moment of it if none is left)
                if not samples.size:
                    samples, start_ms = np.zeros(ASR_RATE // 10, np.float32), max(0, end_ms - 100)
                yield TimedOut(frame.item_id, end_ms)
            if samples.size:
                yield UserAudio(samples, ASR_RATE, start_ms, end_ms, item_id=frame.item_id, respond=False, judged=False)
            else:  # (server VAD took the audio first): the item fails, not waits for a transcript
                yield ErrorFrame(
                    "the input audio buffer was empty",
                    stage=self.name,
                    code="input_audio_buffer_commit_empty",
                    error_type="invalid_request_error",
                    item_id=frame.item_id,
                )
        elif isinstance(frame, ClearFrame):
            if self.seg.speaking:
                yield TurnReset()
            self.seg.take()
        else:
            yield frame


@dataclass
class ASROptions:
    language: str | None = None  # None: English for an English-only model, else detected
    prompt: str | None = None  # Whisper's prompt: names and terms the speech may use
    priority: int = 0  # of its transcriptions (``TranscriptionRequest.priority``)
    logprobs: bool = False  # ``Heard`` carries the transcript's token logprobs


class ASR(Processor):
    """``UserAudio`` → ``Heard`` (for the client, at once) and ``Transcript`` (the audio is
    consumed); a barge-in while an utterance is transcribed cancels its reply (its
    ``Transcript`` does not ``respond``). A tentative utterance starts its transcription in
    the background; the final one with the same ``turn_key`` takes that result
    (the silence wait and the ASR overlap) if the language, prompt and logprobs are still those it ran
    with, any other discards it, and so does ``SpeechResumed``.
    In a concurrent run, a background transcript still unclaimed when it is ready is also passed
    on as a tentative ``Transcript`` (the LLM stage may start the reply speculatively, and judge
    whether the pause ends the turn)."""

    def __init__(self, services: Services, options: ASROptions | None = None) -> None:
        self.services = services
        self.options = options or ASROptions()  # live: a session.update changes it in place
        self.early: tuple[tuple[int, str | None, str | None, bool], asyncio.Task[Transcription]] | None = None

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, SpeechResumed):
            self.close()
            yield frame
            return
        if not isinstance(frame, UserAudio):
            yield frame
            return
        early, self.early = self.early, None
        key = (frame.turn_key, self.options.language, self.options.prompt, self.options.logprobs)
        if early is not None and (frame.tentative or early[0] != key):
            early[1].cancel()
            early = None
        if frame.tentative:
            self.early = (key, asyncio.create_task(self._early(frame)))
            return
        taken = self.turns_taken
        heard = await (early[1] if early is not None else self._transcribe(frame))
        text = heard.text.strip()
        respond = frame.respond and self.turns_taken == taken  # (a barge-in meanwhile: no reply)
        yield Heard(text, frame.start_ms, frame.end_ms, item_id=frame.item_id, logprobs=heard.logprobs)
        yield Transcript(text, frame.start_ms, frame.end_ms, item_id=frame.item_id, respond=respond)

    async def _transcribe(self, frame: UserAudio) -> Transcription:
        o = self.options
        vad = False if frame.judged else None  # (None: the ASR's own rule, ``TranscriptionRequest.vad``)
        return await self.services.transcribe(frame.samples, o.priority, o.language, o.prompt, o.logprobs, vad)

    async def _early(self, frame: UserAudio) -> Transcription:
        heard = await self._transcribe(frame)
        unclaimed = self.early is not None and self.early[1] is asyncio.current_task()
        if unclaimed and self.emit is not None:  # (for a speculative reply and a semantic VAD's verdict)
            self.emit(
                Transcript(
                    heard.text.strip(),
                    frame.start_ms,
                    frame.end_ms,
                    item_id=frame.item_id,
                    respond=frame.respond,
                    tentative=True,
                    turn_key=frame.turn_key,
                )
            )
        return heard

    def close(self) -> None:
        early, self.early = self.early, None
        if early is not None:
            early[1].cancel()


class Sentences(Processor):
    """Reply text → ``Sentence`` frames as soon as each sentence is complete (TTS starts on the
    first one); the rest is flushed at ``LLMDone``. Text deltas pass through."""

    interruptible = True

    def __init__(self) -> None:
        self.splitter = SentenceSplitter()
        self.reply: str | None = None  # whose text the splitter holds

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, LLMStarted):
            self.splitter, self.reply = SentenceSplitter(), frame.response_id
            yield frame
        elif isinstance(frame, TextDelta):
            yield frame
            first = self.splitter.index
            for k, text in enumerate(self.splitter.feed(frame.text)):
                yield Sentence(frame.response_id, text, first + k)
        elif isinstance(frame, LLMDone | ToolCallStarted):  # (the text before a call is whole)
            index = self.splitter.index
            if rest := self.splitter.flush():
                yield Sentence(frame.response_id, rest, index)
            yield frame
        else:
            yield frame

    async def on_interrupt(self, by: Interrupt) -> None:
        if by.cancels(self.reply):
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
    """``Sentence`` → ``TTSAudio`` chunks at the reply's rate (its ``LLMStarted``'s, else
    ``options.sample_rate`` as the reply starts) (consumed); after the
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
        self.rates: dict[str, int] = {}  # each spoken reply's rate, fixed when it starts

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, LLMStarted):
            if not spoken(frame.audio, self.options, self.services):
                self.silent.add(frame.response_id)
            else:
                self.rates[frame.response_id] = frame.sample_rate or self.options.sample_rate
                if frame.voice is not None:
                    self.voices[frame.response_id] = frame.voice
            yield frame
        elif isinstance(frame, Sentence):
            if frame.response_id in self.silent:
                if self.prefetch is not None and frame.index == 0:
                    self.prefetch.cancel()  # a speculative first sentence nobody will hear
                return
            o, voice = self.options, self.voices.get(frame.response_id)
            rate = self.rates.get(frame.response_id, o.sample_rate)
            early = None
            if self.prefetch is not None and frame.index == 0:
                if voice is None and rate == o.sample_rate:
                    early = self.prefetch.take(frame.text)
                else:  # made in the session's voice or rate: nobody will hear it
                    self.prefetch.cancel()
            chunks = (
                early.replay()
                if early is not None
                else self.services.speak(frame.text, voice or o.voice, rate, o.priority, o.speed)
            )
            first = True
            try:
                async for chunk in chunks:
                    if chunk.size:
                        yield TTSAudio(frame.response_id, chunk, rate, frame.index, frame.text if first else "")
                        first = False
            finally:
                if early is not None:
                    early.cancel()  # a barge-in left the replay: stop the synthesis too
        elif isinstance(frame, LLMDone):
            self.silent.discard(frame.response_id)
            self.voices.pop(frame.response_id, None)
            self.rates.pop(frame.response_id, None)
            yield frame
            yield TTSDone(frame.response_id)
        else:
            yield frame

    async def on_interrupt(self, by: Interrupt) -> None:
        if by.response_id is not None:  # a client's cancel of one reply (its LLMDone may never come)
            self.silent.discard(by.response_id)
            self.voices.pop(by.response_id, None)
            self.rates.pop(by.response_id, None)
            return
        self.silent.clear()  # the cut replies' LLMDone may never come
        self.voices.clear()
        self.rates.clear()
        self.close()

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.cancel()
