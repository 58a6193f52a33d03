"""The Celery application shared by the gateway (producer) and ``mmserve worker`` (consumer).

Broker and result backend: Redis (``--redis-url``, e.g. ``redis://127.0.0.1:6379/0``).
Serializer: pickle, because the cluster is trusted and payloads are numpy arrays, bytes and
dataclasses; never expose the Redis instance to untrusted clients.

Delivery settings: ``task_acks_late`` + ``task_reject_on_worker_lost`` (a task is acknowledged only
after it ran, so a lost worker does not silently eat it) and prefetch 1 (a worker reserves no
more tasks than it has free slots). Note that with the Redis transport an unacked task of a
SIGKILLed worker is redelivered only after the visibility timeout; the gateway does not rely on
that (it watches worker heartbeats and resubmits or fails the request itself, see
``workers/remote.py``), and removes the engine calls a dead worker had taken from its own queue
before then (``workers/sweeper.py``).

Queue naming (``prefix`` defaults to ``mmserve``; tests use their own to stay isolated):

- ``<prefix>.<modality>`` (``modality_queue``): every worker of that modality consumes it; send
  work there when any worker may take it (batch jobs, pipelines).
- ``<prefix>.worker.<worker_id>`` (``worker_queue``): only that worker consumes it; the gateway
  sends engine calls there once it has picked the worker (prefix-affinity routing, load).

Registering tasks (other packages, e.g. ``workers.jobs``, ``pipelines``): define them with
``@celery.shared_task(name="mmserve.<area>.<what>")`` in a module and add the module path to
``TASK_MODULES`` (missing modules are skipped). ``mmserve worker`` imports every listed module, so
the tasks exist on every worker; producers send them by name
(``make_celery(url).send_task("mmserve.jobs.run", args=[...], queue=modality_queue("embed"))``)
or import the module and call ``.apply_async(..., queue=...)``. A task that needs the worker's
engines gets them from ``workers.runtime.current()`` (``None`` outside ``mmserve worker``).
"""

from __future__ import annotations

import importlib.util

from celery import Celery

DEFAULT_PREFIX = "mmserve"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

# Modules whose tasks every worker registers (optional ones are skipped when absent).
TASK_MODULES: list[str] = ["workers.tasks", "workers.jobs.tasks", "pipelines.tasks"]


def modality_queue(modality: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The queue every worker of ``modality`` consumes."""
    return f"{prefix}.{modality}"


def worker_queue(worker_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The queue only worker ``worker_id`` consumes."""
    return f"{prefix}.worker.{worker_id}"


def binding_key(queue: str) -> str:
    """The Redis set of kombu's bindings of ``queue`` (declared by Celery on the exchange of its
    own name): it exists while the queue is declared."""
    from kombu.transport.redis import Channel

    return Channel.keyprefix_queue % queue


def queue_keys(queue: str) -> list[str]:
    """Every Redis key kombu keeps for ``queue``: its lists, one per priority step, and its two
    binding sets."""
    from kombu.transport.redis import Channel

    lists = [queue, *(f"{queue}{Channel.sep}{p}" for p in Channel.priority_steps if p)]
    return [*lists, binding_key(queue), Channel.keyprefix_binding_permanent % queue]


def task_modules() -> list[str]:
    """``TASK_MODULES`` that exist in this installation."""
    found = []
    for name in TASK_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                found.append(name)
        except ModuleNotFoundError:  # parent package missing
            continue
    return found


def make_celery(redis_url: str = DEFAULT_REDIS_URL, *, socket_timeout_s: float = 2.0) -> Celery:
    """A Celery app on ``redis_url`` (broker and result backend) with mmserve's settings.

    Short socket timeouts make a dead Redis an error within seconds instead of a hang; publishing
    is not retried (the gateway answers 503 and the client may retry).
    """
    app = Celery("mmserve", broker=redis_url, backend=redis_url, include=task_modules())
    transport = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
        "visibility_timeout": 3600,
    }
    app.conf.update(
        task_serializer="pickle",
        result_serializer="pickle",
        accept_content=["pickle", "json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_publish_retry=False,
        broker_connection_timeout=socket_timeout_s,
        broker_connection_retry_on_startup=True,
        broker_transport_options=transport,
        result_backend_transport_options={"retry_policy": {"timeout": socket_timeout_s}},
        redis_socket_timeout=socket_timeout_s,
        redis_socket_connect_timeout=socket_timeout_s,
        result_expires=3600,
        task_default_queue=modality_queue("default"),
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    return app
