"""Processors and pipelines.

A ``Processor`` has one method, ``process(frame)``, an async generator of output frames; frames
it does not handle it passes through unchanged, so later stages and the output see them in order.
A ``Pipeline`` is itself a processor (its ``process`` runs a frame through every stage, depth
first: the batch/Celery mode) and can also run its stages concurrently (``stream``: one task and
queue per stage, the real-time mode), where:

- system frames (``SystemFrame``) bypass the queues and reach the output at once;
- an ``Interrupt`` emitted by stage *i* cancels the ``process`` call in flight of every
  interruptible stage after *i* (closing its async generators, so engine requests are aborted
  right away; with ``response_id``, only work for that reply: ``reply_of``), turns every
  queued frame into what ``Frame.interrupted`` says (the cancelled replies' frames are dropped;
  after a barge-in, requests for a reply too, wherever they wait, and those the source made
  before it but passes on later), counts a barge-in in ``turns_taken`` of every stage
  after *i* at once, and calls ``on_interrupt(by)`` on each of them;
- an exception in ``process`` becomes an ``ErrorFrame`` (naming the reply the work was for:
  ``reply_of``) and the stage keeps going;
- ``End`` flows in order; each stage forwards it after its queued work, then stops;
- a stage may pass a frame on from outside ``process`` (a background task's result) with its
  ``emit``, which a concurrent run sets; when the run ends, every stage's ``close()`` is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

from gateway.errors import failure_error, known_error
from pipelines.frames import End, ErrorFrame, Frame, Interrupt, SystemFrame

logger = logging.getLogger("mmserve.pipelines")


class Processor:
    """One step of a pipeline. Subclasses override ``process``; ``interruptible`` stages have
    their work cancelled by a barge-in."""

    interruptible: bool = False
    # Barge-ins (``Interrupt.takes_turn``) from stages before this one, counted as they happen:
    # work that outlives one (not interruptible) can tell it came.
    turns_taken: int = 0
    # Set while a concurrent pipeline runs this stage: pass a frame downstream from a background
    # task (None in depth-first runs, where no work outlives ``process``).
    emit: Callable[[Frame], None] | None = None

    @property
    def name(self) -> str:
        return type(self).__name__

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        """Frames produced for ``frame`` (default: ``frame`` itself)."""
        yield frame

    async def on_interrupt(self, by: Interrupt) -> None:
        """Forget the state of the replies ``by`` cancels (an upstream stage emitted it)."""

    def reply_of(self, frame: Frame) -> str | None:
        """The reply this stage's work on ``frame`` is for (None: none known)."""
        return getattr(frame, "response_id", None)

    def close(self) -> None:
        """Cancel background work: the concurrent run this stage was part of has ended."""


class Pipeline(Processor):
    """Stages in order; a pipeline is a processor, so pipelines nest."""

    def __init__(self, stages: Sequence[Processor]) -> None:
        self.stages = list(stages)
        self._turns = 0

    @property
    def interruptible(self) -> bool:  # type: ignore[override]
        return any(s.interruptible for s in self.stages)

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        async for out in self._through(0, frame):
            yield out

    async def _through(self, i: int, frame: Frame) -> AsyncIterator[Frame]:
        if i == len(self.stages):
            yield frame
            return
        async for out in self.stages[i].process(frame):
            if isinstance(out, Interrupt):
                for later in self.stages[i + 1 :]:
                    later.turns_taken += out.takes_turn
                    await later.on_interrupt(out)
                yield out
            elif isinstance(out, SystemFrame):
                yield out
            else:
                async for final in self._through(i + 1, out):
                    yield final

    @property
    def turns_taken(self) -> int:  # type: ignore[override]
        return self._turns

    @turns_taken.setter
    def turns_taken(self, count: int) -> None:
        """Counted for this pipeline, counted for each of its stages (at once, as for any stage)."""
        for stage in self.stages:
            stage.turns_taken += count - self._turns
        self._turns = count

    async def on_interrupt(self, by: Interrupt) -> None:
        for stage in self.stages:
            await stage.on_interrupt(by)

    def reply_of(self, frame: Frame) -> str | None:
        """The reply of the first stage that knows one."""
        return next((reply for s in self.stages if (reply := s.reply_of(frame)) is not None), None)

    def close(self) -> None:
        for stage in self.stages:
            stage.close()

    async def run_all(self, frames: Sequence[Frame]) -> list[Frame]:
        """Depth-first run of ``frames`` then ``End``; every output frame (``End`` excluded)."""
        out: list[Frame] = []
        for frame in [*frames, End()]:
            out.extend([f async for f in self.process(frame) if not isinstance(f, End)])
        return out

    def stream(self, source: AsyncIterator[Frame]) -> AsyncGenerator[Frame, None]:
        """Run the stages concurrently over ``source``; yields the output frames (``End`` last)."""
        return _Concurrent(self.stages).run(source)


