"""The FastAPI application: shared routes (health, readiness, models, metrics), auth, error
handling, and one router per modality.

``build_app(args)`` builds engines from the CLI arguments; ``create_app(engines)`` wires
already-built engines (tests use it). The app's lifespan starts the engines and shuts them down.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from engine.heap import freeze_startup_heap, record_pauses, take_pauses
from engine.openmp import release_thread_team
from gateway.auth import KeyCheckMiddleware, KeyStore, auth_dependency, keystore_from_args
from gateway.drain import InFlight, InFlightMiddleware
from gateway.errors import install_error_handlers, model_not_found
from gateway.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimitMiddleware
from gateway.logs import RequestLogMiddleware
from gateway.metrics import HTTPMetricsMiddleware, Metrics, engine_modality
from gateway.ratelimit import MemoryRateLimiter, RateLimiter, limiter_from_args

logger = logging.getLogger("mmserve.gateway")
_GC_HELP = "the process's garbage collections since start-up, every thread stopped meanwhile (engine.heap)"


def _stats(engine: Any) -> dict[str, Any]:
    try:
        return dict(engine.stats())
    except Exception:  # noqa: BLE001 - metrics must never fail the scrape
        logger.exception("engine.stats() failed")
        return {}


def _dead_engines(engines: dict[str, Any]) -> dict[str, str]:
    """The engines whose loop stopped for good, with why."""
    return {name: repr(e.dead) for name, e in engines.items() if getattr(e, "dead", None) is not None}


def _common_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Liveness: the process answers and no engine died (a dead engine fails every request
        until the process restarts: 503 names it, so an orchestrator restarts it)."""
        dead = _dead_engines(request.app.state.engines)
        if dead:
            return JSONResponse({"status": "engine dead", "dead": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        """Readiness: every engine started (503 while starting or after shutdown began); under
        ``--dispatch celery`` also Redis reachable and at least one live worker per model."""
        state = request.app.state
        dead = _dead_engines(state.engines)
        ok = bool(state.ready) and not state.draining and not dead
        status = "draining" if state.draining else "engine dead" if dead else "ready" if ok else "starting"
        body: dict[str, Any] = {"status": status, "models": list(state.engines), **({"dead": dead} if dead else {})}
        cluster = getattr(state, "cluster", None)
        if cluster is not None:
            workers = {name: [w.worker_id for w in cluster.live(name)] for name in state.engines}
            body.update(redis=cluster.redis_ok, workers=workers)
            if ok and not (cluster.redis_ok and all(workers.values())):
                ok, body["status"] = False, "redis unreachable" if not cluster.redis_ok else "waiting for workers"
        return JSONResponse(body, status_code=200 if ok else 503)

    @router.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        """Prometheus text: request counters, latency histograms, engine stats."""
        state = request.app.state
        stats = {name: _stats(engine) for name, engine in state.engines.items()}
        modalities = {name: engine_modality(engine) for name, engine in state.engines.items()}
        state.metrics.set_gauge("http_inflight_requests", state.inflight.count, help="HTTP requests in progress")
        for generation, seconds in take_pauses():
            state.metrics.observe("gc_pause_seconds", seconds, help=_GC_HELP, generation=str(generation))
        state.metrics.set_gauge("gc_frozen_objects", gc.get_freeze_count(), help="objects frozen at start-up")
        text = state.metrics.render(stats, modalities)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return router


def _models_router() -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        """OpenAI model list; each card carries ``max_model_len``."""
        state = request.app.state
        data = []
        for name, engine in state.engines.items():
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "mmserve",
                    "root": getattr(engine, "model_name", name),
                    "max_model_len": getattr(engine, "max_model_len", None),
                }
            )
        return {"object": "list", "data": data}

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict[str, Any]:
        """A model's card; an alias the routes accept (``whisper-1``, ``tts-1``, ...) gets its
        model's card under the name asked for (``root``: the model)."""
        listing = await list_models(request)
        served = request.app.state.aliases.get(model_id, model_id)
        for card in listing["data"]:
            if card["id"] == served:
                return {**card, "id": model_id}
        raise model_not_found(model_id, [c["id"] for c in listing["data"]])

    return router


