"""The owner-thread loop shared by engines that batch queued requests (embeddings, diffusion)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from engine.errors import EngineDeadError
from engine.openmp import release_thread_team

logger = logging.getLogger("mmserve.engine")


class BatchLoop:
    """Mixin: wait for pending work, take a batch under the lock, run it outside the lock.

    Subclasses hold ``_cond`` (a ``Condition`` guarding ``_pending`` and ``_stopping``) and
    ``_dead``, and implement ``_next_batch()`` (called with ``_cond`` held; may return an empty
    batch), ``_run(batch)`` (called without the lock) and ``_fail_pending(exc)``.
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
        raise NotImplementedError

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
