"""The OpenAI Batch API on the job system: ``POST /v1/batches`` runs a JSONL file of requests.

Each endpoint is a job kind (``batch:/v1/embeddings`` on the ``embed`` queue,
``batch:/v1/chat/completions`` and ``batch:/v1/completions`` on ``llm``). The input file is
validated line by line when the batch is created (a bad file is a 400 naming the line, before any
compute). The job sends every line through the same route handlers as the online API, in process
(an ASGI app over the job's engines), so a batch result is exactly what the endpoint would answer;
up to ``CONCURRENCY`` lines are in flight, which the engines batch dynamically. Output and error
files are JSONL in OpenAI's batch output format, in input order. Creating a batch charges the
tenant's rate limit for every line at once (``batch_cost``: ``embed_inputs`` or ``llm_tokens``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Annotated, Any

from fastapi import Header, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import APIError, error_body
from workers.jobs import state
from workers.jobs.api import get_job_or_404, not_found, owner_of, router, service, submit_or_raise
from workers.jobs.files import file_object, list_page
from workers.jobs.registry import JobCancelled, JobContext, register_job_kind
from workers.jobs.store import UPLOADS, file_id

ENDPOINTS = {"/v1/embeddings": "embed", "/v1/chat/completions": "llm", "/v1/completions": "llm"}
MAX_REQUESTS = 50_000
CONCURRENCY = 64
WINDOW_S = 24 * 3600
# A batch cancelled while it ran is "cancelling" until its finished lines are stored (a moment:
# its attempt notices within a heartbeat), at most this long (an attempt that died keeps none).
CANCELLING_S = 30.0
CANCEL_WAIT_S = 5.0  # how long a cancel waits for them before it answers


def parse_input(data: bytes, endpoint: str) -> list[dict[str, Any]]:
    """The request lines of a batch input file; ``ValueError`` naming the first bad line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError("the input file is not UTF-8 text") from exc
    lines: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {n}: not valid JSON ({exc.msg})") from exc
        if not isinstance(item, dict):
            raise ValueError(f"line {n}: each line must be a JSON object")
        cid = item.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise ValueError(f"line {n}: 'custom_id' must be a non-empty string")
        if cid in seen:
            raise ValueError(f"line {n}: duplicate custom_id {cid!r}")
        seen.add(cid)
        if item.get("method", "POST") != "POST":
            raise ValueError(f"line {n}: 'method' must be POST")
        if item.get("url") != endpoint:
            raise ValueError(f"line {n}: 'url' is {item.get('url')!r} but the batch endpoint is {endpoint!r}")
        if not isinstance(item.get("body"), dict):
            raise ValueError(f"line {n}: 'body' must be a JSON object")
        lines.append(item)
        if len(lines) > MAX_REQUESTS:
            raise ValueError(f"a batch holds at most {MAX_REQUESTS} requests")
    if not lines:
        raise ValueError("the input file has no requests")
    return lines


UNITS = {"/v1/embeddings": "embed_inputs", "/v1/chat/completions": "llm_tokens", "/v1/completions": "llm_tokens"}
# LLM lines without max_tokens are charged this many completion tokens (the real cap is the context).
DEFAULT_MAX_TOKENS = 256


def _embed_inputs(body: dict[str, Any]) -> int:
    """How many inputs ``/v1/embeddings`` counts in ``body["input"]`` (a string or token list is one)."""
    inp = body.get("input")
    if isinstance(inp, list) and inp and not all(isinstance(x, int) for x in inp):
        return len(inp)
    return 1


def _llm_tokens(body: dict[str, Any]) -> int:
    """The admission estimate of the online routes: prompt (~4 characters a token) + max_tokens x n."""
    prompt = body.get("messages") if "messages" in body else body.get("prompt")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    n = body.get("n") or 1
    if not isinstance(max_tokens, int) or not isinstance(n, int):
        return DEFAULT_MAX_TOKENS  # the line fails validation when it runs
    return len(json.dumps(prompt)) // 4 + max(0, max_tokens) * max(1, n)


def batch_cost(endpoint: str, lines: list[dict[str, Any]]) -> float:
    """What a batch is charged (in ``UNITS[endpoint]``) when it is created: every line's cost."""
    one = _embed_inputs if UNITS[endpoint] == "embed_inputs" else _llm_tokens
    return float(sum(one(line["body"]) for line in lines))


def _cost(params: dict[str, Any], engines: dict[str, Any]) -> tuple[str, float]:
    """The cost computed from the input file by ``create_batch`` (batch kinds are refused on
    ``/v1/jobs``, so ``params`` come from the gateway, not the client)."""
    return UNITS[params["endpoint"]], float(params.get("cost", 0))


_APP: list[Any] = []  # [engines, aliases, app]: the last one built


