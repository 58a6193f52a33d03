"""Streaming waveform from a convolutional audio codec, decoded in batches across streams.

``StreamingCodecDecoder`` keeps one stream's frames and says which window of them is due for
decoding (every ``decode_every`` frames, with ``context_frames`` of context on both sides: the
decoder's measured receptive field), so the streamed audio equals one decode of all frames.
``CodecBatcher`` decodes the due windows of every stream of an engine: windows waiting when a
decode starts run as one batch (one call instead of one per stream), between the engine's steps.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import openmp


@dataclass(frozen=True)
class CodecWindow:
    """Codes ``[q, T]`` to decode and the samples ``[lo, hi)`` of the result that are new.
    ``hi is None`` for a stream's last window (everything to the end is kept); otherwise every
    kept sample is at least ``context`` frames before the window's end, so frames appended after
    it (batch padding) cannot change them."""

    codes: np.ndarray
    lo: int
    hi: int | None


def decode_windows(codec: Any, windows: list[CodecWindow]) -> list[np.ndarray]:
    """The kept samples of each window. Windows with a known end are right-padded to the longest
    and decoded as one batch; a last window (its end is the audio's end) is decoded as it is."""
    import torch

    out: list[np.ndarray | None] = [None] * len(windows)
    groups: list[list[int]] = []
    bounded = [i for i, w in enumerate(windows) if w.hi is not None]
    if bounded:
        groups.append(bounded)
    groups += [[i] for i, w in enumerate(windows) if w.hi is None]
    for group in groups:
        width = max(windows[i].codes.shape[1] for i in group)
        batch = np.zeros((len(group), windows[group[0]].codes.shape[0], width), dtype=np.int64)
        for row, i in enumerate(group):
            codes = windows[i].codes
            batch[row, :, : codes.shape[1]] = codes
            batch[row, :, codes.shape[1] :] = codes[:, -1:]  # any code: only dropped samples see it
        with torch.no_grad():
            audio_codes = torch.from_numpy(batch).to(codec.device)
            audio = codec.decode(audio_codes=audio_codes).audio_values.cpu().numpy()
        for row, i in enumerate(group):
            w = windows[i]
            out[i] = audio[row, w.lo : w.hi].astype(np.float32, copy=True)
    return out  # type: ignore[return-value]


class StreamingCodecDecoder:
    """One stream's frames: ``take(codes)`` returns the window due now (samples no future frame
    can change) or None; ``take_last()`` the rest. ``push``/``finish`` decode those windows at
    once. Concatenated, the windows' audio equals ``codec.decode`` of all the frames (up to float
    rounding). The first window is due after ``first_every`` frames (default ``decode_every``):
    a small first chunk is what keeps time-to-first-audio low."""

    def __init__(self, codec: Any, context_frames: int, decode_every: int, first_every: int | None = None) -> None:
        self.codec = codec
        self.ctx = context_frames
        self.every = decode_every
        self.first_every = first_every or decode_every
        self.hop = int(codec.config.hop_length)
        self.frames: np.ndarray | None = None  # [q, T]
        self.emitted = 0  # frames whose samples are out

    def _window(self, end_frame: int, last: bool) -> CodecWindow:
        assert self.frames is not None
        start = max(0, self.emitted - self.ctx)
        lo = (self.emitted - start) * self.hop
        hi = None if last else (end_frame - start) * self.hop
        self.emitted = end_frame
        return CodecWindow(self.frames[:, start:], lo, hi)

    def take(self, codes: np.ndarray) -> CodecWindow | None:
        self.frames = codes if self.frames is None else np.concatenate([self.frames, codes], axis=1)
        ready = self.frames.shape[1] - self.ctx
        if ready - self.emitted < (self.every if self.emitted else self.first_every):
            return None
        return self._window(ready, last=False)

    def take_last(self) -> CodecWindow | None:
        if self.frames is None or self.frames.shape[1] == 0:
            return None
        return self._window(self.frames.shape[1], last=True)

    def push(self, codes: np.ndarray) -> np.ndarray | None:
        window = self.take(codes)
        return None if window is None else decode_windows(self.codec, [window])[0]

    def finish(self) -> np.ndarray | None:
        window = self.take_last()
        return None if window is None else decode_windows(self.codec, [window])[0]


@dataclass
class _Job:
    window: CodecWindow
    future: asyncio.Future[np.ndarray]


Runner = Callable[[Callable[[], Any]], Awaitable[Any]]  # runs a function somewhere, returns its result


class CodecBatcher:
    """Decodes ``CodecWindow``s for any number of streams in batches: a decode call takes every
    window submitted (on its event loop) by the time it starts, so the windows of all the streams
    one engine step woke go together even when the loop wakes them over several iterations.
    ``run`` is where the decode executes: ``AsyncEngine.call_between_steps`` makes it take turns
    with the engine's step on the engine thread (no second team of torch threads fighting the
    step for the cores); the default is a worker thread (``engine.openmp.to_thread``)."""

    def __init__(self, codec: Any, run: Runner | None = None) -> None:
        self.codec = codec
        self._run: Runner = run or openmp.to_thread
        self._lock = threading.Lock()  # the queues are taken on the thread that decodes
        self._queued: dict[asyncio.AbstractEventLoop, list[_Job]] = {}  # per loop: resolved by it
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0  # decode calls made
        self.windows = 0  # windows decoded

    async def warm_up(self, shapes: list[tuple[int, int, int]]) -> None:
        """Decode zero codes of each ``(batch, codebooks, frames)`` shape once. The conv backend
        sets up each new input shape on first use (oneDNN here: 25-70 ms, 3-8x the decode
        itself), a cost that otherwise lands on the first requests to produce that shape."""
        import torch

        def run() -> None:
            with torch.no_grad():
                for shape in shapes:
                    self.codec.decode(audio_codes=torch.zeros(shape, dtype=torch.long, device=self.codec.device))

        await self._run(run)

    async def decode(self, window: CodecWindow) -> np.ndarray:
        """The kept samples of ``window`` (see ``decode_windows``)."""
        loop = asyncio.get_running_loop()
        job = _Job(window, loop.create_future())
        with self._lock:
            queued = self._queued.setdefault(loop, [])
            queued.append(job)
            idle = len(queued) == 1  # else a decode call is already due to take this window
        if idle:
            task = loop.create_task(self._decode(loop))
            self._tasks.add(task)  # a reference, so the task is not collected mid-way
            task.add_done_callback(self._tasks.discard)
        return await job.future

    def _take(self, loop: asyncio.AbstractEventLoop) -> list[_Job]:
        with self._lock:
            return self._queued.pop(loop, [])

    async def _decode(self, loop: asyncio.AbstractEventLoop) -> None:
        def take_and_decode() -> tuple[list[_Job], list[Any]]:
            jobs = [j for j in self._take(loop) if not j.future.cancelled()]
            try:
                return jobs, decode_windows(self.codec, [j.window for j in jobs]) if jobs else []
            except Exception as exc:  # noqa: BLE001 - every waiter gets the error
                return jobs, [exc] * len(jobs)

        try:
            jobs, results = await self._run(take_and_decode)
        except Exception as exc:  # noqa: BLE001 - the call never ran (a dead engine): fail its waiters
            jobs = self._take(loop)
            results = [exc] * len(jobs)
        if jobs:
            self.batches += 1
            self.windows += len(jobs)
        for job, result in zip(jobs, results, strict=True):
            if job.future.done():
                continue
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)