class _Stage:
    def __init__(self, proc: Processor) -> None:
        self.proc = proc
        self.queue: asyncio.Queue[Frame] = asyncio.Queue()
        self.current: asyncio.Task[None] | None = None
        self.frame: Frame | None = None  # the frame ``current`` works on


class _Concurrent:
    def __init__(self, procs: Sequence[Processor]) -> None:
        self.stages = [_Stage(p) for p in procs]
        self.out: asyncio.Queue[Frame] = asyncio.Queue()
        self.hooks: set[asyncio.Task[None]] = set()
        self.taken: Interrupt | None = None  # the latest barge-in
        for i, p in enumerate(procs):
            p.emit = functools.partial(self._emit, i)

    def _emit(self, i: int, frame: Frame) -> None:
        """Route ``frame`` produced by stage ``i`` (-1: the source)."""
        if isinstance(frame, Interrupt):
            self._interrupt(i, frame)
        if isinstance(frame, SystemFrame):
            self.out.put_nowait(frame)
        elif i + 1 < len(self.stages):
            self.stages[i + 1].queue.put_nowait(frame)
        else:
            self.out.put_nowait(frame)

    def _interrupt(self, i: int, by: Interrupt) -> None:
        if by.takes_turn:
            self.taken = by
        for k, stage in enumerate(self.stages):
            _interrupt_queued(stage.queue, by)  # (before the emitter: its requests for a reply)
            if k <= i:
                continue
            stage.proc.turns_taken += by.takes_turn
            ours = stage.frame is not None and by.cancels(stage.proc.reply_of(stage.frame))
            if stage.proc.interruptible and stage.current is not None and ours:
                stage.current.cancel()
            task = asyncio.get_running_loop().create_task(stage.proc.on_interrupt(by))
            self.hooks.add(task)  # keep a reference until it ran
            task.add_done_callback(self.hooks.discard)
        _interrupt_queued(self.out, by)

    async def _run_stage(self, i: int) -> None:
        stage = self.stages[i]
        while True:
            frame = await stage.queue.get()
            stage.current, stage.frame = asyncio.create_task(self._process(i, frame)), frame
            await asyncio.wait([stage.current])  # a cancelled task here is a barge-in, not our end
            stage.current = stage.frame = None
            if isinstance(frame, End):
                return

    async def _process(self, i: int, frame: Frame) -> None:
        proc = self.stages[i].proc
        try:
            async for out in proc.process(frame):
                self._emit(i, out)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad frame must not stop the pipeline
            known = known_error(exc)  # the input's, or an engine's refusal: as its route answers it
            if known is None:
                logger.exception("%s failed on %s", proc.name, type(frame).__name__)
            elif known.status_code >= 500 or known.status_code == 429:  # (a refusal under load: no traceback)
                logger.warning("%s refused %s: %s", proc.name, type(frame).__name__, exc)
            err = failure_error(exc)
            self._emit(
                i,
                ErrorFrame(
                    err["message"],
                    stage=proc.name,
                    code=err["code"],
                    item_id=getattr(frame, "item_id", ""),
                    event_id=getattr(frame, "event_id", None),  # (the client event it came from, if any)
                    response_id=proc.reply_of(frame),
                    param=err["param"],
                    error_type=err["type"],
                ),
            )
            if isinstance(frame, End):
                self._emit(i, frame)

    async def _feed(self, source: AsyncIterator[Frame]) -> None:
        try:
            async for frame in source:
                stale = self.taken is not None and frame.created <= self.taken.created
                fed = frame.interrupted(self.taken) if stale and self.taken is not None else frame
                if fed is not None:  # (made before the barge-in: as if it was queued at it)
                    self._emit(-1, fed)
                if isinstance(frame, End):
                    return
        except Exception as exc:  # noqa: BLE001
            self._emit(-1, ErrorFrame(f"{type(exc).__name__}: {exc}", stage="source"))
        self._emit(-1, End())

    async def run(self, source: AsyncIterator[Frame]) -> AsyncGenerator[Frame, None]:
        tasks = [asyncio.create_task(self._run_stage(i)) for i in range(len(self.stages))]
        tasks.append(asyncio.create_task(self._feed(source)))
        try:
            while True:
                frame = await self.out.get()
                yield frame
                if isinstance(frame, End):
                    return
        finally:
            for stage in self.stages:
                if stage.current is not None:
                    stage.current.cancel()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for stage in self.stages:
                stage.proc.emit = None
                stage.proc.close()


def _interrupt_queued(q: asyncio.Queue[Frame], by: Interrupt) -> None:
    kept = []
    while not q.empty():
        frame = q.get_nowait().interrupted(by)
        if frame is not None:
            kept.append(frame)
    for frame in kept:
        q.put_nowait(frame)
