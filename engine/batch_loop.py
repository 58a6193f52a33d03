"""The owner-thread loop shared by engines that batch queued requests (embeddings, diffusion)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Protocol

from engine.errors import EngineDeadError
from engine.openmp import release_thread_team

logger = logging.getLogger("mmserve.engine")


class BatchedRequest(Protocol):
    """A request whose items are batched: its caller awaits ``future`` on ``loop``; ``out`` is its
    result once every item has run."""

    out: Any
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


def resolve(req: BatchedRequest, exc: BaseException | None) -> None:
    """Complete ``req``'s future from any thread: with ``exc``, else ``req.out`` (a no-op when it
    is already done or its loop has closed)."""

    def settle() -> None:
        if not req.future.done():
            if exc is None:
                req.future.set_result(req.out)
            else:
                req.future.set_exception(exc)

    try:
        req.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # event loop closed
        pass


class BatchLoop:
    """Mixin: wait for pending work, take a batch under the lock, run it outside the lock.

    Subclasses hold ``_cond`` (a ``Condition`` guarding ``_pending``, a list of items whose
    ``request`` is a ``BatchedRequest``, and ``_stopping``) and ``_dead``, and implement
    ``_next_batch()`` (called with ``_cond`` held; may return an empty batch) and ``_run(batch)``
    (called without the lock).
    ``_serve_batches`` returns once ``_stopping`` is set; if it raises, ``_dead`` records why and
    every pending request fails with ``EngineDeadError`` naming ``_engine_label``."""

    _engine_label = "batching"
    _cond: threading.Condition
    _pending: Any
    _stopping: bool
    _dead: BaseException | None

    @property
    def dead(self) -> BaseException | None:
        """Why the engine stopped for good (every request gets ``EngineDeadError``), if it did."""
        return self._dead

    def _next_batch(self) -> Any:
        raise NotImplementedError

    def _run(self, batch: Any) -> None:
        raise NotImplementedError

    def _fail_pending(self, exc: BaseException) -> None:
        """Fail the request of every pending item with ``exc`` (and forget them)."""
        with self._cond:
            pending, self._pending = self._pending, []
        for req in {id(it.request): it.request for it in pending}.values():
            resolve(req, exc)

    def _serve_batches(self) -> None:
        try:
            while True:
                if not self._pending:  # idle (an unlocked peek: a hint only)
                    release_thread_team()  # leave the OpenMP threads to the busy ones (engine.openmp)
                with self._cond:
                    while not self._pending and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    batch = self._next_batch()
                if batch:
                    self._run(batch)
        except BaseException as exc:  # noqa: BLE001 - the engine thread must report, not vanish
            logger.exception("%s engine thread died", self._engine_label)
            self._dead = exc
            self._fail_pending(EngineDeadError(f"the {self._engine_label} engine died: {exc!r}"))