def _inner_app(engines: dict[str, Any], aliases: dict[str, str]) -> Any:
    """An app over ``engines`` with every plugin's routes (no auth), reused while the engines
    dict (a process has one) and aliases are the same objects. (Keyed by ``id(engines)``, a
    later dict given a dead one's id got an app over the dead one's engines.)"""
    if not _APP or _APP[0] is not engines or _APP[1] is not aliases:
        from gateway.app import create_app
        from gateway.plugins import routers

        _APP[:] = [engines, aliases, create_app(engines, routers=routers(), aliases=aliases)]
    return _APP[2]


async def run_batch(params: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    import httpx

    endpoint = params["endpoint"]
    data, _ = await asyncio.to_thread(ctx.store.get, UPLOADS, params["input_file_id"])
    lines = parse_input(data, endpoint)
    total = len(lines)
    outputs: list[tuple[bool, dict[str, Any]] | None] = [None] * total
    done = 0
    step = max(1, total // 100)  # at most ~100 progress events per batch
    ctx.progress(0, total)
    transport = httpx.ASGITransport(app=_inner_app(ctx.engines, ctx.aliases))
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
        todo = iter(range(total))

        async def worker() -> None:
            nonlocal done
            for i in todo:
                ctx.check_cancelled()
                ok, out = await _one(client, endpoint, lines[i])
                if ctx.cancelled:  # a line the cancel cut short (answered 503 inside): no result
                    return
                if not ok and _shutting_down(out["response"]["body"]):
                    raise asyncio.CancelledError  # (this process is going away: the job runs again elsewhere)
                outputs[i] = ok, out
                done += 1
                if done % step == 0 or done == total:
                    ctx.progress(done, total)

        try:
            await asyncio.gather(*(worker() for _ in range(min(CONCURRENCY, total))))
            return await _write_results(ctx, outputs, total)
        except (asyncio.CancelledError, JobCancelled):
            if not ctx.cancelled or ctx.lost:
                raise  # (this process is going away, or another attempt took the job: it keeps nothing)
            # As OpenAI's: a cancelled batch keeps the lines it finished, in its output and error files.
            result = await _write_results(ctx, outputs, total)
            raise JobCancelled(f"batch {ctx.job_id} was cancelled", result) from None


def _shutting_down(body: Any) -> bool:
    """Whether a line's answer is the one a request cut by this process's shutdown gets."""
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == "shutting_down"


async def _write_results(
    ctx: JobContext, outputs: list[tuple[bool, dict[str, Any]] | None], total: int
) -> dict[str, Any]:
    """The output and error files of the lines done (in input order), and the batch's result."""
    ok_lines = [json.dumps(o[1]) for o in outputs if o is not None and o[0]]
    err_lines = [json.dumps(o[1]) for o in outputs if o is not None and not o[0]]
    result: dict[str, Any] = {"request_counts": {"total": total, "completed": len(ok_lines), "failed": len(err_lines)}}
    if ok_lines:
        await asyncio.to_thread(
            ctx.store.put, ctx.job_id, "output.jsonl", ("\n".join(ok_lines) + "\n").encode(), "application/jsonl"
        )
        result["output_file_id"] = file_id(ctx.job_id, "output.jsonl")
    if err_lines:
        await asyncio.to_thread(
            ctx.store.put, ctx.job_id, "errors.jsonl", ("\n".join(err_lines) + "\n").encode(), "application/jsonl"
        )
        result["error_file_id"] = file_id(ctx.job_id, "errors.jsonl")
    return result


async def _one(client: Any, endpoint: str, line: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """``(ok, output line)`` for one request line."""
    request_id = f"req_{uuid.uuid4().hex[:24]}"
    body = line["body"]
    if body.get("stream"):
        status, payload = (
            400,
            {
                "error": {
                    "message": "streaming is not supported in batches",
                    "type": "invalid_request_error",
                    "param": "stream",
                    "code": None,
                }
            },
        )
    else:
        resp = await client.post(endpoint, json=body)
        status = resp.status_code
        try:
            payload = resp.json()
        except ValueError:
            payload = error_body(resp.text, "server_error")
    out = {
        "id": f"batch_req_{uuid.uuid4().hex[:24]}",
        "custom_id": line["custom_id"],
        "response": {"status_code": status, "request_id": request_id, "body": payload},
        "error": None,
    }
    return status < 400, out


for _endpoint, _modality in ENDPOINTS.items():
    register_job_kind(f"batch:{_endpoint}", _modality, run_batch, concurrency=2, cost=_cost)


# -- API ------------------------------------------------------------------------------------------


class BatchRequest(BaseModel):
    """``POST /v1/batches`` body."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


_STATUS = {
    "queued": "validating",
    "running": "in_progress",
    "succeeded": "completed",
    "failed": "failed",
    "cancelled": "cancelled",
}


def batch_view(rec: state.Record) -> dict[str, Any]:
    """The OpenAI batch object of a batch job."""
    p, result = rec["params"], rec["result"] or {}
    status = "cancelling" if _cancelling(rec) else _STATUS[rec["status"]]
    created = int(rec["created_at"])
    counts = result.get("request_counts") or {"total": p["total"], "completed": rec["progress"]["step"], "failed": 0}
    finished = int(rec["finished_at"]) if rec["finished_at"] else None
    errors = None
    if rec["status"] == "failed" and rec["error"]:
        errors = {
            "object": "list",
            "data": [
                {"code": rec["error"].get("type"), "message": rec["error"]["message"], "param": None, "line": None}
            ],
        }
    return {
        "id": rec["id"],
        "object": "batch",
        "endpoint": p["endpoint"],
        "errors": errors,
        "input_file_id": p["input_file_id"],
        "completion_window": p["completion_window"],
        "status": status,
        "output_file_id": result.get("output_file_id"),
        "error_file_id": result.get("error_file_id"),
        "created_at": created,
        "in_progress_at": int(rec["started_at"]) if rec["started_at"] else None,
        "expires_at": created + WINDOW_S,
        "finalizing_at": finished if status == "completed" else None,
        "completed_at": finished if status == "completed" else None,
        "failed_at": finished if status == "failed" else None,
        "expired_at": None,
        "cancelling_at": finished if status in ("cancelling", "cancelled") else None,
        "cancelled_at": finished if status == "cancelled" else None,
        "request_counts": counts,
        "metadata": p.get("metadata"),
    }


def _cancelling(rec: state.Record) -> bool:
    """Cancelled while it ran, and its finished lines not stored yet."""
    return (
        rec["status"] == "cancelled"
        and bool(rec["started_at"])
        and rec["result"] is None
        and time.time() - (rec["finished_at"] or 0) < CANCELLING_S
    )


async def _batch_or_404(request: Request, batch_id: str) -> state.Record:
    rec = await get_job_or_404(service(request.app), batch_id, owner_of(request), "batch")
    if not rec["kind"].startswith("batch:"):
        raise not_found("batch", batch_id)
    return rec


@router.post("/v1/batches")
async def create_batch(
    body: BatchRequest, request: Request, idempotency_key: str | None = Header(default=None, alias="Idempotency-Key")
) -> JSONResponse:
    """Validate the input file, then queue the batch job; returns the batch object."""
    svc = service(request.app)
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint", code="invalid_value")
    if body.completion_window != "24h":
        raise APIError(400, "completion_window must be '24h'", param="completion_window", code="invalid_value")
    owner = owner_of(request)
    meta = await file_object(svc, body.input_file_id, owner, "input_file_id")
    if meta["purpose"] != "batch":
        raise APIError(
            400, f"file {body.input_file_id} has purpose {meta['purpose']!r}, not 'batch'", param="input_file_id"
        )
    data, _ = await asyncio.to_thread(svc.store.get, UPLOADS, body.input_file_id)
    try:
        lines = await asyncio.to_thread(parse_input, data, body.endpoint)
    except ValueError as exc:
        raise APIError(
            400, f"invalid batch input file {body.input_file_id}: {exc}", param="input_file_id", code="invalid_file"
        ) from exc
    params = {
        "input_file_id": body.input_file_id,
        "endpoint": body.endpoint,
        "completion_window": body.completion_window,
        "metadata": body.metadata,
        "total": len(lines),
        "cost": batch_cost(body.endpoint, lines),
    }
    rec, created = await submit_or_raise(
        svc,
        f"batch:{body.endpoint}",
        params,
        idempotency_key,
        owner=owner,
        id_prefix="batch",
        request=request,
        named=("endpoint", body.endpoint),
    )
    if created:
        await svc.backend.index_add(state.batches_index(owner), rec["id"])
    return JSONResponse(batch_view(rec))


@router.get("/v1/batches")
async def list_batches(
    request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None
) -> JSONResponse:
    """The caller's batches, newest first (OpenAI list object)."""
    svc, owner = service(request.app), owner_of(request)

    async def load(bid: str) -> dict[str, Any] | None:
        return batch_view(rec) if (rec := await svc.get(bid)) is not None else None

    return JSONResponse(await list_page(svc, state.batches_index(owner), limit, after, "batch", load))


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> JSONResponse:
    return JSONResponse(batch_view(await _batch_or_404(request, batch_id)))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    rec = await _batch_or_404(request, batch_id)
    if rec["status"] in ("succeeded", "failed"):
        raise APIError(409, f"batch {batch_id} already {_STATUS[rec['status']]}", code="batch_finished")
    svc = service(request.app)
    rec = await svc.cancel(batch_id) or rec
    deadline = time.monotonic() + CANCEL_WAIT_S
    while _cancelling(rec) and time.monotonic() < deadline:  # its lines in flight stop, what is done is kept
        await asyncio.sleep(0.05)
        rec = await svc.get(batch_id) or rec
    return JSONResponse(batch_view(rec))
