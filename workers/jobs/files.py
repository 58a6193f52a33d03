"""OpenAI Files API on the result store: uploads (``purpose`` ``batch`` or ``user_data``) and the
files jobs produce, addressed alike by file id.

- ``POST /v1/files`` (multipart ``file`` + ``purpose``) -> the file object;
- ``GET /v1/files`` (the caller's uploads, newest first), ``GET /v1/files/{id}``,
  ``GET /v1/files/{id}/content`` (also every job result URL), ``DELETE /v1/files/{id}`` (an upload,
  a generated image, or one output of a finished job).

Uploads stream to the store (spooled to a temporary file on the way, never whole in memory) under
their own body limit, ``--files-max-mb`` (default 200 MiB; ``gateway.limits``): a larger upload is
a 413. Files expire with the retention TTL (``expires_at``; see ``workers.jobs.upkeep``).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from gateway.errors import APIError
from workers.jobs import state
from workers.jobs.api import not_found, owner_of, router, service, visible
from workers.jobs.runner import JobService
from workers.jobs.store import UPLOADS, check_name, parse_file_id
from workers.jobs.upkeep import delete_upload, uploads_in_use

FILE_PURPOSES = ("batch", "user_data")
_SAFE_FILENAME = re.compile(r"[^A-Za-z0-9._ -]")


async def file_object(svc: JobService, fid: str, owner: str | None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI file object for an upload or a job output (404 when unknown or not the caller's,
    naming ``param``: the request field that gave ``fid``)."""
    return (await _file_and_type(svc, fid, owner, param))[0]


async def _file_and_type(
    svc: JobService, fid: str, owner: str | None, param: str | None = None
) -> tuple[dict[str, Any], str | None]:
    """``file_object`` and the content type the file's job recorded (None for an upload)."""
    try:
        job_id, name = parse_file_id(fid)
    except ValueError as exc:
        raise not_found("file", fid, param) from exc
    if job_id == UPLOADS:
        meta = await svc.backend.get_meta(f"file:{fid}")
        if meta is None or not visible(meta.get("owner"), owner):
            raise not_found("file", fid, param)
        return public_meta(meta, svc.cfg.result_ttl_s), None
    rec = await svc.get(job_id)
    info = next((f for f in rec["files"] if f["name"] == name), None) if rec else None
    if rec is None or info is None or not visible(rec.get("owner"), owner):
        raise not_found("file", fid, param)
    purpose = "batch_output" if rec["kind"].startswith("batch:") else "job_result"
    obj = {
        "id": fid,
        "object": "file",
        "bytes": info["bytes"],
        "created_at": int(rec["finished_at"] or time.time()),
        "expires_at": int(rec["finished_at"] + svc.cfg.result_ttl_s) if rec["finished_at"] else None,
        "filename": name,
        "purpose": purpose,
        "status": "processed",
    }
    return obj, info.get("content_type")


def public_meta(meta: dict[str, Any], ttl_s: float) -> dict[str, Any]:
    """The file object of an upload or a generated file: its metadata less the owner."""
    return {**{k: v for k, v in meta.items() if k != "owner"}, "expires_at": int(meta["created_at"] + ttl_s)}


@router.post("/v1/files")
async def upload_file(
    request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
) -> JSONResponse:
    """OpenAI ``POST /v1/files`` (multipart): stores the upload, returns the file object. The body
    limit (413) is enforced while it arrives (``gateway.limits``); the parsed file is spooled to
    disk and copied to the store in chunks."""
    svc = service(request.app)
    if purpose not in FILE_PURPOSES:
        raise APIError(400, f"purpose must be one of {', '.join(FILE_PURPOSES)}", param="purpose")
    await file.seek(0)
    size = file.size or 0  # counted by the multipart parser as it spooled the file
    if not size:
        raise APIError(400, "the uploaded file is empty", param="file")
    if purpose == "batch" and not (file.filename or "").endswith(".jsonl"):
        raise APIError(400, "batch input files must be JSONL (a .jsonl filename)", param="file")
    fid = f"file-{uuid.uuid4().hex[:24]}"
    content_type = file.content_type or "application/octet-stream"
    await asyncio.to_thread(svc.store.put_file, UPLOADS, fid, file.file, content_type)
    obj = {
        "id": fid,
        "object": "file",
        "bytes": size,
        "created_at": int(time.time()),
        "filename": _SAFE_FILENAME.sub("_", file.filename or "upload")[-200:],
        "purpose": purpose,
        "status": "processed",
    }
    owner = owner_of(request)
    await svc.backend.put_meta(f"file:{fid}", {**obj, "owner": owner})
    await svc.backend.index_add(state.files_index(owner), fid)
    return JSONResponse(public_meta(obj, svc.cfg.result_ttl_s))


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
) -> JSONResponse:
    """The caller's uploaded files, newest first (OpenAI list object)."""
    svc, owner = service(request.app), owner_of(request)

    async def load(fid: str) -> dict[str, Any] | None:
        meta = await svc.backend.get_meta(f"file:{fid}")
        if meta is None or (purpose is not None and meta["purpose"] != purpose):
            return None
        return public_meta(meta, svc.cfg.result_ttl_s)

    return JSONResponse(await list_page(svc, state.files_index(owner), limit, after, "file", load))


