"""The Whisper encoder's batcher: ≤30 s windows queued by priority, encoded together on a worker
thread, each caller's future resolved with its encoder output and no-speech probability.

A pass computes the log-mel features, the encoder over the 30 s window, the cross-attention K/V
(cached by the decoder adapter) and Whisper's no-speech probability, for the whole batch, off the
decode loop. It runs as steps (the features and convolutions, each layer, the end), and between
two steps the batcher looks at its callers and its queue: a pass that nobody waits for any more
stops there, and a bulk pass lets interactive windows (voice turns) that came in meanwhile run
their whole pass first.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from engine import openmp
from engine.foreground import FOREGROUND, Turns
from modalities.asr.model import WhisperModel

RATE = 16_000

_EncoderJob = tuple[np.ndarray, list[int]]  # (≤30 s window audio, decoder prompt ids)
# Queued: (priority, arrival, job, caller's future); the arrival breaks ties, FIFO within a priority.
_Queued = tuple[int, int, _EncoderJob, asyncio.Future[Any]]


class EncoderBatcher:
    """``await encode(audio, prompt_ids, priority)`` → (encoder output [frames, d_model], no-speech
    probability under ``prompt_ids``). The lowest priority queued goes first; a batch holds up to
    ``max_batch`` windows, except that on a CPU a window of priority < 0 runs alone. Such a window
    arriving while a bulk pass (priority ≥ 0) runs is encoded before that pass's next layer step,
    and a bulk pass waits before its layer steps while a foreground hold runs (``engine.foreground``),
    at most ``foreground_wait_s`` (``_yield``). Runs on the event loop of the latest
    ``ensure_loop`` caller; ``close`` stops it."""

    def __init__(
        self, whisper: WhisperModel, adapter: Any, no_speech_id: int, max_batch: int, foreground_wait_s: float = 0.0
    ) -> None:
        self.whisper, self.adapter, self.max_batch = whisper, adapter, max_batch
        self._turns = Turns(foreground_wait_s)
        self._on_cpu = whisper.model.device.type == "cpu"
        self._sot = whisper.tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
        self._no_speech = no_speech_id
        self._heap: list[_Queued] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # One thread runs every step, keeping its OpenMP team from step to step (released after
        # each pass): steps on asyncio's pool hopped threads and made a team each time, ~20 ms
        # more per pass here.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asr-encoder")
        self._arrivals = itertools.count()
        from modalities.asr.features import LogMel  # torch: not at import (the CLI starts light)

        self._log_mel = LogMel(whisper.feature_extractor)
        self.num_batches = 0
        self.num_abandoned = 0

    @property
    def num_queued(self) -> int:
        return len(self._heap)

    def ensure_loop(self) -> None:
        """A caller on a new event loop (a test, a worker running each call under ``asyncio.run``)
        gets a fresh batcher loop."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._heap, self._wake = [], asyncio.Event()  # another loop's futures are dead
            self._task = loop.create_task(self._loop())

    def close(self) -> None:
        if self._task is not None:
            if not self._task.get_loop().is_closed():
                self._task.cancel()
            self._task = None

    async def encode(self, audio: np.ndarray, prompt_ids: list[int], priority: int = 0) -> tuple[Any, float]:
        self.ensure_loop()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (priority, next(self._arrivals), (audio, prompt_ids), fut))
        self._wake.set()
        return await fut

    async def detect_language(self, enc: Any, lang_ids: list[int]) -> int:
        """The id among ``lang_ids`` (ascending) of the language Whisper hears in an encoded window:
        the likeliest language token right after ``<|startoftranscript|>``, as transformers'
        ``detect_language`` reads it. Runs on the encoder's thread, between a pass's steps."""
        return await self._run(self._detect, enc, lang_ids)

    def _detect(self, enc: Any, lang_ids: list[int]) -> int:
        import torch

        with torch.inference_mode():
            logits = self.adapter.prompt_logits([enc], [[self._sot]])[0]
            return lang_ids[int(logits[torch.tensor(lang_ids, device=logits.device)].argmax())]

    async def _loop(self) -> None:
        # On a CPU a batch of n windows takes n times one window (185 ms each for tiny.en here):
        # batching adds no encoder throughput, it only holds every result until the last. Bulk
        # windows still batch (their decodes then start together and batch better: 36-37 audio-s/s
        # on 32 clips with batches of 8, 31 with 2); an interactive window (priority < 0) runs
        # alone, so a voice turn's transcript does not wait for other windows (docs/BENCHMARKS.md).
        try:
            while True:
                while not self._heap:
                    self._wake.clear()
                    await self._wake.wait()
                batch = self._take(interactive_only=False)
                try:
                    await self._pass([(job, fut) for _, _, job, fut in batch], yields=batch[0][0] >= 0)
                finally:  # idle until the next pass: leave the cores' OpenMP threads to the others
                    self._thread.submit(openmp.release_thread_team)
                # Hold no encoder output past its request: its cross K/V are freed with it.
                del batch
        finally:  # closed: what is still queued will never run
            for *_, fut in self._heap:
                fut.cancel()
            self._heap.clear()

    def _take(self, interactive_only: bool) -> list[_Queued]:
        """The next batch from the queue's head (not empty): up to ``max_batch`` windows, one if
        it is an interactive window on a CPU."""
        limit = 1 if self._on_cpu and self._heap[0][0] < 0 else self.max_batch
        batch: list[_Queued] = []
        while self._heap and len(batch) < limit and (not interactive_only or self._heap[0][0] < 0):
            batch.append(heapq.heappop(self._heap))
        return batch

    async def _interactive_first(self) -> None:
        """Run the interactive windows queued now, before the bulk pass that calls this."""
        while self._heap and self._heap[0][0] < 0:
            await self._pass([(job, fut) for _, _, job, fut in self._take(interactive_only=True)], yields=False)

    async def _pass(self, batch: list[tuple[_EncoderJob, asyncio.Future[Any]]], yields: bool) -> None:
        """One pass over ``batch``, a step at a time; ``yields``: interactive windows queued
        meanwhile run between its steps."""
        live = [(a, f) for a, f in batch if not f.done()]
        if not live:
            return
        jobs, futures = [a for a, _ in live], [f for _, f in live]
        try:
            hidden = await self._run(self.begin, jobs)
            # On a CPU each window's layer is a step (a batch costs n windows there anyway): a
            # voice window or a foreground hold waits for one window's layer, not the batch's.
            parts = list(hidden.split(1 if self._on_cpu else len(jobs)))
            del hidden
            for step in self.layer_steps():
                for i, part in enumerate(parts):
                    if yields:
                        await self._yield()
                    if all(f.done() for f in futures):  # every caller went away: stop here
                        self.num_abandoned += 1
                        return
                    parts[i] = await self._run(step, part)
            outs = await self._run(self.finish, parts, jobs)
        except asyncio.CancelledError:  # closed mid-pass: its callers get no result
            for f in futures:
                f.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - fail the waiters, keep the loop alive
            for f in futures:
                if not f.done():
                    f.set_exception(exc)
            return
        for f, out in zip(futures, outs, strict=True):
            if not f.done():
                f.set_result(out)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args))

    async def _yield(self) -> None:
        """Before a bulk layer step: the interactive windows queued, then, while a foreground
        hold runs, a wait of at most ``foreground_wait_s``; interactive windows arriving during it
        run at once. The batcher takes its turns with the holds as ``AsyncEngine`` does
        (``engine.foreground.Turns``)."""
        await self._interactive_first()
        if not self._turns.due():
            return
        t0 = time.monotonic()
        hold = asyncio.ensure_future(asyncio.to_thread(FOREGROUND.wait, self._turns.max_s))
        while not hold.done():
            self._wake.clear()
            arrival = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({hold, arrival}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                arrival.cancel()
            await self._interactive_first()
        self._turns.waited(time.monotonic() - t0)

    # -- the pass's steps (worker thread); the same operations as WhisperEncoder.forward ------
    def begin(self, jobs: list[_EncoderJob]) -> Any:
        """Log-mel features, the two convolutions and the positions: the first layer's input."""
        import torch
        import torch.nn.functional as F

        model, enc = self.whisper.model, self.whisper.model.model.encoder
        with torch.inference_mode():
            x = self._log_mel([a for a, _ in jobs]).to(model.device, model.dtype)
            x = F.gelu(enc.conv2(F.gelu(enc.conv1(x)))).permute(0, 2, 1)
            positions = torch.arange(enc.embed_positions.num_embeddings, device=x.device)
            return x + enc.embed_positions(positions)

    def layer_steps(self) -> list[Callable[[Any], Any]]:
        return [functools.partial(_layer_step, layer) for layer in self.whisper.model.model.encoder.layers]

    def finish(self, parts: list[Any], jobs: list[_EncoderJob]) -> list[tuple[Any, float]]:
        """The final norm over the last layer's output (in parts along the batch), then the
        cross-attention K/V (cached) and Whisper's no-speech probability, read at the
        <|startoftranscript|> position."""
        import torch

        with torch.inference_mode():
            hidden = self.whisper.model.model.encoder.layer_norm(torch.cat(parts))
            outs = [hidden[i].clone() for i in range(len(jobs))]
            logits = self.adapter.prompt_logits(outs, [p[: p.index(self._sot) + 1] for _, p in jobs])
            no_speech = torch.softmax(logits.float(), -1)[:, self._no_speech].tolist()
        self.num_batches += 1
        return list(zip(outs, no_speech, strict=True))


def _layer_step(layer: Any, hidden: Any) -> Any:
    import torch

    with torch.inference_mode():
        out = layer(hidden, None)
    return out[0] if isinstance(out, tuple) else out  # a tuple in some 5.x releases
