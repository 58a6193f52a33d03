"""What a Piper worker does next: a stretch of audio for the request whose listener runs out of
audio first (earliest deadline first).

A request's audio is made in order, in segments: a text piece's front run (phoneme ids → latent
frames, ``modalities.tts.piper_voice``) with the decode of its first frames, then the decode of
its following frames, each segment twice as long as the audio the request has in hand (at least
``MIN_FRAMES``, at most the rest of the sentence). So a request with little buffered gets short
segments, soon, and one with seconds in hand long ones (few decodes, little context decoded
twice). Segments of one request may be decoded by several workers at once; they are numbered in
audio order, and ``PieceJob.deliver`` emits them in that order. While a piece's front runs,
another worker may run the next piece's front ahead of time. Nothing of a request runs beside its
first segment: sharing the cores, that would only delay its first audio.

A request is due when its listener would run dry: before its first audio, at its arrival; once
audio flows, when the audio made so far, plus that of its segments in synthesis, has played from
its first chunk. Earliest deadline first within four classes, in this order:

1. a live voice turn's (priority below 0) first chunk;
2. a live turn's later audio when it has under ``LIVE_HORIZON_S`` in hand (a conversation's
   reply does not run dry for the sake of other work);
3. any other request's first chunk (short);
4. the rest of the audio: a request about to run dry before one with seconds buffered; among
   those more than ``LATE_S`` behind (already stalling), the one with the least audio made.

Deadlines alone would do in a server that keeps up, where streams have audio in hand. Under
overload every stream falls behind, its deadline sinks into the past, and the streams furthest
behind (the oldest) would hold everything else: a new request's first audio, and then its rest,
until the backlog is gone (tens of seconds). So first chunks, a small cost each, come first, and
late streams are served least-made first: a short request finishes soon, a long one goes on
when the short ones are done. Pure bookkeeping: the engine calls it under its lock.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from modalities.tts.piper_voice import CONTEXT_FRAMES, Latent
from modalities.tts.protocol import TTSUsage

MIN_FRAMES = 32  # of a segment after a request's first (each decodes up to 24 frames of context too)
LIVE_HORIZON_S = 1.0  # a live turn's audio in hand below which it goes before others' first chunks
LATE_S = 0.25  # streams further behind than this share what is made: the one with least made first
END = object()  # on a job's queue after its last audio


@dataclass(eq=False)
class PieceJob:
    """One request in flight: its text pieces, their latents once computed, how far its audio
    has been handed out (``cursor``) and made, and the audio ``deliver`` (on the request's event
    loop) puts on ``queue`` in order."""

    seq: int
    pieces: list[str]
    length_scale: float
    priority: int
    first_frames: int  # of its first segment
    loop: asyncio.AbstractEventLoop
    arrival: float
    latents: dict[int, list[Latent]] = field(default_factory=dict)  # by piece: one per sentence
    fronting: set[int] = field(default_factory=set)  # pieces whose front runs
    cursor: tuple[int, int, int] = (0, 0, 0)  # the next audio to hand out: piece, sentence, frame
    segments: int = 0  # segments handed out (numbered from 0 in audio order)
    exhausted: bool = False  # every segment is handed out
    running: int = 0  # items in synthesis ...
    running_s: float = 0.0  # ... and the seconds of audio they will make
    started: float | None = None  # when its first audio (or its first piece's failure) came
    made_s: float = 0.0  # seconds of audio made
    cancelled: bool = False
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    done: dict[int, np.ndarray] = field(default_factory=dict)  # audio not emitted yet, by segment
    next_emit: int = 0
    usage: TTSUsage = field(default_factory=TTSUsage)  # the request's, counted as pieces are read

    def deadline(self, now: float) -> float:
        """When its listener runs dry: at its arrival before its first audio, then once the audio
        made (and in synthesis) has played from its first chunk."""
        if self.started is None and not self.running:
            return self.arrival
        start = self.started if self.started is not None else now  # its first chunk is in synthesis
        return start + self.made_s + self.running_s

    def due(self, now: float) -> tuple[int, float, float]:
        """Its order: lower runs first (the module's docstring has the classes)."""
        live, deadline = self.priority < 0, self.deadline(now)
        if self.started is None and not self.running:
            return (0 if live else 2, deadline, 0.0)
        if live and deadline - now < LIVE_HORIZON_S:
            return (1, deadline, 0.0)
        return (3, max(deadline, now - LATE_S), self.made_s + self.running_s)

    def deliver(self, segment: int | None, audio: np.ndarray | BaseException) -> None:
        """Audio of ``segment`` (``None``: an item without audio); emitted in segment order, then
        ``END`` once all is."""
        if isinstance(audio, BaseException):
            self.queue.put_nowait(audio)
            return
        if segment is not None:
            self.done[segment] = audio
        while self.next_emit in self.done:
            self.queue.put_nowait(self.done.pop(self.next_emit))
            self.next_emit += 1
        if self.exhausted and self.next_emit == self.segments:
            self.queue.put_nowait(END)


@dataclass
class Item:
    """A unit of work for ``job``: with ``front``, piece ``piece``'s latents first; with a
    ``segment`` number, the audio of frames ``[start, stop)`` of that piece's sentence
    ``sentence`` (for a front, ``stop`` is the most frames to decode: the sentence is not known
    yet)."""

    job: PieceJob
    piece: int
    front: bool
    segment: int | None = None
    sentence: int = 0
    start: int = 0
    stop: int = 0
    estimate_s: float = 0.0  # of its audio, while it runs
    latent: Latent | None = None  # the sentence's latent frames, to decode


class PieceQueue:
    """The requests with work left. ``frame_s``: seconds of audio per latent frame; with
    ``whole_pieces`` (an uncut voice) a piece's front makes all its audio."""

    def __init__(self, frame_s: float, whole_pieces: bool = False) -> None:
        self.frame_s = frame_s
        self.whole_pieces = whole_pieces
        self.jobs: list[PieceJob] = []

    def add(self, job: PieceJob) -> None:
        self.jobs.append(job)

    def take(self, now: float) -> Item | None:
        """The most urgent request's next item, now counted as running; ``None`` if none waits."""
        best: tuple[tuple[int, float, float, int], Item] | None = None
        for job in self.jobs:
            key = (*job.due(now), job.seq)
            if best is None or key < best[0]:
                item = self._next(job, now)
                if item is not None:
                    best = (key, item)
        if best is None:
            return None
        item = best[1]
        self._hand_out(item)
        return item

    def _next(self, job: PieceJob, now: float) -> Item | None:
        """``job``'s next item: its next audio where it can be made, else the front of a piece ahead."""
        if job.exhausted or job.cancelled or (job.started is None and job.running):
            return None  # (nothing beside a first segment: on a CPU it would slow the first audio)
        piece, sentence, frame = job.cursor
        if piece in job.latents:
            z = job.latents[piece][sentence]
            stop = self._stop(frame, z.shape[2], self._frames(job, now))
            return Item(job, piece, False, None, sentence, frame, stop, (stop - frame) * self.frame_s, z)
        if piece not in job.fronting:
            n = self._frames(job, now)
            return Item(job, piece, True, None, 0, 0, n, 0.0 if self.whole_pieces else n * self.frame_s)
        ahead = piece + 1
        if self.whole_pieces or ahead >= len(job.pieces) or ahead in job.latents or ahead in job.fronting:
            return None
        return Item(job, ahead, True)  # latents only: its audio is handed out when the cursor gets there

    def _frames(self, job: PieceJob, now: float) -> int:
        """Frames for the job's next segment: twice the audio it has in hand (so what it has in
        hand grows quickly, and with it the segments), at least ``MIN_FRAMES``."""
        if job.started is None and not job.running:
            return job.first_frames
        ahead_s = job.deadline(now) - now
        return max(MIN_FRAMES, int(2 * ahead_s / self.frame_s))

    @staticmethod
    def _stop(start: int, length: int, frames: int) -> int:
        stop = start + frames
        return length if stop + 2 * CONTEXT_FRAMES >= length else stop  # no sliver of a sentence left

    def _hand_out(self, item: Item) -> None:
        job = item.job
        job.running += 1
        job.running_s += item.estimate_s
        if item.front:
            job.fronting.add(item.piece)
        if item.piece != job.cursor[0]:
            return  # a front ahead of the cursor: no audio
        item.segment = job.segments
        job.segments += 1
        if not item.front:  # its frames are known: the cursor moves on now
            self._advance(job, item.stop)

    def _advance(self, job: PieceJob, stop: int) -> None:
        """Move the cursor past frame ``stop`` of its sentence."""
        piece, sentence, _ = job.cursor
        sentences = [] if self.whole_pieces else job.latents.get(piece, [])
        if sentence < len(sentences) and stop < sentences[sentence].shape[2]:
            job.cursor = (piece, sentence, stop)
        elif sentence + 1 < len(sentences):
            job.cursor = (piece, sentence + 1, 0)
        else:
            job.latents.pop(piece, None)
            piece += 1
            while job.latents.get(piece) == []:  # a piece with nothing to say (computed ahead)
                del job.latents[piece]
                piece += 1
            job.cursor = (piece, 0, 0)
            job.exhausted = piece >= len(job.pieces)

    def fronted(self, item: Item, latents: list[Latent]) -> int:
        """``item``'s front made ``latents``; returns the frames its segment decodes (0 for a front
        ahead of the cursor, or a piece with no sentence)."""
        job = item.job
        job.fronting.discard(item.piece)
        job.latents[item.piece] = latents
        if item.segment is None:
            if not latents and job.cursor == (item.piece, 0, 0):  # the cursor got here meanwhile
                self._advance(job, 0)
            return 0
        stop = self._stop(0, latents[0].shape[2], item.stop) if latents and not self.whole_pieces else 0
        self._advance(job, stop)
        return stop

    def finish(self, item: Item, audio_s: float, now: float) -> None:
        """``item`` made ``audio_s`` seconds of audio (or failed)."""
        job = item.job
        job.running -= 1
        job.running_s -= item.estimate_s
        job.made_s += audio_s
        job.fronting.discard(item.piece)
        if item.segment == 0:
            job.started = now
        if (job.exhausted or job.cancelled) and not job.running and job in self.jobs:
            self.jobs.remove(job)

    def drop(self, job: PieceJob) -> None:
        """A request that left: nothing more is handed out for it (running items finish unseen)."""
        job.cancelled = True
        job.latents.clear()
        if job in self.jobs and not job.running:
            self.jobs.remove(job)

    def first_pending(self) -> int:
        """Requests waiting for their first audio."""
        return sum(j.started is None and not j.cancelled for j in self.jobs)

    def queued(self) -> int:
        """Requests with audio still to hand out."""
        return sum(not (j.exhausted or j.cancelled) for j in self.jobs)
