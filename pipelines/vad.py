"""Turn detection for a live audio stream: ``modalities.vad.VadStream`` events (the shared VAD)
plus the audio buffer that turns them into utterances, with the Realtime API's ``server_vad``
knobs (``threshold``, ``prefix_padding_ms``, ``silence_duration_ms``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from modalities.audio import ASR_RATE
from modalities.vad import NOISE_SUPPRESSION, NoiseSuppressor, VadParams, VadStream, make_classifier


@dataclass
class VADConfig:
    """``server_vad`` false: no turn detection, audio is buffered until a commit."""

    server_vad: bool = True
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    # Speech starting cancels the reply in flight (barge-in); False: the reply plays out and the
    # new turn's reply follows it.
    interrupt_response: bool = True
    min_speech_ms: int = 150
    # A pause this long starts the turn's work speculatively (ASR, then the reply's LLM and first
    # sentence's TTS), unseen by the client until silence_duration_ms commits the turn (0: off).
    # Short, so the ASR is done by the commit; a pause mid-utterance costs an encoder pass cut
    # short when speech resumes (AsrEngine stops abandoned passes). 60 ms against 150: first audio
    # ~100-150 ms sooner with one voice session (docs/BENCHMARKS.md).
    eager_ms: int = 60
    backend: Literal["webrtc", "silero"] = "webrtc"
    floor_dbfs: float = -50.0  # quieter frames are not speech (modalities.vad.VadParams)
    # "near_field" | "far_field": the detector hears the audio noise-suppressed (the session's
    # noise_reduction; modalities.vad.NoiseSuppressor); the utterances keep the original audio.
    noise_reduction: str | None = None
    # semantic_vad: a pause judged to end the user's turn (``pipelines.turns``: the LLM finds the
    # end of the user's message likely there) ends it once silent ``complete_ms``; any other
    # waits ``silence_duration_ms`` (then the eagerness's longest wait).
    semantic: bool = False
    complete_ms: int = 200


# OpenAI's input audio buffer limit: 15 MiB of pcm16 at 24 kHz (~328 s), here in 16 kHz samples.
MAX_BUFFER_SAMPLES = 15 * (1 << 20) // 2 * ASR_RATE // 24_000


class BufferFull(ValueError):
    """``feed`` would grow the buffered audio past ``max_samples``: that chunk was dropped."""


@dataclass
class VADEvent:
    kind: Literal["start", "pause", "resume", "stop"]
    ms: int  # start: where speech began (padded); pause/stop: where the utterance ends; resume: now
    samples: np.ndarray  # pause/stop: the utterance (so far)
    start_ms: int = 0
    key: int = -1  # pause/stop: the padded end-of-speech sample (equal keys: no speech in between)


class VADSegmenter:
    """Feed 16 kHz float32 chunks of any size; get start/stop events with the utterance audio."""

    def __init__(self, config: VADConfig, max_samples: int = MAX_BUFFER_SAMPLES) -> None:
        self.config = config
        self.max_samples = max_samples
        self.chunks: list[np.ndarray] = []  # audio since sample ``buf_start`` of the input, joined lazily
        self.size = 0  # samples in ``chunks``
        self.buf_start = 0
        self.pos = 0  # samples received
        self.start = 0  # sample where the current speech began
        self.stream: VadStream | None = None
        self.paused_key: int | None = None  # the key of the pause reported, while no speech followed
        self.judged_key: int | None = None  # the key of a pause judged to end its turn (semantic)
        self.origin = 0  # input sample of the stream's time 0
        self.denoiser: NoiseSuppressor | None = None

    def _vad(self) -> VadStream | None:
        """The detector, made at the first chunk after ``take`` (before ``pos`` counts that
        chunk); it lasts across the turns it ends itself."""
        c = self.config
        if not c.server_vad:
            self.stream = None
            return None
        if self.stream is None:
            self.stream = VadStream(make_classifier(c.backend), VadParams())
            self.origin = self.pos
            if self.denoiser is not None:
                self.denoiser.drop_rest()  # (audio from before the new detector's time 0)
        p = self.stream.params
        p.threshold, p.min_speech_ms = c.threshold, c.min_speech_ms
        p.min_silence_ms, p.pad_ms, p.floor_dbfs = c.silence_duration_ms, c.prefix_padding_ms, c.floor_dbfs
        if c.semantic and self.paused_key is not None and self.judged_key == self.paused_key:
            p.min_silence_ms = min(c.complete_ms, c.silence_duration_ms)
        return self.stream

    def _pauses(self) -> list[VADEvent]:
        """After the chunk: a pause once ``eager_ms`` of silence follow the last speech frame of
        an ongoing turn; a resume at any speech frame after it (even a blip too short to start a
        turn: it moves the turn's end, so the paused utterance is no longer the one to commit)."""
        c, s = self.config, self.stream
        if s is None or not s.speaking or not 0 < c.eager_ms < c.silence_duration_ms:
            self.paused_key = None
            return []
        key = self.origin + round(s.end_time * ASR_RATE)
        out = []
        if self.paused_key is not None and key != self.paused_key:
            out.append(VADEvent("resume", self._ms(self.pos), np.zeros(0, np.float32)))
            self.paused_key = None
        if self.paused_key is None and s.silence_ms >= c.eager_ms:
            at = min(self.pos, key)
            utterance = self.buf[self.start - self.buf_start : at - self.buf_start].copy()
            out.append(VADEvent("pause", self._ms(at), utterance, self._ms(self.start), key))
            self.paused_key = key
        return out

    @property
    def buf(self) -> np.ndarray:
        """The buffered audio as one array (appends only add a chunk: no copy per feed)."""
        if len(self.chunks) != 1:
            self.chunks = [np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)]
        return self.chunks[0]

    def _keep_from(self, sample: int) -> None:
        """Drop the buffered audio before input sample ``sample``."""
        rest = self.buf[sample - self.buf_start :].copy()  # free the audio before it
        self.chunks, self.size, self.buf_start = [rest], rest.size, sample

    @property
    def speaking(self) -> bool:
        """Inside a turn the detector has started."""
        return self.stream is not None and self.stream.speaking

    @property
    def voiced(self) -> bool:
        """Speech is heard now (``VadStream.voiced``)."""
        return self.stream is not None and self.stream.voiced

    def _ms(self, sample: int) -> int:
        return sample * 1000 // ASR_RATE

    def feed(self, samples: np.ndarray) -> list[VADEvent]:
        """Events for the next chunk; raises ``BufferFull`` (and drops the chunk) at the size limit."""
        samples = np.asarray(samples, np.float32)
        if self.size + samples.size > self.max_samples:
            raise BufferFull(f"the input audio buffer is full ({self.max_samples / ASR_RATE:.0f} s of audio max)")
        vad = self._vad()
        self.chunks.append(samples)
        self.size += samples.size
        self.pos += samples.size
        if vad is None:
            return []
        out = []
        for ev in vad.push(self._heard(samples)):
            key = self.origin + round(ev.time * ASR_RATE)
            at = min(self.pos, max(self.buf_start, key))
            if ev.kind == "speech_started":
                self.start = at
                out.append(VADEvent("start", self._ms(at), np.zeros(0, np.float32)))
            else:
                utterance = self.buf[self.start - self.buf_start : at - self.buf_start].copy()
                out.append(VADEvent("stop", self._ms(at), utterance, self._ms(self.start), key))
                self._keep_from(at)
                self.paused_key = None  # the turn is over: a pause of it is not resumed
        out += self._pauses()
        if not vad.speaking:  # idle: keep only what a padded start may reach back to
            keep = (self.config.prefix_padding_ms + self.config.min_speech_ms + 100) * ASR_RATE // 1000
            if self.size > 2 * keep:
                self._keep_from(self.buf_start + self.size - keep)
        return out

    def _heard(self, samples: np.ndarray) -> np.ndarray:
        """What the detector hears of a chunk: the chunk, or its noise-suppressed frames (the
        suppressor's ~6 ms delay puts its events that much late: well inside the padding).
        Switching the suppression on, off or to another level loses no sample of the stream."""
        level = NOISE_SUPPRESSION.get(self.config.noise_reduction or "")
        held = self.denoiser
        if level is None:
            self.denoiser = None
            return samples if held is None else np.concatenate([held.rest, samples])
        if held is None or held.level != level:
            self.denoiser = NoiseSuppressor(level)
            if held is not None:
                self.denoiser.rest = held.rest
        return self.denoiser(samples)

    def take(self) -> tuple[np.ndarray, int, int]:
        """The buffered audio (commit or clear) as ``(samples, start_ms, end_ms)``; resets the turn."""
        audio, start = self.buf, self.buf_start
        self.chunks, self.size, self.buf_start = [], 0, self.pos
        self.stream = None  # a fresh detector after a commit or a clear
        self.paused_key = self.judged_key = None
        return audio, self._ms(start), self._ms(self.pos)
