"""Driving engine generators from HTTP handlers: fan-in of several requests, admission before
the response starts, abort on client disconnect, and SSE framing.

Every modality's handler follows the same pattern::

    gen = MergedGeneration(request, [engine.generate(rid, prompt, params) for ...])
    await gen.start()            # admission errors (400/429) raise here, before any byte is sent
    async for idx, out in gen:   # outputs of all sub-requests, in arrival order
        ...
    # gen.aclose() (also called on error, cancellation or client disconnect) aborts the rest
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import ClientDisconnected, error_body, from_engine_error, known_error
from gateway.ratelimit import charge

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
logger = logging.getLogger("mmserve.gateway")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.2) -> T:
    """``await work``, cancelled (``ClientDisconnected``) as soon as the client goes away: a
    request that is not streamed frees the engine for the others too."""

    async def one() -> AsyncIterator[T]:
        yield await work

    async for _, item in MergedGeneration(request, [one()], poll_s):
        return item
    raise AssertionError("the work yielded nothing")


async def charged(request: Request, unit: str, amount: float, work: Callable[[], Awaitable[T]]) -> T:
    """``await work()`` with ``amount`` of ``unit`` taken from the tenant's budget first
    (``gateway.ratelimit.charge``: a 429 before it starts), cancelled as soon as the client goes
    away (``unless_disconnected``: ``ClientDisconnected``, answered 499). The charge is given
    back when the work fails, is cancelled, or its client leaves."""
    ch = await charge(request, unit, amount)
    try:
        return await unless_disconnected(request, work())
    except BaseException:
        await ch.refund()
        raise


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that closes its body iterator however the response ends. Starlette
    leaves a body generator cancelled at a ``send`` (the client gone) suspended until the garbage
    collector finalises it, and with it the engine work it holds (queued audio, an admission slot).

    A body that fails after its status line with an error the routes answer (``known_error``: a
    worker lost, an engine stopped) is logged in one warning and the response left unfinished:
    uvicorn closes the connection (saying in one line that the response was not completed) and
    the client sees a body cut short, as after any failure (a raw byte stream has no way to say
    why); a bug still raises, traceback and all.

    A body the client left before its end has ``outcome`` "disconnected" in the access line
    (unless the route names another): its status line went out before the client left."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = ended = False
        fields = scope.setdefault("state", {}).setdefault("log_fields", {})

        async def sending(message: Message) -> None:
            nonlocal started, ended
            started = True
            ended = message["type"] == "http.response.body" and not message.get("more_body", False)
            await send(message)

        try:
            await super().__call__(scope, receive, sending)
            if not ended:  # (ASGI 2.3: Starlette stopped the body when the client left)
                fields.setdefault("outcome", "disconnected")
        except ClientDisconnect:  # (ASGI 2.4: a send failed)
            fields.setdefault("outcome", "disconnected")
            raise
        except Exception as exc:
            if not started or known_error(exc) is None:
                raise
            logger.warning("%s %s: the stream ended early: %s", scope.get("method"), scope.get("path"), exc)
            fields["outcome"] = "error"
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):  # (also when the request's task is cancelled)
                    await close()


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(exc: BaseException, param: str | None, doing: str) -> str:
    """The ``error`` event an audio stream (transcription, speech) ends with when it fails after
    its status line went out: OpenAI's error object (message, type, param, code) as the route
    would have answered it (``from_engine_error``); a failure that maps to none (a bug) tells
    only that it happened ``while {doing}``."""
    mapped = from_engine_error(exc, param=param) if isinstance(exc, Exception) else None
    if mapped is None:  # (the client learns only that it happened: the log has what)
        logger.error("stream failed while %s", doing, exc_info=exc)
    body = mapped.to_dict() if mapped is not None else error_body(f"internal error while {doing}", "server_error")
    return sse({"type": "error", **body})


_DONE = object()


class MergedGeneration(Generic[T]):
    """Consume several async iterators concurrently and yield ``(source_index, item)``.

    Each source runs in its own task; closing the merger (``aclose``), cancelling the task that
    iterates it, or the client disconnecting (polled every ``poll_s`` seconds through
    ``request.is_disconnected()``) cancels those tasks, which closes the sources, which aborts
    the engine requests behind them.
    """

    def __init__(self, request: Request | None, sources: list[AsyncIterator[T]], poll_s: float = 0.2) -> None:
        self._request = request
        self._sources = sources
        self._poll_s = poll_s
        self._queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._buffer: list[tuple[int, Any, BaseException | None]] = []
        self._remaining = len(sources)
        self._get: asyncio.Task[Any] | None = None
        self._closed = False
        self._last_poll = time.monotonic()

    async def _pump(self, idx: int, source: AsyncIterator[T]) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                if hasattr(source, "aclose"):
                    stack.push_async_callback(source.aclose)  # type: ignore[attr-defined]
                async for item in source:
                    self._queue.put_nowait((idx, item, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            self._queue.put_nowait((idx, _DONE, exc))
            return
        self._queue.put_nowait((idx, _DONE, None))

    async def _next_raw(self) -> tuple[int, Any, BaseException | None]:
        """Next queued event, polling for client disconnect while waiting."""
        while True:
            if self._get is None:
                self._get = asyncio.ensure_future(self._queue.get())
            wait_s = max(0.0, self._last_poll + self._poll_s - time.monotonic())
            done, _ = await asyncio.wait({self._get}, timeout=wait_s)
            if self._request is not None and time.monotonic() - self._last_poll >= self._poll_s:
                self._last_poll = time.monotonic()
                if await self._request.is_disconnected():
                    await self.aclose()
                    raise ClientDisconnected()
            if done:
                event = self._get.result()
                self._get = None
                return event

    async def start(self) -> None:
        """Start every source and wait until each has produced its first item, finished, or
        failed. A failure (e.g. an admission error) closes the rest and is re-raised here."""
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self._sources)]
        started: set[int] = set()
        try:
            while len(started) < len(self._sources):
                event = await self._next_raw()
                if event[2] is not None:
                    raise event[2]
                started.add(event[0])
                self._buffer.append(event)
        except BaseException:
            await self.aclose()
            raise

    def first_items(self) -> list[tuple[int, T]]:
        """After ``start``: the first item of each source that produced one (not yet iterated)."""
        return [(idx, item) for idx, item, exc in self._buffer if exc is None and item is not _DONE]

    def __aiter__(self) -> AsyncIterator[tuple[int, T]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, T]]:
        if not self._tasks:
            await self.start()
        try:
            while self._remaining > 0:
                event = self._buffer.pop(0) if self._buffer else await self._next_raw()
                idx, item, exc = event
                if exc is not None:
                    raise exc
                if item is _DONE:
                    self._remaining -= 1
                    continue
                yield idx, item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Cancel every source (aborting its engine request) and wait for them to wind down."""
        if self._closed:
            return
        self._closed = True
        if self._get is not None:
            self._get.cancel()
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()  # synchronous: the abort happens even if we are cancelled below
        if pending:
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*pending, return_exceptions=True)