def create_app(
    engines: dict[str, Any],
    api_key: str | None = None,
    routers: Sequence[APIRouter] | None = None,
    aliases: dict[str, str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_limits: Mapping[str, int] | None = None,
    keys: KeyStore | None = None,
    ratelimiter: RateLimiter | None = None,
    drain_timeout_s: float = 30.0,
    warm_ups: Sequence[Callable[[dict[str, Any]], Awaitable[Any]]] = (),
    freeze_heap: bool = False,
) -> FastAPI:
    """An app serving ``engines`` (served model name -> ``AsyncEngine``).

    Auth: ``keys`` (tenants, key hashes, limits; see ``gateway.auth``) and/or ``api_key`` (a
    tenant ``default``); with neither, every request runs as tenant ``anonymous``. Per-tenant
    limits are kept by ``ratelimiter`` (default: in memory; see ``gateway.ratelimit``). At
    shutdown, ``/ready`` turns 503 and in-flight requests get ``drain_timeout_s`` to finish
    before the engines stop (see ``gateway.drain``).

    Request bodies over ``max_body_bytes`` are answered 413 before any route reads them, except on
    the routes of ``body_limits`` (``{"METHOD /path": bytes}``, default: what the plugins declare
    when ``routers`` is omitted, else none), which stream their bodies under their own limit
    (``gateway.limits``).

    ``aliases`` maps extra accepted ``model`` values to served names (not listed in ``/v1/models``).

    ``routers`` are the modality routers to mount under the auth dependency (default: every
    modality plugin's router). The lifespan calls ``start()`` on every engine, then each of
    ``warm_ups`` with the engines (before ``/ready`` turns ready), and ``shutdown()`` on exit.
    ``freeze_heap``: once warmed, the process's objects are frozen out of the garbage collector's
    full collections (``engine.heap``; for a server process, not one that builds many apps).
    """
    if routers is None:
        from gateway.plugins import body_limits as plugin_body_limits
        from gateway.plugins import routers as plugin_routers

        routers = plugin_routers()
        body_limits = plugin_body_limits(None) if body_limits is None else body_limits

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started = []
        try:
            for name, engine in engines.items():
                if hasattr(engine, "start"):
                    await engine.start()
                started.append(engine)
                logger.info("engine %s started", name)
            for warm_up in warm_ups:
                try:
                    await warm_up(engines)
                except Exception:  # noqa: BLE001 - only the first requests lose: serve them cold
                    logger.exception("start-up warm-up failed")
            release_thread_team()  # loading's OpenMP team: the engines' threads compute from here
            if freeze_heap:
                logger.info("froze %d start-up objects out of garbage collection", freeze_startup_heap())
            app.state.ready = True
            yield
        finally:
            app.state.ready = False
            app.state.draining = True
            if not await app.state.inflight.wait_idle(drain_timeout_s):
                logger.warning("drain timeout: stopping engines with %d request(s) in flight", app.state.inflight.count)
            if (jobs := getattr(app.state, "jobs", None)) is not None:  # its local jobs use the engines
                try:
                    await jobs.shutdown()
                except Exception:  # noqa: BLE001 - the engines must still stop
                    logger.exception("job service shutdown failed")
            for engine in reversed(started):
                if hasattr(engine, "shutdown"):
                    try:
                        await asyncio.wait_for(engine.shutdown(), timeout=30)
                    except Exception:  # noqa: BLE001 - keep shutting the others down
                        logger.exception("engine shutdown failed")
            await app.state.ratelimiter.aclose()

    record_pauses()
    app = FastAPI(title="mmserve", version="0.1.0", lifespan=lifespan)
    app.state.engines = dict(engines)
    app.state.aliases = dict(aliases or {})
    app.state.ready = False
    app.state.created = int(time.time())
    app.state.metrics = Metrics()
    app.state.draining = False
    app.state.inflight = InFlight()
    app.state.ratelimiter = ratelimiter if ratelimiter is not None else MemoryRateLimiter()
    keys = keys if keys is not None else KeyStore()
    if api_key:
        keys.add_plain_key("default", api_key)
    app.state.keys = keys
    install_error_handlers(app)

    auth = [Depends(auth_dependency(keys))]
    common, keyed = _common_router(), [_models_router(), *routers]
    app.include_router(common)
    for router in keyed:
        app.include_router(router, dependencies=auth)
    # Every route, for ``route_info`` to name the route of a response a middleware gave before routing.
    app.state.routes = [route for router in (common, *keyed) for route in router.routes]
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes, route_limits=body_limits)
    app.add_middleware(KeyCheckMiddleware, store=keys)  # outside the body limits: a 401 reads no body
    app.add_middleware(HTTPMetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(InFlightMiddleware, inflight=app.state.inflight)
    app.add_middleware(RequestLogMiddleware)  # outermost: every response carries X-Request-ID
    return app


def build_app(args: Any, freeze_heap: bool = False) -> FastAPI:
    """The app for ``mmserve serve``: every enabled modality's plugin builds its engines from
    ``args`` (``args.only`` restricts the modalities) and mounts its router. ``freeze_heap``:
    ``create_app``'s."""
    from gateway import plugins

    cluster = None
    if getattr(args, "dispatch", "local") == "celery":  # proxies to `mmserve worker` processes
        from workers.proxies import build_remote

        built, cluster = build_remote(args)
    else:
        built = plugins.build_all(args)
    max_body_mb = getattr(args, "max_body_mb", None)
    max_body = int(max_body_mb * (1 << 20)) if max_body_mb else DEFAULT_MAX_BODY_BYTES
    app = create_app(
        built.engines,
        routers=plugins.routers(),
        aliases=built.aliases,
        max_body_bytes=max_body,
        body_limits=plugins.body_limits(args),
        keys=keystore_from_args(args),  # --keys-file, --api-key, --limit
        ratelimiter=limiter_from_args(args),
        drain_timeout_s=getattr(args, "drain_timeout", 30.0),
        # Engines in worker processes (celery dispatch) are not warmed from here.
        warm_ups=[] if cluster is not None or getattr(args, "no_warmup", False) else plugins.warm_ups(),
        freeze_heap=freeze_heap,
    )
    app.state.cluster = cluster  # /ready reports its workers
    app.state.args = args  # services without engines (workers.jobs) read their options from it
    return app
