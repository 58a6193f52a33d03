"""Graceful shutdown: stop taking traffic, let in-flight requests finish, then stop engines.

On SIGTERM/SIGINT ``mmserve serve`` (``DrainingServer``):

1. marks the app as draining: ``/ready`` answers 503 so load balancers stop routing to it;
2. keeps serving for ``--drain-grace`` seconds (default 0) while they notice;
3. stops accepting connections and waits up to ``--drain-timeout`` seconds (default 30) for
   in-flight requests, streams included, to complete; whatever is still running then is cancelled
   (its engine requests are aborted);
4. runs the app's lifespan shutdown, which waits (same timeout) for requests still counted by
   ``InFlightMiddleware`` (other ASGI servers) and then stops the engines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError

logger = logging.getLogger("mmserve.gateway")


class InFlight:
    """A count of HTTP requests in progress."""

    def __init__(self) -> None:
        self.count = 0

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.count > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True


class InFlightMiddleware:
    """Pure ASGI: counts HTTP requests until their response is complete. A request cancelled by
    the server (the drain timeout passed) before its response started is answered 503."""

    def __init__(self, app: ASGIApp, inflight: InFlight) -> None:
        self.app = app
        self.inflight = inflight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def _send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.inflight.count += 1
        try:
            await self.app(scope, receive, _send)
        except asyncio.CancelledError:
            if started:
                raise
            # uvicorn would answer 500; the request was fine, the server is going away
            error = APIError(503, "the server is shutting down; retry on another instance", code="shutting_down")
            error.headers = {"Connection": "close", "Retry-After": "1"}
            await error.response()(scope, receive, send)
        finally:
            self.inflight.count -= 1


class DrainingServer(uvicorn.Server):
    """A uvicorn server that turns ``/ready`` to 503 (``app_state.draining``) and optionally keeps
    serving ``grace_s`` seconds before uvicorn's own shutdown (stop accepting, wait for in-flight
    requests up to ``config.timeout_graceful_shutdown``, lifespan shutdown)."""

    def __init__(self, config: uvicorn.Config, app_state: Any, grace_s: float = 0.0) -> None:
        super().__init__(config)
        self.app_state = app_state
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        self.app_state.draining = True
        inflight: InFlight | None = getattr(self.app_state, "inflight", None)
        logger.info("draining: %d request(s) in flight", inflight.count if inflight else -1)
        if self.grace_s > 0:
            await asyncio.sleep(self.grace_s)
        await super().shutdown(sockets)


def run_server(app: Any, args: Any) -> None:
    """``mmserve serve``: uvicorn on the structured logs the caller configured (``--log-format``,
    before the engines loaded), no duplicate access log (``RequestLogMiddleware`` writes one line
    per request) and the drain above."""
    from pipelines.realtime_events import WS_MAX_BYTES

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        ws_max_size=WS_MAX_BYTES,
        log_config=None,
        log_level=getattr(args, "log_level", "info"),
        access_log=False,
        timeout_graceful_shutdown=max(0.1, float(getattr(args, "drain_timeout", 30.0))),
    )
    DrainingServer(config, app.state, grace_s=float(getattr(args, "drain_grace", 0.0))).run()
