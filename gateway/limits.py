"""Request-size limits as a pure ASGI middleware: oversized bodies get OpenAI error JSON (413)
whether the size is declared (Content-Length) or streamed.

Every route gets ``max_bytes`` (``--max-body-mb``), its body read up front before any route parses
it. A route in ``route_limits`` (``"METHOD /path"`` -> bytes; uploads, e.g. ``POST /v1/files``) has
its own limit instead and its body is passed through as it arrives, never held here: the route
streams it (to a spooled temporary file, then to the result store), and the byte that crosses the
limit ends the request with the 413.

A body read up front with ``Content-Encoding: gzip`` or ``deflate`` is decompressed here (the
limit applies to what it decompresses to), and the route sees it plain; any other encoding, or one
on a streamed route, is a 415.

A JSON body read up front with a lone surrogate in a string (``"\\ud800"``: valid JSON, but no
character) gets a 400 here too: no route can encode it, tokenize it or echo it back.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.offload import run_sized
from gateway.errors import APIError, is_json_content_type, lone_surrogate, may_hold_lone_surrogate

DEFAULT_MAX_BODY_BYTES = 32 << 20


def _too_large(limit: int) -> str:
    return f"request body exceeds the server's limit of {limit} bytes ({limit / (1 << 20):.1f} MiB)"


def _unicode_error(scope: Scope, body: bytes) -> APIError | None:
    """A 400 for a JSON body with a lone surrogate in a string, which no route could use (every
    JSON route's body is read here first); ``None`` for anything else."""
    content_type = dict(scope.get("headers", [])).get(b"content-type", b"").decode("latin-1")
    if not may_hold_lone_surrogate(body) or not is_json_content_type(content_type):
        return None
    try:
        where = lone_surrogate(json.loads(body))
    except (ValueError, RecursionError):
        return None  # not JSON (or too deep for this parser): the route says so
    if where is None:
        return None
    at = f"'{where}'" if where else "the request body"
    return APIError(
        400, f"Invalid value for {at}: a lone surrogate is not a character", param=where or None, code="invalid_value"
    )


_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _encoding(headers: Mapping[bytes, bytes]) -> str:
    value = headers.get(b"content-encoding", b"identity")
    return value.decode("latin-1").strip().lower() or "identity"


def _unsupported(encoding: str, streamed: bool) -> APIError:
    accepted = "identity" if streamed else "gzip, deflate or identity"
    return APIError(415, f"Content-Encoding {encoding!r} is not supported here; send {accepted}", code="invalid_value")


def _decompress(encoding: str, body: bytes, limit: int) -> bytes | APIError:
    """``body`` decoded, at most ``limit`` bytes of it (a larger result is a 413, not a bomb)."""
    decoder = zlib.decompressobj(_WBITS[encoding])
    try:
        out = decoder.decompress(body, limit + 1)
    except zlib.error as exc:
        return APIError(400, f"the request body is not valid {encoding} data: {exc}", code="invalid_value")
    if len(out) > limit:
        return APIError(413, _too_large(limit) + " once decompressed")
    if not decoder.eof:
        return APIError(400, f"the request body's {encoding} data is truncated", code="invalid_value")
    return out


def _plain(scope: Scope, length: int) -> Scope:
    """``scope`` for a decompressed body: no Content-Encoding, its Content-Length."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k not in (b"content-encoding", b"content-length")]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a streamed body crosses its route's limit. An
    ``HTTPException``, so FastAPI's body parsing re-raises it as is and the app's handler renders
    it as OpenAI error JSON."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, _too_large(limit))


class BodySizeLimitMiddleware:
    def __init__(
        self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES, route_limits: Mapping[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.route_limits = dict(route_limits or {})

    async def _reject(self, limit: int, scope: Scope, receive: Receive, send: Send) -> None:
        await APIError(413, _too_large(limit)).response()(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route_limit = self.route_limits.get(f"{scope['method']} {scope['path']}")
        limit = self.max_bytes if route_limit is None else route_limit
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(limit, scope, receive, send)
            return
        encoding = _encoding(headers)
        if encoding != "identity" and (route_limit is not None or encoding not in _WBITS):
            await _unsupported(encoding, route_limit is not None).response()(scope, receive, send)
            return
        if route_limit is not None:
            await self._streamed(route_limit, scope, receive, send)
            return
        # Read the body up front (bounded by the limit), then replay it to the app.
        buffered: list[Message] = []
        total = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            total += len(message.get("body", b""))
            if total > limit:
                await self._reject(limit, scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        body = b"".join(m.get("body", b"") for m in buffered)
        if encoding != "identity":
            plain = await run_sized(len(body) * 4, _decompress, encoding, body, limit)  # (it inflates)
            if isinstance(plain, APIError):
                await plain.response()(scope, receive, send)
                return
            scope, body = _plain(scope, len(plain)), plain
            buffered = [{"type": "http.request", "body": body, "more_body": False}]
        error = await run_sized(len(body), _unicode_error, scope, body)  # (a big one on a thread)
        if error is not None:
            await error.response()(scope, receive, send)
            return

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _streamed(self, limit: int, scope: Scope, receive: Receive, send: Send) -> None:
        """The body passes through, counted; crossing ``limit`` raises ``BodyTooLarge`` in the
        reader (answered 413 here if it escapes the app before a response started)."""
        total, started = 0, False

        async def counted() -> Message:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watch)
        except BodyTooLarge:
            if started:
                raise
            await self._reject(limit, scope, receive, send)
