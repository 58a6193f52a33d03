"""Celery task for one chain stage (``mmserve.pipeline.stage``), imported by every
``mmserve worker`` (``workers.celery_app.TASK_MODULES``).

The stage runs on the worker's engine loop with the worker's engines (``workers.runtime``); its
input and output live in the ``StageStore`` on the worker's Redis. A failed attempt is retried
(``max_attempts`` of the chain's options) before the chain goes on; earlier stages are never
re-run because their outputs are already stored. An attempt a busy engine refused (a 429) is
retried after the wait it asked for instead, without counting as an attempt
(``pipelines.chain.after_failure``): the task is sent again with that countdown, so it holds no
thread of the worker while it waits. A chain sent again (``pipelines.follower``: its
stage's worker was lost) makes the tasks of the earlier sending no-ops (``StageStore.live``),
also the one Redis gives back once its visibility timeout has passed.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

TASK_NAME = "mmserve.pipeline.stage"


def _services(rt: Any, stage: str) -> Any:
    """What makes the worker's engine for ``stage`` of a chain's options: the one they name,
    else its first (``ServiceMissing`` when this worker has none such: an attempt that fails)."""
    from pipelines.services import Services
    from pipelines.stage_store import STAGES

    spec = next(s for s in STAGES if s.name == stage)

    def make(opts: Any) -> Services:
        named = {m: getattr(opts, m) for m in spec.needs}
        return Services.from_engines(rt.engines, **named, need=spec.needs) if spec.needs else Services()

    return make


@shared_task(name=TASK_NAME, bind=True, max_retries=None, acks_late=True)
def run_stage_task(
    self: Any, chain_id: str, stage: str, prefix: str, last: bool = False, dispatch: int | None = None
) -> dict[str, Any] | None:
    from pipelines.chain import after_failure, result, run_stage
    from pipelines.stage_store import shared_store
    from workers import runtime

    rt = runtime.current()
    if rt is None:
        raise RuntimeError("pipeline stages run inside 'mmserve worker' (no engines in this process)")
    store = shared_store(rt.redis_url, prefix)
    if not store.live(chain_id, dispatch):  # ended, or sent again after a lost worker: a no-op
        return None
    try:
        rt.run_task(run_stage(store, chain_id, stage, _services(rt, stage), rt.worker_id, dispatch))
    except Exception as exc:
        delay = after_failure(store, chain_id, stage, exc, dispatch)  # (raises when the chain fails)
        raise self.retry(exc=exc, countdown=delay) from exc
    if not last or not store.live(chain_id, dispatch):
        return None
    store.set_status(chain_id, "succeeded")
    out = result(store, chain_id)
    out.pop("audio", None)  # the audio stays in the stage store; the Celery result stays small
    return out
