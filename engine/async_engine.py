"""Async front of the engine: a background thread steps the engine; asyncio callers get
per-request output streams. The engine itself is only ever touched by that thread."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.errors import EngineDeadError, RequestFailedError
from engine.foreground import FOREGROUND, Turns
from engine.llm_engine import LLMEngine, Prompt
from engine.openmp import release_thread_team
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured import Guide

logger = logging.getLogger(__name__)
T = TypeVar("T")


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """Fold two consecutive outputs of one request into one: cumulative fields from ``newer``,
    deltas concatenated (a slow consumer sees everything it missed in one item)."""
    for old, new in zip(older.outputs, newer.outputs, strict=True):
        new.delta_text = old.delta_text + new.delta_text
        new.delta_token_ids = old.delta_token_ids + new.delta_token_ids
        if new.delta_logprobs is not None and old.delta_logprobs is not None:
            new.delta_logprobs = old.delta_logprobs + new.delta_logprobs
    return newer


def _refuse(cmd: _Add | _Call | str | None, error: BaseException) -> None:
    """Fail a command the engine loop will never take."""
    if isinstance(cmd, _Add):
        cmd.stream.admit(error)
    elif isinstance(cmd, _Call):
        cmd.resolve(None, error)


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int
    stream: _Stream
    guides: list[Guide] | None = None


@dataclass
class _Call:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]

    def resolve(self, result: Any, error: BaseException | None) -> None:
        def done() -> None:
            if self.future.done():
                return
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)

        self.loop.call_soon_threadsafe(done)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    admitted: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def admit(self, error: BaseException | None) -> None:
        def resolve() -> None:
            if self.admitted is not None and not self.admitted.done():
                if error is None:
                    self.admitted.set_result(None)
                else:
                    self.admitted.set_exception(error)

        self.loop.call_soon_threadsafe(resolve)


class AsyncEngine:
    _ids = itertools.count()

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[_Add | _Call | str | None] = queue.Queue()
        self._pending: dict[asyncio.AbstractEventLoop, list[_Add | _Call | str]] = {}  # see _submit
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._foreground_wait_s = 0.0  # steps held back by foreground holds (engine.foreground)
        self._turns = Turns(engine.config.foreground_wait_s)

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    # forwarded read-only properties
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_waiting(self) -> int:
        """The waiting queue's bound: a request of more prompts than this can never be queued."""
        return self.engine.config.max_waiting

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def dead(self) -> BaseException | None:
        """Why the engine loop stopped for good (every request gets ``EngineDeadError``), if it did."""
        return self._dead

    def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), "foreground_wait_seconds_total": self._foreground_wait_s}

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mmserve-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is not None:
            self._commands.put(None)
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # -- public API ----------------------------------------------------------------------------
    async def generate(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; admission errors are raised before the first item.
        Leaving the loop early (or cancelling the task) aborts the request in the engine."""
        guides = None
        if params.grammar is not None:  # compiled here, on a worker thread: it would stall every stream's step
            guides = await asyncio.to_thread(self.engine.guides.new, params.grammar, params.n)
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
        await self.start()
        request_id = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, admitted=loop.create_future())
        self._submit(_Add(request_id, prompt, params, priority, stream, guides))
        finished = rejected = False
        try:
            try:
                await stream.admitted  # type: ignore[misc]
            except Exception:
                rejected = True  # never added: the id may belong to another live request
                raise
            while not finished:
                item = await stream.queue.get()
                while not isinstance(item, BaseException) and not item.finished and not stream.queue.empty():
                    nxt = stream.queue.get_nowait()
                    item = nxt if isinstance(nxt, BaseException) else merge_outputs(item, nxt)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished and not rejected:
                self._submit(request_id)  # abort

    async def abort(self, request_id: str) -> None:
        self._submit(request_id)

    def _submit(self, cmd: _Add | _Call | str) -> None:
        """Send ``cmd`` to the engine thread at the end of this event-loop iteration, in order with
        the others sent from this loop. Requests that tasks started together submit (a burst of
        concurrent requests) then reach the engine together and are admitted in one step: sent
        one by one, the engine thread woke on the first and often stepped before the rest came."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a generator finalised after its loop closed)
            self._commands.put(cmd)
            return
        pending = self._pending.get(loop)
        if pending is None:
            pending = self._pending[loop] = []
            loop.call_soon(self._flush, loop)
        pending.append(cmd)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        for cmd in self._pending.pop(loop, ()):
            if self._dead is not None:  # (the loop died since it was sent: nobody would take it)
                _refuse(cmd, EngineDeadError(f"the engine loop has stopped: {self._dead}"))
            else:
                self._commands.put(cmd)

    async def call_between_steps(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between two steps and return its result (its
        exception is raised here). For CPU work that goes with the requests (an audio codec's
        decode): run there, it takes turns with the step instead of oversubscribing the cores."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
        await self.start()
        loop = asyncio.get_running_loop()
        call = _Call(fn, loop, loop.create_future())
        self._submit(call)
        return await call.future

    # -- engine thread -------------------------------------------------------------------------
    def _apply(self, cmd: _Add | _Call | str) -> None:
        if isinstance(cmd, str):
            self.engine.abort_request(cmd)
            return
        if isinstance(cmd, _Call):
            try:
                result = cmd.fn()
            except Exception as exc:  # noqa: BLE001 - the caller gets it, the loop goes on
                cmd.resolve(None, exc)
            else:
                cmd.resolve(result, None)
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.priority, cmd.guides)
        except Exception as exc:  # admission errors go back to the caller
            cmd.stream.admit(exc)
            return
        self._streams[cmd.request_id] = cmd.stream
        cmd.stream.admit(None)

    def _yield_to_foreground(self) -> None:
        """Wait for a foreground hold (``EngineConfig.foreground_wait_s``), then step at least as
        long as that wait before waiting again: back-to-back holds (a burst of TTS requests)
        take at most half of the engine's time."""
        if not self._turns.due():
            return
        waited = FOREGROUND.wait(self._turns.max_s)
        self._foreground_wait_s += waited
        self._turns.waited(waited)

    def _loop(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if block:  # idle: leave the OpenMP threads to the busy ones (engine.openmp)
                    release_thread_team()
                try:
                    cmd = self._commands.get(block=block, timeout=None if block else 0)
                    while True:
                        if cmd is None:
                            return
                        self._apply(cmd)
                        cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None  # drop the last request's prompt (it may hold a large encoder output)
                # One wake-up per event loop per step: the streams a step advanced resume in the
                # same loop iteration (so what they submit next, e.g. codec windows, batches).
                delivery: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
                self._yield_to_foreground()
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.error is not None:  # dropped by a failed step (``LLMEngine._fail``)
                        stream.put(RequestFailedError(out.error))
                    else:
                        delivery.setdefault(stream.loop, []).append((stream, out))
                    if out.finished:
                        del self._streams[out.request_id]
                for loop, items in delivery.items():
                    loop.call_soon_threadsafe(_deliver, items)
        except BaseException as exc:  # noqa: BLE001 - fail every waiter instead of hanging them
            logger.exception("engine loop crashed")
            self._dead = exc
            error = EngineDeadError(f"the engine loop crashed: {exc!r}")
            for stream in self._streams.values():
                stream.put(error)
            self._streams.clear()
            while True:  # fail queued additions too
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                _refuse(cmd, error)
