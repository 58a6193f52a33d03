"""The generic engine-call task: any engine method of a worker, called by the gateway's proxies
(``workers.remote``) through the worker's own queue; the reply flows through a Redis Stream."""

from __future__ import annotations

from celery import shared_task

from workers import runtime
from workers.wire import Call

ENGINE_CALL = "mmserve.engine.call"


@shared_task(name=ENGINE_CALL, ignore_result=True)
def engine_call(call: Call) -> None:
    """Run ``call`` on this worker's engines (see ``WorkerRuntime.execute``)."""
    rt = runtime.current()
    if rt is None:
        raise RuntimeError("mmserve.engine.call runs only inside `mmserve worker`")
    rt.execute(call)
