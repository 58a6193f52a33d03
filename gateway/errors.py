"""OpenAI-shaped errors for every route.

Every error the gateway returns has the body ``{"error": {"message", "type", "param", "code"}}``
(the shape the official ``openai`` client parses into ``APIStatusError``). User input never
produces a 500: validation problems are 400, an unknown model 404, a non-JSON body 415, a
full queue 429 with ``Retry-After``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineDeadError, PromptTooLongError, QueueFullError, RequestFailedError

logger = logging.getLogger("mmserve.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class ClientDisconnected(Exception):
    """The HTTP client went away; its work was aborted (answered ``disconnected_response``)."""


class APIError(Exception):
    """An error to send to the client as OpenAI error JSON."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return ErrorJSON(self.to_dict(), status_code=self.status_code, headers=self.headers)


class ErrorJSON(JSONResponse):
    """JSON with non-ASCII escaped: a message may quote the client's text, which can hold lone
    surrogates (valid in JSON, unencodable as UTF-8)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


# An escaped high surrogate not followed by a low one, or a low one not after a high one (an
# emoji's escaped pair matches neither); the raw JSON text can hold a lone one no other way.
_HIGH, _LOW = r"\\u[dD][89abAB][0-9a-fA-F]{2}", r"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_LONE_ESCAPE = f"{_HIGH}(?!{_LOW})|(?<!{_HIGH}){_LOW}"
_LONE_TEXT, _LONE_BYTES = re.compile(_LONE_ESCAPE), re.compile(_LONE_ESCAPE.encode())


def may_hold_lone_surrogate(raw: str | bytes) -> bool:
    """Whether JSON text ``raw`` may hold a lone surrogate (one scan; ``lone_surrogate`` on its
    parsed value says where): false for nearly every body, emoji included."""
    if isinstance(raw, bytes):  # (``in`` first: memchr speed, where the pattern's lookbehind is not)
        return b"\\u" in raw and _LONE_BYTES.search(raw) is not None
    return "\\u" in raw and _LONE_TEXT.search(raw) is not None


def lone_surrogate(value: Any) -> str | None:
    """Where the first string in a parsed JSON value holds a lone surrogate (``"\\ud800"`` is
    valid JSON but no character: UTF-8 can't encode it and tokenizers reject it), as a param path
    (``messages[0].content``; ``""`` for the value itself); ``None`` if no string does. Whether
    there is one is found at C speed; only then is the value walked (iteratively: JSON nests as
    deep as the parser allows)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    stack: list[tuple[Any, Any, Any]] = [(None, None, value)]  # (parent entry, key, value): paths made on a hit
    while stack:
        entry = stack.pop()
        item = entry[2]
        if isinstance(item, str):
            if _unencodable(item):
                return _path(entry)
        elif isinstance(item, dict):
            if any(_unencodable(k) for k in item):
                return _path(entry)
            stack.extend((entry, k, x) for k, x in reversed(item.items()) if isinstance(x, str | list | dict))
        elif isinstance(item, list):
            stack.extend((entry, i, x) for i, x in reversed(list(enumerate(item))) if isinstance(x, str | list | dict))
    return None


def _unencodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _path(entry: tuple[Any, Any, Any]) -> str:
    keys = []
    while entry[0] is not None:
        keys.append(entry[1])
        entry = entry[0]
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def error_object(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object (what the envelope holds; a failed job's ``error``)."""
    return {"message": message, "type": type, "param": param, "code": code}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": error_object(message, type, param, code)}


def model_not_found(model: str | None, available: list[str]) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist. Available models: {', '.join(available) or '(none)'}.",
        param="model",
        code="model_not_found",
    )


def pick_engine(
    engines: dict[str, Any],
    aliases: dict[str, str],
    model: str | None,
    matching: dict[str, Any],
    *,
    none_served: str,
    unsupported: str,
) -> tuple[str, Any]:
    """``(served_name, engine)`` for ``model`` among ``matching`` (the served engines of one kind).

    Omitted ``model``: the only matching engine, else 400 (``none_served`` when there is none).
    A served name wins over an alias of the same spelling. A served engine of another kind is a
    400 ("the model `X` {unsupported}"); an unknown name is a 404 listing ``matching``."""
    if model is None:
        if len(matching) == 1:
            return next(iter(matching.items()))
        if not matching:
            raise APIError(400, none_served, param="model")
        raise APIError(400, "you must provide a model parameter", param="model")
    name = model if model in engines else aliases.get(model, model)
    if name in matching:
        return name, matching[name]
    if name in engines:
        raise APIError(400, f"the model `{model}` {unsupported}", param="model", code="invalid_model")
    raise model_not_found(model, list(matching))


def too_busy(message: str, retry_after_s: float) -> APIError:
    """The 429 of a refusal under load: come back in ``Retry-After`` (whole seconds, at least 1)."""
    retry = max(1, math.ceil(retry_after_s))
    return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": str(retry)})


def from_engine_error(exc: BaseException, param: str | None = None) -> APIError | None:
    """Map an engine admission error (or a ``ValueError`` about the input) to an ``APIError``;
    ``None`` for anything else (a bug, which should surface as a 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return too_busy(str(exc), exc.retry_after_s)
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param=param, code="context_length_exceeded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}", code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), code="engine_error")
    if isinstance(exc, ValueError):
        return APIError(
            400, str(exc), param=getattr(exc, "param", param), code="invalid_value" if hasattr(exc, "param") else None
        )
    return None


_PACKAGES = frozenset({"engine", "gateway", "modalities", "pipelines", "workers"})  # mmserve's own


def failure_error(exc: BaseException, internal_type: str = "server_error") -> dict[str, Any]:
    """The OpenAI error object (``message``, ``type``, ``param``, ``code``) of a failure reported
    after the work was accepted (a job's, a realtime reply's): an input's error or an engine's
    refusal (an mmserve exception the routes map) reads as its route's answer would; anything
    else (a bug: a ValueError from Python or a library too) is of ``internal_type`` and names
    the exception's class, for whoever reads the logs."""
    if (mapped := known_error(exc)) is not None:
        return mapped.to_dict()["error"]
    return error_object(f"{type(exc).__name__}: {exc}", internal_type)


def known_error(exc: BaseException) -> APIError | None:
    """The routes' answer to ``exc`` (``from_engine_error``) when it is one of mmserve's own
    exceptions; ``None`` for anything else, a bug's (a bare ``ValueError`` too)."""
    ours = type(exc).__module__.split(".")[0] in _PACKAGES
    return from_engine_error(exc) if isinstance(exc, Exception) and ours else None


def is_input_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the input's fault (a retry would fail the same way)."""
    return failure_error(exc)["type"] == "invalid_request_error"


def retry_after(exc: BaseException) -> float | None:
    """The seconds a refusal under load asks to wait (the routes' 429 with ``Retry-After``: an
    engine's full queue or bound, ``known_error``); None for anything else, a 429 without it too
    (``request_too_large``: waiting would not help)."""
    mapped = known_error(exc)
    if mapped is None or mapped.status_code != 429 or "Retry-After" not in (mapped.headers or {}):
        return None
    try:
        return float((mapped.headers or {})["Retry-After"])
    except ValueError:  # (not ours: an HTTP date)
        return None


def reported_error(failure: dict[str, Any]) -> APIError | None:
    """The route's answer to a failure reported as an error object (``failure_error``'s, e.g. a
    Celery chain's stage): the input's fault (400) or a refusal under load (429); None for
    anything else (the caller's own failure, not the route's)."""
    status = {"invalid_request_error": 400, "rate_limit_error": 429}.get(failure.get("type", ""))
    if status is None:
        return None
    return APIError(status, failure["message"], param=failure.get("param"), code=failure.get("code"))


def as_api_error(exc: BaseException, param: str | None = None) -> BaseException:
    """What a route raises for ``exc``: its ``APIError`` (``from_engine_error``), else ``exc``
    itself (a bug, which surfaces as a 500)."""
    mapped = from_engine_error(exc, param=param) if isinstance(exc, Exception) else None
    return exc if mapped is None else mapped


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none", "list", "dict"})


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    # Pydantic puts union-member / function-validator names into ``loc``; keep field names only.
    parts = [p for p in parts if p not in _TYPE_TAGS and "[" not in p and not p.startswith("function-")]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


def is_json_content_type(value: str | None) -> bool:
    if not value:
        return True  # routes are non-strict: a missing content type is parsed as JSON
    main = value.split(";", 1)[0].strip().lower()
    return main == "application/json" or (main.startswith("application/") and main.endswith("+json"))


def _takes_form(request: Request) -> bool:
    """Whether the matched route reads form fields or uploads (not a JSON body)."""
    from fastapi import params

    dependant = getattr(request.scope.get("route"), "dependant", None)
    return any(isinstance(getattr(p, "field_info", None), params.Form) for p in getattr(dependant, "body_params", []))


def validation_error(request: Request, exc: RequestValidationError) -> APIError:
    """Turn FastAPI/pydantic validation errors into one readable 400 (or 415 for non-JSON)."""
    errors = list(exc.errors())
    content_type = request.headers.get("content-type")
    if not is_json_content_type(content_type) and not _takes_form(request):  # form routes report the field
        return APIError(415, f"unsupported media type {content_type!r}: send the body as application/json")
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        ctx = detail.get("ctx") or {}
        return APIError(400, f"the request body is not valid JSON: {ctx.get('error', 'decode error')}")
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    param = _loc_to_param(loc)
    if first.get("type") in ("model_attributes_type", "dict_type") and param is None:
        return APIError(400, "the request body must be a JSON object")
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    where = f"'{param}'" if param else "the request body"
    message = f"Invalid value for {where}: {msg}"
    if first.get("type") == "missing":
        message = f"Missing required parameter: {where}."
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param, code="invalid_value" if first.get("type") != "missing" else None)


def disconnected_response() -> JSONResponse:
    """What a request whose client left is logged as answering (nobody reads it)."""
    return APIError(499, "client closed the request", type="client_closed_request").response()


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that render every error as OpenAI JSON."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> JSONResponse:
        return disconnected_response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(request, exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"Unknown route {request.method} {request.url.path}"
        return APIError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(QueueFullError)
    @app.exception_handler(PromptTooLongError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(RequestFailedError)
    @app.exception_handler(ValueError)
    async def _engine(request: Request, exc: Exception) -> JSONResponse:
        mapped = from_engine_error(exc)
        assert mapped is not None
        return mapped.response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error").response()
