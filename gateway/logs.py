"""Request ids and structured request logs.

``RequestLogMiddleware`` gives every HTTP request an id (the client's ``X-Request-ID`` when it
is a sane token, else a fresh one), exposes it as ``request.state.request_id``, echoes it in
the ``X-Request-ID`` response header and, when the response is complete (streams included),
writes one line to the ``mmserve.access`` logger with: ``request_id``, ``tenant``, ``method``,
``route`` (the path template), ``modality``, ``status``, ``total_ms`` and whatever the route
added with ``annotate(request, ...)`` (``model``, ``queue_ms``, ``inference_ms``,
``prompt_tokens``, ``completion_tokens``, ...). Successful probes and scrapes (``/health``,
``/ready``, ``/metrics``) log at debug level.

``configure_logging("json")`` renders every ``mmserve``/uvicorn log record as one JSON object
per line (``mmserve serve`` does this; ``--log-format text`` keeps plain lines).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("mmserve.access")

_PROBES = {"/health", "/ready", "/metrics"}
_SANE_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")
_RECORD_ATTRS = set(vars(logging.makeLogRecord({})))


def annotate(request: Request, **fields: Any) -> None:
    """Add fields to the request's log line (later values win)."""
    state = request.scope.setdefault("state", {})
    state.setdefault("log_fields", {}).update(fields)


def route_info(scope: Scope) -> tuple[str, str]:
    """``(route template, modality)`` of the matched route: ``modalities.<name>.*`` endpoints
    belong to ``<name>``, ``gateway.*`` to ``gateway``, others to their package (e.g. ``jobs``).
    A response a middleware gave before routing (a 401, 413, 415) is matched here, so it is
    counted under its route too."""
    if "route" not in scope:  # answered before routing; matched once (the log and the metrics both ask)
        scope["route"] = _match(scope)
    route = scope["route"]
    path = getattr(route, "path", None)
    if not isinstance(path, str):
        return "other", "other"  # unknown paths: bounded label values for scanners
    module = getattr(getattr(route, "endpoint", None), "__module__", "") or ""
    parts = module.split(".")
    if parts[0] == "modalities" and len(parts) > 1:
        modality = parts[1]
    elif parts[0] == "gateway" or len(parts) < 2:
        modality = "gateway"
    else:
        modality = parts[-2]
    return path, modality


def _match(scope: Scope) -> BaseRoute | None:
    """The route for ``scope`` among the app's ``state.routes``, as the router picks it: the first
    to match path and method, else the first to match the path; None if none does."""
    routes: list[BaseRoute] = getattr(getattr(scope.get("app"), "state", None), "routes", [])
    matches = [(r, r.matches(scope)[0]) for r in routes]
    return next((r for r, m in matches if m == Match.FULL), None) or next(
        (r for r, m in matches if m == Match.PARTIAL), None
    )


class RequestLogMiddleware:
    """Pure ASGI (streaming-safe): request id in and out, one access-log line per request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        incoming = dict(scope.get("headers", [])).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming if _SANE_ID.match(incoming) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = {"code": 500}

        async def _send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            route, modality = route_info(scope)
            tenant = state.get("tenant")
            fields = {
                "request_id": request_id,
                "tenant": getattr(tenant, "name", None),
                "method": scope.get("method"),
                "route": route,
                "modality": modality,
                "status": status["code"],
                "total_ms": round((time.perf_counter() - start) * 1e3, 1),
                **state.get("log_fields", {}),
            }
            # probes and scrapes every few seconds would drown the log: debug unless they fail
            quiet = route in _PROBES and status["code"] < 400
            access_logger.log(logging.DEBUG if quiet else logging.INFO, "request", extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``msg``, the record's
    ``fields`` (see ``RequestLogMiddleware``) and any other ``extra`` values."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        for k, v in vars(record).items():
            if k not in _RECORD_ATTRS and k not in ("fields", "message", "color_message"):
                out.setdefault(k, v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """Plain lines; request fields appended as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        return line


def configure_logging(fmt: str = "json", level: str = "info") -> None:
    """Send every log record (mmserve, uvicorn, libraries) to stderr in ``fmt`` ("json" | "text")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
