"""The Whisper encoder's batcher: ≤30 s windows queued by priority, encoded together on a worker
thread, each caller's future resolved with its encoder output and no-speech probability.

A pass computes the log-mel features, the encoder over the 30 s window, the cross-attention K/V
(cached by the decoder adapter) and Whisper's no-speech probability, for the whole batch, off the
decode loop. A pass that nobody waits for any more stops at its next layer.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

import numpy as np

from engine import openmp
from modalities.asr.model import WhisperModel

RATE = 16_000

_EncoderJob = tuple[np.ndarray, list[int]]  # (≤30 s window audio, decoder prompt ids)
# Queued: (priority, arrival, job, caller's future); the arrival breaks ties, FIFO within a priority.
_Queued = tuple[int, int, _EncoderJob, asyncio.Future[Any]]


class _EncoderAbandoned(Exception):
    """Every caller of the running encoder batch went away (a voice turn's speculative ASR when
    the speaker goes on): the pass stops at its next layer instead of running to the end."""


class EncoderBatcher:
    """``await encode(audio, prompt_ids, priority)`` → (encoder output [frames, d_model], no-speech
    probability under ``prompt_ids``). The lowest priority queued goes first; a batch holds up to
    ``max_batch`` windows, except that on a CPU a window of priority < 0 runs alone. Runs on the
    event loop of the latest ``ensure_loop`` caller; ``close`` stops it."""

    def __init__(self, whisper: WhisperModel, adapter: Any, no_speech_id: int, max_batch: int) -> None:
        self.whisper, self.adapter, self.max_batch = whisper, adapter, max_batch
        self._sot = whisper.tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
        self._no_speech = no_speech_id
        self._queue: asyncio.PriorityQueue[_Queued] | None = None
        self._task: asyncio.Task[None] | None = None
        self._arrivals = itertools.count()
        self._abandoned: list[asyncio.Future[Any]] | None = None  # the running batch's futures
        self._pass_thread: int | None = None  # the thread running this batcher's pass (models are shared)
        for layer in whisper.model.model.encoder.layers:
            layer.register_forward_pre_hook(self._stop_if_abandoned)
        self.num_batches = 0
        self.num_abandoned = 0

    def ensure_loop(self) -> None:
        """A caller on a new event loop (a test, a worker running each call under ``asyncio.run``)
        gets a fresh batcher loop."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._queue = asyncio.PriorityQueue()
            self._task = loop.create_task(self._loop())

    def close(self) -> None:
        if self._task is not None:
            if not self._task.get_loop().is_closed():
                self._task.cancel()
            self._task = None

    async def encode(self, audio: np.ndarray, prompt_ids: list[int], priority: int = 0) -> tuple[Any, float]:
        self.ensure_loop()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        assert self._queue is not None
        await self._queue.put((priority, next(self._arrivals), (audio, prompt_ids), fut))
        return await fut

    async def _loop(self) -> None:
        assert self._queue is not None
        # On a CPU a batch of n windows takes n times one window (185 ms each for tiny.en here):
        # batching adds no encoder throughput, it only holds every result until the last. Bulk
        # windows still batch (their decodes then start together and batch better: 36-37 audio-s/s
        # on 32 clips with batches of 8, 31 with 2); an interactive window (priority < 0) runs
        # alone, so a voice turn's transcript does not wait for other queued windows. It does wait
        # for a pass already running: up to max_batch bulk windows (docs/BENCHMARKS.md).
        on_cpu = self.whisper.model.device.type == "cpu"
        try:
            while True:
                first = await self._queue.get()
                limit = 1 if on_cpu and first[0] < 0 else self.max_batch
                batch = [first]
                while len(batch) < limit and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                await self._encode_batch([(job, fut) for _, _, job, fut in batch])
                # Hold no encoder output past its request: its cross K/V are freed with it.
                del batch, first
        finally:  # closed: what is still queued will never run
            while not self._queue.empty():
                self._queue.get_nowait()[3].cancel()

    async def _encode_batch(self, batch: list[tuple[_EncoderJob, asyncio.Future[Any]]]) -> None:
        live = [(a, f) for a, f in batch if not f.done()]
        if not live:
            return
        self._abandoned = [f for _, f in live]
        try:
            outs = await openmp.to_thread(self.run, [a for a, _ in live])
        except _EncoderAbandoned:
            self.num_abandoned += 1
            return
        except asyncio.CancelledError:  # closed mid-pass: its callers get no result
            for _, f in live:
                f.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - fail the waiters, keep the loop alive
            for _, f in live:
                if not f.done():
                    f.set_exception(exc)
            return
        finally:  # both cleared: a stale thread id must not match another batcher's pass
            self._abandoned = self._pass_thread = None
        for (_, f), out in zip(live, outs, strict=True):
            if not f.done():
                f.set_result(out)

    def _stop_if_abandoned(self, *_: Any) -> None:
        """Encoder layer pre-hook (worker thread): a cancelled future is done, and done is final.
        Every batcher over a shared model hooks its layers: only this batcher's pass may stop."""
        futures = self._abandoned
        if futures is not None and threading.get_ident() == self._pass_thread and all(f.done() for f in futures):
            raise _EncoderAbandoned

    def run(self, jobs: list[_EncoderJob]) -> list[tuple[Any, float]]:
        """One pass over ``jobs`` (worker thread)."""
        import torch

        model = self.whisper.model
        self._pass_thread = threading.get_ident()
        feats = self.whisper.feature_extractor([a for a, _ in jobs], sampling_rate=RATE, return_tensors="pt")
        with torch.inference_mode():
            hidden = model.model.encoder(
                input_features=feats.input_features.to(model.device, model.dtype)
            ).last_hidden_state
            outs = [hidden[i].clone() for i in range(len(jobs))]
            # Cross-attention K/V (cached) and Whisper's no-speech probability, read at the
            # <|startoftranscript|> position.
            logits = self.adapter.prompt_logits(outs, [p[: p.index(self._sot) + 1] for _, p in jobs])
            no_speech = torch.softmax(logits.float(), -1)[:, self._no_speech].tolist()
        self.num_batches += 1
        return list(zip(outs, no_speech, strict=True))
