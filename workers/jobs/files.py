"""OpenAI Files API on the result store: uploads (``purpose`` ``batch`` or ``user_data``) and the
files jobs produce, addressed alike by file id.

- ``POST /v1/files`` (multipart ``file`` + ``purpose``) -> the file object;
- ``GET /v1/files`` (the caller's uploads, newest first), ``GET /v1/files/{id}``,
  ``GET /v1/files/{id}/content`` (also every job result URL), ``DELETE /v1/files/{id}`` (uploads).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import Annotated, Any

from fastapi import File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from gateway.errors import APIError
from workers.jobs.api import not_found, owner_of, router, service, visible
from workers.jobs.runner import JobService
from workers.jobs.store import UPLOADS, check_name, parse_file_id

MAX_UPLOAD_BYTES = 200 << 20
FILE_PURPOSES = ("batch", "user_data")
_SAFE_FILENAME = re.compile(r"[^A-Za-z0-9._ -]")


async def file_object(svc: JobService, fid: str, owner: str | None) -> dict[str, Any]:
    """The OpenAI file object for an upload or a job output (404 when unknown or not the caller's)."""
    try:
        job_id, name = parse_file_id(fid)
    except ValueError as exc:
        raise not_found("file", fid) from exc
    if job_id == UPLOADS:
        meta = await svc.backend.get_meta(f"file:{fid}")
        if meta is None or not visible(meta.get("owner"), owner):
            raise not_found("file", fid)
        return {k: v for k, v in meta.items() if k != "owner"}
    rec = await svc.get(job_id)
    info = next((f for f in rec["files"] if f["name"] == name), None) if rec else None
    if rec is None or info is None or not visible(rec.get("owner"), owner):
        raise not_found("file", fid)
    purpose = "batch_output" if rec["kind"].startswith("batch:") else "job_result"
    return {
        "id": fid,
        "object": "file",
        "bytes": info["bytes"],
        "created_at": int(rec["finished_at"] or time.time()),
        "filename": name,
        "purpose": purpose,
        "status": "processed",
    }


@router.post("/v1/files")
async def upload_file(
    request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
) -> JSONResponse:
    """OpenAI ``POST /v1/files`` (multipart): stores the upload, returns the file object."""
    svc = service(request.app)
    if purpose not in FILE_PURPOSES:
        raise APIError(400, f"purpose must be one of {', '.join(FILE_PURPOSES)}", param="purpose")
    data = await file.read(MAX_UPLOAD_BYTES + 1)
    if len(data) > MAX_UPLOAD_BYTES:
        raise APIError(413, f"files are limited to {MAX_UPLOAD_BYTES >> 20} MiB", param="file")
    if not data:
        raise APIError(400, "the uploaded file is empty", param="file")
    if purpose == "batch" and not (file.filename or "").endswith(".jsonl"):
        raise APIError(400, "batch input files must be JSONL (a .jsonl filename)", param="file")
    fid = f"file-{uuid.uuid4().hex[:24]}"
    await asyncio.to_thread(svc.store.put, UPLOADS, fid, data, file.content_type or "application/octet-stream")
    obj = {
        "id": fid,
        "object": "file",
        "bytes": len(data),
        "created_at": int(time.time()),
        "filename": _SAFE_FILENAME.sub("_", file.filename or "upload")[-200:],
        "purpose": purpose,
        "status": "processed",
    }
    owner = owner_of(request)
    await svc.backend.put_meta(f"file:{fid}", {**obj, "owner": owner})
    await svc.backend.index_add(f"files:{owner or ''}", fid)
    return JSONResponse(obj)


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
) -> JSONResponse:
    """The caller's uploaded files, newest first (OpenAI list object)."""
    svc, owner = service(request.app), owner_of(request)
    ids = await svc.backend.index_list(f"files:{owner or ''}", limit + 1, after)
    data = []
    for fid in ids:
        meta = await svc.backend.get_meta(f"file:{fid}")
        if meta is not None and (purpose is None or meta["purpose"] == purpose):
            data.append({k: v for k, v in meta.items() if k != "owner"})
    return JSONResponse(list_object(data[:limit], more=len(ids) > limit))


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
    obj = await file_object(svc, file_id, owner_of(request))
    job_id, name = parse_file_id(file_id)
    try:
        data, content_type = await asyncio.to_thread(svc.store.get, job_id, check_name(name))
    except FileNotFoundError as exc:
        raise not_found("file content", file_id) from exc
    return Response(
        data, media_type=content_type, headers={"Content-Disposition": f'inline; filename="{obj["filename"]}"'}
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    """Delete an uploaded file (job outputs go with their job)."""
    svc = service(request.app)
    obj = await file_object(svc, file_id, owner_of(request))
    if obj["purpose"] not in FILE_PURPOSES:
        raise APIError(400, "job outputs cannot be deleted one by one", param="file_id")
    await asyncio.to_thread(svc.store.delete, UPLOADS, file_id)
    await svc.backend.delete_meta(f"file:{file_id}")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
