"""``/v1/jobs`` (long jobs of any registered kind) and ``/v1/files`` (uploads and job outputs).

- ``POST /v1/jobs`` ``{"kind", "params", "preview"}`` (+ optional ``Idempotency-Key`` header) ->
  202 and the job at once; the same key returns the same job (409 if reused with other params).
- ``GET /v1/jobs/{id}``: status (queued/running/succeeded/failed/cancelled), progress, result,
  files (with URLs), timings, attempts, error.
- ``GET /v1/jobs/{id}/events``: Server-Sent Events from the start (or ``Last-Event-ID`` / ``?after=``)
  until the job ends; previews are included with ``?previews=true``. ``WS /v1/jobs/{id}/ws``: the
  same events as JSON messages; send ``{"type": "cancel"}`` to cancel.
- ``POST /v1/jobs/{id}/cancel``; ``DELETE /v1/jobs/{id}`` (a finished job: its record and result
  files; 409 while it is queued or running).

Retention: a finished job's record and result files are deleted ``--jobs-ttl-h`` hours after it
ended (default 24; ``workers.jobs.upkeep.sweep``); the job object's ``expires_at`` says when.

``workers.jobs.files`` adds the ``/v1/files`` routes and ``workers.jobs.batch`` the
``/v1/batches`` routes to this router.

Jobs and files belong to the tenant that created them (``request.state.tenant`` from the gateway's
auth); other tenants get 404s, and idempotency keys are per tenant. An unreachable job store
(Redis, S3) is a 503 on every route.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Header, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import HTTPConnection

from engine.errors import QueueFullError
from gateway.auth import ws_subprotocol
from gateway.errors import APIError
from gateway.ratelimit import charge
from workers.jobs import state
from workers.jobs.registry import ParamError
from workers.jobs.runner import IdempotencyConflict, JobsConfig, JobService, KindNotServed


def unavailable(exc: BaseException) -> APIError:
    return APIError(
        503, f"the job store is unavailable: {exc}", code="service_unavailable", headers={"Retry-After": "1"}
    )


def _is_unavailable(exc: BaseException) -> bool:
    """Redis, the Celery broker or the S3 endpoint could not be reached."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return any(c.__module__.split(".")[0] in ("redis", "kombu", "botocore") for c in type(exc).__mro__)


