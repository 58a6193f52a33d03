"""Test helpers: a real uvicorn server on a free loopback port, a Redis probe, and polling for
state that another thread changes."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

# Bounds a wait on another thread; only reached when the behaviour under test is broken.
DEADLINE_S = 60.0


@contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """Run ``app`` under uvicorn in a background thread; yield its base URL; stop it after."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    from pipelines.realtime_events import WS_MAX_BYTES  # as ``mmserve serve`` runs it

    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", ws_max_size=WS_MAX_BYTES))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        sock.close()


def serving(*modalities: str) -> dict[str, Any]:
    """Stand-ins for engines that only tell their modality: a ``JobService`` given them accepts
    those modalities' job kinds (it refuses a kind whose modality it serves no engine of), for
    jobs that need no engine here (the test kinds, of ``embed``; a job run by Celery workers)."""
    from types import SimpleNamespace

    return {f"{m}-stub": SimpleNamespace(modality=m) for m in modalities}


def redis_reachable(url: str) -> bool:
    """Whether the Redis server at ``url`` answers a ping (tests needing it skip otherwise)."""
    try:
        import redis

        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except Exception:  # noqa: BLE001
        return False


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` (state another thread changes: an engine loop, a worker thread) until
    it holds; fail after ``DEADLINE_S``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not condition():
        assert loop.time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.01)


def streamed_calls(chunks: list[Any]) -> dict[int, list[tuple[str, str]]]:
    """The tool calls of a streamed chat completion (``openai`` chunks), per choice: (name,
    arguments joined from their deltas), checking that each call's first delta carries its id,
    type and name and its later deltas only arguments."""
    calls: dict[int, dict[int, list[str]]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for t in choice.delta.tool_calls or []:
                mine = calls.setdefault(choice.index, {})
                if t.index not in mine:
                    assert t.id and t.id.startswith("call_") and t.type == "function" and t.function.name
                    mine[t.index] = [t.function.name, t.function.arguments or ""]
                else:
                    assert t.id is None and t.function.name is None
                    mine[t.index][1] += t.function.arguments or ""
    return {i: [(name, args) for name, args in (v[k] for k in sorted(v))] for i, v in calls.items()}
