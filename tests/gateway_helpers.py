"""Shared by the ``test_gateway_*`` files: the real engines they serve (a tiny random Llama and
the packaged all-MiniLM-L6-v2), the modality routers, and a uvicorn server with the drain."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

LLM = "tiny"
BUSY = "tiny-busy"  # max_waiting=0: every request is refused with 429
EMBED = "all-MiniLM-L6-v2"


def llm_engines(max_model_len: int = 128) -> dict[str, Any]:
    """``{LLM: engine, BUSY: engine}`` on one loaded tiny Llama."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_loader import load_model
    from engine.tiny_models import tiny_model_dir

    loaded = load_model(str(tiny_model_dir("llama")), max_model_len=max_model_len)
    common = dict(model=str(loaded.path), max_model_len=max_model_len, num_kv_blocks=64, max_num_seqs=8)
    return {
        LLM: AsyncEngine(LLMEngine(EngineConfig(**common), loaded=loaded)),
        BUSY: AsyncEngine(LLMEngine(EngineConfig(**common, max_waiting=0), loaded=loaded)),
    }


def embed_engine(**kwargs: Any) -> Any:
    from modalities.embed.engine import EmbeddingEngine

    return EmbeddingEngine.from_path(None, num_workers=1, threads_per_worker=1, **kwargs)


def routers() -> list[Any]:
    """The LLM and embeddings routers only (other modalities are tested by their owners)."""
    from modalities.embed.api import router as embed_router
    from modalities.llm.api import router as llm_router

    return [llm_router, embed_router]


@contextmanager
def serve(app: Any, drain_timeout_s: float = 30.0, grace_s: float = 0.0) -> Iterator[tuple[str, Any]]:
    """Run ``app`` under ``DrainingServer`` (what ``mmserve serve`` runs) in a thread; yield
    ``(base_url, server)``. Setting ``server.should_exit`` starts the drain, as SIGTERM does."""
    from gateway.drain import DrainingServer

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=drain_timeout_s)
    server = DrainingServer(config, app.state, grace_s=grace_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    server.thread = thread
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