class _JobsRoute(APIRoute):
    """Every job route answers 503 (OpenAI error JSON) when the job store is unreachable."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                if not isinstance(exc, APIError) and _is_unavailable(exc):
                    raise unavailable(exc) from exc
                raise

        return guarded


router = APIRouter(tags=["jobs"], strict_content_type=False, route_class=_JobsRoute)

SSE_KEEPALIVE_S = 15.0
T = TypeVar("T")


def service(app: Any) -> JobService:
    """The app's job service, created on first use from ``app.state.args`` (``mmserve serve``
    options) or defaults; tests may set ``app.state.jobs`` themselves."""
    svc = getattr(app.state, "jobs", None)
    if svc is None:
        from workers.jobs.plugin import config_from_args

        args = getattr(app.state, "args", None)
        cfg = config_from_args(args) if args is not None else JobsConfig()
        svc = JobService(cfg, app.state.engines, getattr(app.state, "aliases", {}))
        app.state.jobs = svc
    svc.ensure_started()
    return svc


def job_view(rec: state.Record, ttl_s: float) -> dict[str, Any]:
    """The public job object (no internal tokens or leases); ``expires_at``: when the retention
    sweep deletes it (``ttl_s`` after it finished; ``None`` until then)."""
    started, finished = rec["started_at"], rec["finished_at"]
    return {
        "id": rec["id"],
        "object": "job",
        "kind": rec["kind"],
        "status": rec["status"],
        "created_at": rec["created_at"],
        "started_at": started,
        "finished_at": finished,
        "expires_at": finished + ttl_s if finished else None,
        "timings": {
            "queue_s": round(started - rec["created_at"], 6) if started else None,
            "run_s": round(finished - started, 6) if started and finished else None,
        },
        "attempts": rec["attempts"],
        "max_attempts": rec["max_attempts"],
        "progress": rec["progress"],
        "result": rec["result"],
        "files": rec["files"],
        "error": rec["error"] if rec["status"] in ("failed", "queued") else None,
        "params": rec["params"],
    }


def not_found(what: str, ident: str, param: str | None = None) -> APIError:
    """The 404 of an unknown (or another tenant's) ``what``; ``param``: the request field naming it."""
    return APIError(404, f"No {what} found with id '{ident}'.", param=param, code="not_found")


def owner_of(conn: HTTPConnection) -> str | None:
    """The caller's tenant name (set by the gateway's auth), which owns the jobs it creates."""
    return getattr(getattr(conn.state, "tenant", None), "name", None)


def visible(item_owner: str | None, owner: str | None) -> bool:
    """Tenants see only their own jobs and files."""
    return item_owner is None or owner is None or item_owner == owner


async def get_job_or_404(svc: JobService, job_id: str, owner: str | None, what: str = "job") -> state.Record:
    rec = await svc.get(job_id)
    if rec is None or not visible(rec.get("owner"), owner):
        raise not_found(what, job_id)
    return rec


async def submit_or_raise(
    svc: JobService,
    kind: str,
    params: dict[str, Any],
    key: str | None,
    *,
    owner: str | None,
    preview: bool = False,
    id_prefix: str = "job",
    request: Request | None = None,
    file_size: Callable[[str], Awaitable[int]] | None = None,
    named: tuple[str, str] | None = None,
) -> tuple[state.Record, bool]:
    """``JobService.submit`` with its errors as OpenAI error JSON; with ``request``, the kind's
    cost is charged to the request's tenant (429 when over its rate limit). ``file_size``: see
    ``JobService.submit``. ``named``: the request's field and value that chose the kind (default
    ``("kind", kind)``), which the 400 of a kind whose modality is not served names."""
    if key is not None and not (0 < len(key) <= 255):
        raise APIError(400, "Idempotency-Key must be 1 to 255 characters", param="Idempotency-Key")
    try:
        return await svc.submit(
            kind,
            params,
            idempotency_key=key,
            wants_preview=preview,
            id_prefix=id_prefix,
            owner=owner,
            charge=functools.partial(charge, request) if request is not None else None,
            file_size=file_size,
        )
    except KeyError as exc:
        known = ", ".join(sorted(_kinds())) or "(none)"
        raise APIError(
            400, f"unknown job kind {kind!r}; registered kinds: {known}", param="kind", code="invalid_value"
        ) from exc
    except KindNotServed as exc:
        field, value = named or ("kind", kind)
        raise APIError(
            400,
            f"{field} {value!r} needs a model of modality {exc.modality!r}, and none is served (include {exc.modality} in --only)",
            param=field,
            code="invalid_value",
        ) from exc
    except IdempotencyConflict as exc:
        raise APIError(
            409,
            f"Idempotency-Key was already used for job {exc.args[0]} with different parameters",
            param="Idempotency-Key",
            code="idempotency_conflict",
        ) from exc
    except APIError:
        raise
    except QueueFullError as exc:
        raise APIError(
            429,
            f"too many jobs are waiting (at most {svc.cfg.max_queued}); retry later",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(int(exc.retry_after_s))},
        ) from exc
    except ValueError as exc:
        param = exc.param if isinstance(exc, ParamError) else "params"
        raise APIError(400, str(exc), param=param, code="invalid_value") from exc


def _kinds() -> list[str]:
    from workers.jobs.registry import job_kinds

    return list(job_kinds())