async def list_page(
    svc: JobService,
    index: str,
    limit: int,
    after: str | None,
    what: str,
    load: Callable[[str], Awaitable[dict[str, Any] | None]],
) -> dict[str, Any]:
    """OpenAI's cursor page of up to ``limit`` objects ``load`` gives for the ids of the caller's
    ``index`` after the cursor ``after`` (``None`` from ``load``: deleted or filtered out, and
    the page reads on, so that it is only short at the end); 400 when ``after`` is none of
    them (expired, or never listed)."""
    data: list[dict[str, Any]] = []
    cursor = after or None  # (``?after=``: from the top)
    while len(data) <= limit:
        want = limit + 1 - len(data)  # (the extra one tells ``has_more``)
        ids = await svc.backend.index_list(index, want, cursor)
        if ids is None:
            msg = f"after: no {what} '{after}' in your list (expired?); list again from the start"
            raise APIError(400, msg, param="after", code="invalid_value")
        data += [obj for item in ids if (obj := await load(item)) is not None]
        if len(ids) < want:
            break
        cursor = ids[-1]
    return list_object(data[:limit], more=len(data) > limit)


def list_object(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """OpenAI's cursor page."""
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await file_object(service(request.app), file_id, owner_of(request)))


@router.get("/v1/files/{file_id}/content")
async def get_file_content(file_id: str, request: Request) -> Response:
    """The file's bytes (uploads, batch outputs, job results)."""
    svc = service(request.app)
    obj, recorded = await _file_and_type(svc, file_id, owner_of(request))
    job_id, name = parse_file_id(file_id)
    try:
        data, guessed = await asyncio.to_thread(svc.store.get, job_id, check_name(name))
    except FileNotFoundError as exc:
        raise not_found("file content", file_id) from exc
    content_type = recorded or guessed  # (the type the job recorded, not the platform's guess)
    return Response(
        data, media_type=content_type, headers={"Content-Disposition": f'inline; filename="{obj["filename"]}"'}
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    """Delete a file: an upload or generated file (409 while a queued or running job reads it), or
    one output of a finished job (409 while the job is queued or running; ``DELETE
    /v1/jobs/{id}`` deletes a job with all its files)."""
    svc = service(request.app)
    await file_object(svc, file_id, owner_of(request))  # 404 unless the caller's
    job_id, name = parse_file_id(file_id)
    if job_id == UPLOADS:
        if (user := (await uploads_in_use(svc.backend)).get(file_id)) is not None:
            msg = f"file {file_id} is the input of job {user}, which has not ended; delete it once the job ends"
            raise APIError(409, msg, code="file_in_use")
        meta = await svc.backend.get_meta(f"file:{file_id}")
        await delete_upload(svc.backend, svc.store, file_id, meta, expired=False)
    else:
        rec, _ = await svc.backend.update(job_id, state.remove_file(name))
        if rec is None:
            raise not_found("file", file_id)
        if rec["status"] not in state.TERMINAL:
            msg = f"job {job_id} is {rec['status']}; its files can be deleted once it ends"
            raise APIError(409, msg, code="job_not_finished")
        await asyncio.to_thread(svc.store.delete, job_id, name)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
