"""Job kinds: the one place modalities plug long work (diffusion, bulk embeddings, audio pipelines)
into the batch/long-job system.

A modality registers a kind at import time of its ``plugin.py`` (both ``mmserve serve`` and
``mmserve worker`` import every plugin, so the kind exists wherever a job may run)::

    from workers.jobs import JobContext, register_job_kind

    def run(params: dict, ctx: JobContext) -> dict:        # or ``async def``
        engine = ctx.engines["tiny-sd"]                     # the engines of the process running the job
        for i in range(steps):
            ctx.check_cancelled()                           # raises JobCancelled once cancelled
            ...
            ctx.progress(i + 1, steps, preview=png if ctx.wants_preview else None)
        url = ctx.store.put(ctx.job_id, "image-0.png", png_bytes, "image/png")
        return {"images": [url]}                            # JSON-serialisable, becomes the job's ``result``

    register_job_kind("image.generate", "diffusion", run, validate=check_params)

Contract of ``run(params, ctx)``:

- ``params`` is the JSON object the client posted (after ``validate``, if given); plain data only.
- A sync ``run`` runs on a worker thread; an ``async`` one on the event loop that owns the
  engines (so it may ``await engine.run(...)``). Keep heavy imports (torch, diffusers) inside it.
  An ``async`` run must not block that loop (wrap CPU work and slow ``ctx.store`` calls in
  ``asyncio.to_thread``): under celery the lease is renewed from the same loop, and a job silent
  for ``--jobs-lease-s`` is taken for dead and run again elsewhere.
- Its return value (a JSON-serialisable dict, or ``None``) is stored as the job's ``result``.
  Every ``ctx.store.put`` is also listed in the job's ``files`` with its URL.
- Raising ``JobCancelled`` (from ``check_cancelled``) ends the job as ``cancelled``; one raised
  with a ``result`` (what a cancelled batch finished) stores it as the cancelled job's (the
  files a cancelled attempt put are listed either way; ``ctx.lost``: keep nothing). Any other
  exception fails the attempt (``failed`` with the message, or retried when ``retry_on_error``).
- Jobs must be idempotent per attempt: a job whose worker died is run again from the start
  (up to the configured max attempts), with ``ctx.attempt`` counting from 1.

A kind is accepted only by a gateway that serves its ``modality`` (an engine of it, local or a
worker's proxy); elsewhere submitting it is a 400 (``JobService.submit``).

``validate(params, engines) -> params`` (optional) runs in the gateway before the job is queued:
raise ``ValueError`` (or ``gateway.errors.APIError``) for a 400 with your message, so bad input
never costs compute; a ``ParamError`` names the field in the error's ``param``, and an
``APIError`` naming a body field (a synchronous route's resolver: ``param="voice"``) is
re-named ``params.voice``. ``engines`` are the gateway's engines (remote proxies under celery
dispatch); a hook with an ``aliases`` parameter also gets the gateway's model aliases
(``validate(params, engines, aliases)``), to resolve ``model`` as the synchronous routes do.

``cost(params, engines) -> (unit, amount)`` (optional) runs after ``validate``: the submitting
tenant is charged ``amount`` of the rate-limit ``unit`` (``gateway.ratelimit``) before the job is
queued (429 when over budget; refunded when queueing fails; an idempotent replay is free).
Kinds whose params name a ``file_id`` (checked in the gateway: the caller's upload or job output)
get its size too when their hook takes it: ``cost(params, engines, file_bytes=n)``.

``forget(job_id, cfg) -> None`` (optional) deletes what a job of the kind keeps besides its record
and result files (an ``audio.pipeline`` job's stage chain in Redis); ``DELETE /v1/jobs/{id}``
calls it in the gateway (``cfg``: its ``JobsConfig``) before it deletes the rest, so a failure
leaves the job to be deleted again.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from workers.jobs.runner import JobsConfig

RunFn = Callable[[dict[str, Any], "JobContext"], "dict[str, Any] | None | Awaitable[dict[str, Any] | None]"]
ValidateFn = Callable[..., dict[str, Any]]  # (params, engines[, aliases=]) -> params
CostFn = Callable[..., tuple[str, float]]  # (params, engines[, file_bytes=]) -> (unit, amount)
ForgetFn = Callable[[str, "JobsConfig"], None]  # (job id, the gateway's job settings)


class ParamError(ValueError):
    """A bad field of a job's params: the 400's ``param`` names it (``params.<field>``; ``params``
    for the object as a whole, ``field`` "")."""

    def __init__(self, field: str, message: str) -> None:
        self.param = f"params.{field}" if field else "params"
        super().__init__(f"{self.param}: {message}")


def parse_params(model: Any, params: dict[str, Any]) -> Any:
    """``params`` as the pydantic ``model``; a ``ParamError`` naming the first bad field."""
    from pydantic import ValidationError

    try:
        return model.model_validate(params)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ParamError(".".join(str(p) for p in first["loc"]), first["msg"]) from None


class JobCancelled(Exception):
    """Raised by ``JobContext.check_cancelled`` once the job was cancelled; ends the job as
    cancelled, with ``result`` as its result (the work done before the cancel) if given."""

    def __init__(self, message: str, result: Any = None) -> None:
        super().__init__(message)
        self.result = result


class ResultStore(Protocol):
    """Where job outputs go (a local directory, or an S3-compatible bucket)."""

    def put(self, job_id: str, name: str, data: bytes, content_type: str) -> str:
        """Store ``data`` as ``name`` of job ``job_id``; return the URL (gateway-relative path) to fetch it."""
        ...

    def get(self, job_id: str, name: str) -> tuple[bytes, str]:
        """``(data, content_type)``; ``FileNotFoundError`` when absent."""
        ...

    def delete_job(self, job_id: str) -> None:
        """Remove every file of ``job_id`` (idempotent)."""
        ...


@dataclass(frozen=True)
class JobKind:
    """A registered kind: ``run`` does the work on the ``mmserve.<modality>`` queue (celery) or in
    the gateway (local); at most ``concurrency`` jobs of this kind run at once per process."""

    kind: str
    modality: str
    run: RunFn
    validate: ValidateFn | None = None
    concurrency: int = 1
    retry_on_error: bool = False
    cost: CostFn | None = None
    forget: ForgetFn | None = None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.run)


_KINDS: dict[str, JobKind] = {}
_LOCK = threading.Lock()


def register_job_kind(
    kind: str,
    modality: str,
    run: RunFn,
    *,
    validate: ValidateFn | None = None,
    concurrency: int = 1,
    retry_on_error: bool = False,
    cost: CostFn | None = None,
    forget: ForgetFn | None = None,
) -> JobKind:
    """Register (or replace: re-imports and tests) the job kind ``kind`` served by ``modality``.

    ``modality`` names the Celery queue (``mmserve.<modality>``) whose workers run it.
    ``concurrency`` bounds how many jobs of this kind one process runs at once (the rest wait
    queued). ``retry_on_error``: an exception from ``run`` is retried like a worker death
    (default off: bugs and bad params fail fast). ``cost``: what a submission is charged against
    the tenant's rate limit, ``forget``: what deleting a job deletes besides its record and files
    (see the module docstring)."""
    if not kind or not modality:
        raise ValueError("kind and modality must be non-empty")
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    spec = JobKind(kind, modality, run, validate, concurrency, retry_on_error, cost, forget)
    with _LOCK:
        _KINDS[kind] = spec
    return spec


def get_job_kind(kind: str) -> JobKind | None:
    return _KINDS.get(kind)


def job_kinds() -> dict[str, JobKind]:
    """Every registered kind (a copy)."""
    with _LOCK:
        return dict(_KINDS)


@dataclass(frozen=True)
class ProgressEvent:
    """One progress report of a running job (``preview``: optional bytes, e.g. a small PNG;
    ``detail``: the kind's own JSON-able account of where it is, e.g. a chain's stages)."""

    step: int
    total: int
    preview: bytes | None = None
    preview_type: str | None = None
    detail: dict[str, Any] | None = None


@dataclass
class JobContext:
    """What ``run`` gets besides its params. The methods are thread-safe and cheap: call them from a
    sync ``run`` (a worker thread) or an async one alike.

    - ``engines``: served name -> engine of the process running the job (the gateway's
      ``app.state.engines`` in local mode, the worker's engines under celery); ``aliases``: extra
      accepted model names -> served name.
    - ``store``: the result store; ``store.put(job_id, name, data, content_type) -> url``.
    - ``progress(step, total, preview=None, detail=None)``: report progress (streamed to
      SSE/WebSocket clients in order, ``detail`` also kept in the record's ``progress``);
      ``preview`` bytes are kept only when the client asked (``wants_preview``). It never
      raises, so it is safe to call from an engine thread's callback.
    - ``check_cancelled()``: raises ``JobCancelled`` once the job was cancelled, or once this
      attempt was taken over (``lost``: its lease ran out and the job was queued again, or its
      record was deleted; it must then keep nothing).
    """

    job_id: str
    kind: str
    params: dict[str, Any]
    engines: dict[str, Any]
    store: ResultStore
    aliases: dict[str, str] = field(default_factory=dict)
    attempt: int = 1
    wants_preview: bool = False
    on_progress: Callable[[ProgressEvent], None] = field(default=lambda ev: None, repr=False)
    cancel_event: threading.Event = field(default_factory=threading.Event, repr=False)
    lost: bool = False

    def progress(
        self,
        step: int,
        total: int,
        preview: bytes | None = None,
        preview_type: str = "image/png",
        detail: dict[str, Any] | None = None,
    ) -> None:
        """Report ``step`` of ``total`` done. Never raises (safe in engine-thread callbacks); a
        cancelled job's reports are dropped, so call ``check_cancelled`` to stop."""
        if self.cancel_event.is_set():
            return
        keep = preview if (preview is not None and self.wants_preview) else None
        kept_type = preview_type if keep is not None else None
        self.on_progress(ProgressEvent(int(step), int(total), keep, kept_type, detail))

    def check_cancelled(self) -> None:
        if self.cancel_event.is_set():
            raise JobCancelled(f"job {self.job_id} was cancelled")

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()