class JobRequest(BaseModel):
    """``POST /v1/jobs`` body."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    preview: bool = False


@router.post("/v1/jobs", status_code=202)
async def create_job(
    body: JobRequest, request: Request, idempotency_key: str | None = Header(default=None, alias="Idempotency-Key")
) -> JSONResponse:
    """Queue a job; 202 with the job object at once. ``params.file_id`` must be a file the caller
    may read (404 otherwise); batches go through ``/v1/batches`` (400 here)."""
    from workers.jobs.files import file_object  # files.py adds its routes to this module's router

    if body.kind.startswith("batch:"):
        raise APIError(400, "batch jobs are created with POST /v1/batches", param="kind", code="invalid_value")
    svc, owner = service(request.app), owner_of(request)

    async def file_size(fid: str) -> int:
        """Jobs read ``params.file_id`` from the store as is: the tenant check of ``/v1/files`` first."""
        return int((await file_object(svc, fid, owner, "params.file_id"))["bytes"])

    rec, created = await submit_or_raise(
        svc,
        body.kind,
        body.params,
        idempotency_key,
        owner=owner,
        preview=body.preview,
        request=request,
        file_size=file_size,
    )
    headers = {"Location": f"/v1/jobs/{rec['id']}"}
    if not created:
        headers["Idempotent-Replayed"] = "true"
    return JSONResponse(job_view(rec, svc.cfg.result_ttl_s), status_code=202, headers=headers)


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, request: Request) -> JSONResponse:
    svc = service(request.app)
    return JSONResponse(job_view(await get_job_or_404(svc, job_id, owner_of(request)), svc.cfg.result_ttl_s))


@router.delete("/v1/jobs/{job_id}")
async def delete_job(job_id: str, request: Request) -> JSONResponse:
    """Delete a finished job with its result files (409 while it is queued or running: cancel it first)."""
    svc = service(request.app)
    rec = await get_job_or_404(svc, job_id, owner_of(request))
    if rec["status"] not in state.TERMINAL:
        raise APIError(409, f"job {job_id} is {rec['status']}; cancel it first", code="job_not_finished")
    await svc.delete(rec)
    return JSONResponse({"id": job_id, "object": "job.deleted", "deleted": True})


@router.post("/v1/jobs/{job_id}/cancel")
async def cancel_job(job_id: str, request: Request) -> JSONResponse:
    """Cancel a queued or running job (409 when it already ended)."""
    svc = service(request.app)
    rec = await get_job_or_404(svc, job_id, owner_of(request))
    if rec["status"] in state.TERMINAL and rec["status"] != "cancelled":
        raise APIError(409, f"job {job_id} already {rec['status']}", code="job_finished")
    rec = await svc.cancel(job_id)
    assert rec is not None
    return JSONResponse(job_view(rec, svc.cfg.result_ttl_s))


def _public_event(ev: dict[str, Any], previews: bool) -> dict[str, Any]:
    if not previews and "preview" in ev:
        ev = {k: v for k, v in ev.items() if k not in ("preview", "preview_type")}
    return ev


async def with_keepalive(events: AsyncIterator[T], every_s: float) -> AsyncIterator[T | None]:
    """``events``, with a ``None`` whenever nothing arrived for ``every_s`` seconds."""
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue(maxsize=64)

    async def pump() -> None:
        try:
            async for ev in events:
                await queue.put((False, ev))
            await queue.put((True, None))
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((True, exc))

    task = asyncio.create_task(pump())
    try:
        while True:
            try:
                end, item = await asyncio.wait_for(queue.get(), every_s)
            except TimeoutError:
                yield None
                continue
            if end:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        task.cancel()


@router.get("/v1/jobs/{job_id}/events")
async def job_events(
    job_id: str,
    request: Request,
    previews: bool = Query(default=False),
    after: str | None = Query(default=None),
    last_event_id: str | None = Header(default=None, alias="Last-Event-ID"),
) -> StreamingResponse:
    """SSE: ``event: status|progress``, ``id: <cursor>``, ``data: <json>``; closes after the end."""
    svc = service(request.app)
    await get_job_or_404(svc, job_id, owner_of(request))

    async def stream() -> AsyncIterator[str]:
        async for item in with_keepalive(svc.backend.events(job_id, after or last_event_id), SSE_KEEPALIVE_S):
            if item is None:
                yield ": keep-alive\n\n"  # a comment line: proxies keep the idle stream open
                continue
            cursor, ev = item
            data = json.dumps(_public_event(ev, previews))
            yield f"id: {cursor}\nevent: {ev.get('type', 'message')}\ndata: {data}\n\n"

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


@router.websocket("/v1/jobs/{job_id}/ws")
async def job_ws(websocket: WebSocket, job_id: str, previews: bool = False) -> None:
    """The job's events as JSON messages; ``{"type": "cancel"}`` from the client cancels it."""
    svc = service(websocket.app)
    await websocket.accept(subprotocol=ws_subprotocol(websocket))
    rec = await svc.get(job_id)
    if rec is None or not visible(rec.get("owner"), owner_of(websocket)):
        await websocket.send_json(not_found("job", job_id).to_dict())
        await websocket.close(code=4404)
        return

    async def listen() -> None:
        while True:
            try:
                msg = json.loads(await websocket.receive_text())
            except (ValueError, KeyError):
                continue  # not JSON text: ignored, the events keep flowing
            if isinstance(msg, dict) and msg.get("type") == "cancel":
                await svc.cancel(job_id)

    async def forward() -> None:
        async for cursor, ev in svc.backend.events(job_id):
            await websocket.send_json({"id": cursor, **_public_event(ev, previews)})
        await websocket.close()

    # whichever ends first (the job, or the client closing the socket) stops the other
    tasks = {asyncio.create_task(listen()), asyncio.create_task(forward())}
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if (exc := t.exception()) is not None and not isinstance(exc, WebSocketDisconnect):
                raise exc
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
