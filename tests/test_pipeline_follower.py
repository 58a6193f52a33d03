"""``pipelines.follower``: the job's watch over its Celery stage chain, on a real Redis (db 14, a
fresh prefix) with the real stage store, heartbeat keys and queue lists. The chain itself is faked:
a thread plays its stages as a worker would write them (``begin``, ``finish``, statuses)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from pipelines.chain import run_stage
from pipelines.services import ServiceMissing, Services
from pipelines.stage_store import ChainOptions, StageStore, shared_store

REDIS_URL = "redis://127.0.0.1:6379/14"
Play = Callable[[str, int], None]  # (chain id, dispatch) -> the stages of that sending


class Harness:
    """A stage store under a fresh prefix, a fake ``celery_chain`` whose sendings run ``play`` on a
    thread (and are recorded), and worker heartbeats."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import pipelines.follower as follower

        self.prefix = f"h8follow-{uuid.uuid4().hex[:8]}"
        self.store = shared_store(REDIS_URL, self.prefix)
        self.sync = redis.Redis.from_url(REDIS_URL)
        self.sent: list[tuple[str, int]] = []
        self.plays: dict[str, Play] = {}
        monkeypatch.setattr(follower, "CHECK_S", 0.1)
        monkeypatch.setattr(
            follower,
            "celery_chain",
            lambda app, chain_id, opts, prefix, d, keep_result: self._chain(chain_id, d, keep_result),
        )

    def _chain(self, chain_id: str, dispatch: int, keep_result: bool) -> Any:
        assert not keep_result  # (the job has the chain's result: Celery keeps none)

        def apply_async() -> None:
            self.sent.append((chain_id, dispatch))
            if play := self.plays.get(chain_id):
                threading.Thread(target=play, args=(chain_id, dispatch), daemon=True).start()

        return type("FakeChain", (), {"apply_async": staticmethod(apply_async)})()

    def chain(self, chain_id: str, play: Play | None = None, **opts: Any) -> ChainOptions:
        options = ChainOptions(**opts)
        self.store.create(chain_id, np.zeros(16, np.float32), options)
        if play is not None:
            self.plays[chain_id] = play
        return options

    def beat(self, worker: str) -> None:
        from workers.wire import Keys

        self.sync.set(Keys(self.prefix).worker(worker), "{}", px=5000)

    def follow(self, chain_id: str, opts: ChainOptions, check: Callable[[], None] = lambda: None, **kw: Any) -> Any:
        """A ``ChainFollower`` coroutine on a fresh async client (closed after)."""
        import redis.asyncio as aioredis

        from pipelines.follower import ChainFollower

        async def go() -> None:
            rt = type("Runtime", (), {"redis_url": REDIS_URL, "prefix": self.prefix})()
            rt.redis = aioredis.from_url(REDIS_URL)
            try:
                await asyncio.wait_for(ChainFollower(rt, self.store, chain_id, opts, **kw).follow(check), 15)
            finally:
                await rt.redis.aclose()

        return go()

    def close(self) -> None:
        for key in self.sync.scan_iter(f"{self.prefix}*"):
            self.sync.delete(key)


@pytest.fixture
def h(monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    harness = Harness(monkeypatch)
    try:
        yield harness
    finally:
        harness.close()


def test_the_job_waits_on_the_async_client_and_cancels_its_chain(h: Harness) -> None:
    """The follower polls without blocking the loop; a cancelled job marks its chain cancelled."""
    from pipelines.follower import celery_app
    from workers.jobs import JobCancelled

    assert shared_store(REDIS_URL, h.prefix) is h.store and celery_app(REDIS_URL) is celery_app(REDIS_URL)

    def play(chain_id: str, dispatch: int) -> None:  # the stages run elsewhere and end after 0.3 s
        time.sleep(0.3)
        h.store.set_status(chain_id, "succeeded")

    ok = h.chain("ok", play)
    stop = h.chain("stop")
    ticks = 0

    async def scenario() -> None:
        nonlocal ticks

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        await h.follow("ok", ok)
        tick.cancel()

        def cancelled() -> None:
            raise JobCancelled("cancelled")

        with pytest.raises(JobCancelled):
            await h.follow("stop", stop, cancelled)

    asyncio.run(scenario())
    assert ticks >= 10  # the loop ran other work while the job waited ~0.3 s
    assert h.store.status("stop")["status"] == "cancelled" and h.sent == [("ok", 1), ("stop", 1)]


def test_a_stage_whose_worker_is_lost_is_sent_again(h: Harness) -> None:
    """The first sending's LLM stage begins on a worker that never beats: the chain is sent
    again (the first sending's tasks are now stale) and the lost attempt counts; progress runs
    from 0 to all stages."""

    def play(chain_id: str, dispatch: int) -> None:
        assert h.store.live(chain_id, dispatch) and not h.store.live(chain_id, dispatch - 1)
        worker = "llm-ghost" if dispatch == 1 else "llm-live"
        if dispatch > 1:
            h.beat(worker)
        h.store.begin(chain_id, "llm", worker, dispatch)
        if dispatch > 1:
            time.sleep(0.3)  # (the follower checks the live worker meanwhile)
            h.store.set_status(chain_id, "succeeded")

    opts = h.chain("lost", play, max_attempts=2)
    reports: list[tuple[int, int]] = []
    asyncio.run(h.follow("lost", opts, progress=lambda step, total, **_: reports.append((step, total))))
    assert h.sent == [("lost", 1), ("lost", 2)] and h.store.attempts("lost", "llm") == 2
    assert reports[0] == (0, 4) and reports[-1] == (4, 4)


def test_a_stage_that_loses_its_last_attempt_fails_the_chain(h: Harness) -> None:
    def play(chain_id: str, dispatch: int) -> None:
        h.store.begin(chain_id, "llm", "llm-ghost", dispatch)

    opts = h.chain("spent", play, max_attempts=1)
    with pytest.raises(RuntimeError, match="llm: worker llm-ghost was lost"):
        asyncio.run(h.follow("spent", opts))
    assert h.sent == [("spent", 1)] and h.store.status("spent")["status"] == "failed"


def test_a_chain_that_failed_on_its_input_fails_the_job_with_the_routes_error(h: Harness) -> None:
    """(It was a RuntimeError "pipeline failed: ...": the job's error a ``job_error``, where a
    chain run in the gateway's process reports the route's error object.)"""
    from engine.errors import PromptTooLongError
    from gateway.errors import APIError, failure_error

    refused = failure_error(PromptTooLongError(5000, 64, 4096))

    def play(chain_id: str, dispatch: int) -> None:
        h.store.begin(chain_id, "llm", "llm-1", dispatch)
        h.store.set_status(chain_id, "failed", f"llm: {refused['message']}", refused)

    opts = h.chain("refused", play, max_attempts=3)
    with pytest.raises(APIError) as failed:
        asyncio.run(h.follow("refused", opts))
    assert failed.value.to_dict()["error"] == refused and refused["code"] == "context_length_exceeded"


def test_a_retried_job_takes_over_a_chain_running_on_a_live_worker(h: Harness) -> None:
    """Not sent again (its stage is under way on a live worker); the earlier follower, when it
    wakes, finds itself superseded and does not cancel the chain."""
    opts = h.chain("taken")
    h.beat("asr-live")
    h.store.begin("taken", "asr", "asr-live", h.store.redispatch("taken"))  # (the first attempt's sending)

    async def scenario() -> None:
        first = asyncio.create_task(h.follow("taken", opts))
        await asyncio.sleep(0.3)
        second = asyncio.create_task(h.follow("taken", opts))  # (the job's retry, on another worker)
        with pytest.raises(Exception, match="followed by a newer attempt"):
            await first
        assert h.store.status("taken")["status"] == "running:asr"  # (not cancelled by the superseded one)
        h.store.set_status("taken", "succeeded")
        await second

    asyncio.run(scenario())
    assert h.sent == []


def test_a_chain_with_nothing_under_way_or_queued_is_sent_again(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ASR stage finished but the LLM stage's task never came (its publishing failed): once
    nothing has moved for ``STALL_S`` with the LLM queue empty, the chain is sent again; a task
    waiting on that queue holds the follower back."""
    import pipelines.follower as follower
    from workers.celery_app import modality_queue

    monkeypatch.setattr(follower, "STALL_S", 0.5)

    def play(chain_id: str, dispatch: int) -> None:
        if dispatch == 1:  # vad and asr run; the llm task is lost
            for stage in ("vad", "asr"):
                h.store.begin(chain_id, stage, "asr-live", dispatch)
                h.store.finish(chain_id, stage, [], 0.01, dispatch)
            return
        h.store.begin(chain_id, "llm", "llm-live", dispatch)
        h.store.set_status(chain_id, "succeeded")

    opts = h.chain("stalled", play)
    queue = modality_queue("llm", h.prefix)

    async def scenario() -> None:
        h.sync.rpush(queue, b"someone else's task")
        follow = asyncio.create_task(h.follow("stalled", opts))
        await asyncio.sleep(1.5)
        assert h.sent == [("stalled", 1)]  # (a task waits on the LLM queue: maybe ours)
        h.sync.delete(queue)
        await follow

    asyncio.run(scenario())
    assert h.sent == [("stalled", 1), ("stalled", 2)]
    assert h.store.attempts("stalled", "asr") == 1  # (done stages are not redone)


def test_progress_tells_the_stages_and_a_stage_no_live_worker_serves(h: Harness) -> None:
    """Each change of the chain's stages (attempts, workers, seconds) is reported; a next stage
    whose modality no live worker serves is named (``waiting_for_worker``) until one heartbeats."""
    from workers.wire import Keys

    reports: list[tuple[int, int, dict[str, Any]]] = []
    h.sync.set(Keys(h.prefix).worker("asr-1"), json.dumps({"modality": "asr"}), px=30_000)

    def play(chain_id: str, dispatch: int) -> None:
        for stage, seconds in (("vad", 0.01), ("asr", 0.02)):
            h.store.begin(chain_id, stage, "asr-1", dispatch)
            h.store.finish(chain_id, stage, [], seconds, dispatch)
        deadline = time.monotonic() + 5  # the LLM stage's task waits: no LLM worker
        while not any(d.get("waiting_for_worker") == "llm" for *_, d in reports) and time.monotonic() < deadline:
            time.sleep(0.02)
        h.sync.set(Keys(h.prefix).worker("llm-1"), json.dumps({"modality": "llm"}), px=5000)
        time.sleep(0.5)
        h.store.begin(chain_id, "llm", "llm-1", dispatch)
        h.store.finish(chain_id, "llm", [], 0.03, dispatch)
        h.store.set_status(chain_id, "succeeded")

    def progress(step: int, total: int, *, detail: dict[str, Any] | None = None) -> None:
        assert detail is not None
        reports.append((step, total, detail))

    opts = h.chain("slow", play, speak=False)
    asyncio.run(h.follow("slow", opts, progress=progress))
    waiting = [(step, d["stage"]) for step, _, d in reports if d.get("waiting_for_worker") == "llm"]
    assert waiting and set(waiting) == {(2, "llm")}  # (vad and asr done, of 3)
    step, total, last = reports[-1]
    assert (step, total, last["stage"]) == (3, 3, None) and "waiting_for_worker" not in last
    stages = last["stages"]
    assert [(s["seconds"], s["worker"], s["attempts"]) for s in stages.values()] == [
        (0.01, "asr-1", 1),
        (0.02, "asr-1", 1),
        (0.03, "llm-1", 1),
    ]
    i = next(i for i, r in enumerate(reports) if r[2].get("waiting_for_worker"))
    assert "waiting_for_worker" not in reports[i + 1][2]  # (once the LLM worker heartbeats)
    assert all(a != b for a, b in zip(reports, reports[1:], strict=False))  # (changes only)


def play_stage_tasks(h: Harness, engine: Any, monkeypatch: pytest.MonkeyPatch) -> Play:
    """A sending played by the real stage task (``pipelines.tasks``) on an LLM worker whose
    engines are ``{"busy": engine}``: the chain's LLM stage (the one not done) runs, and a task
    that asks to be retried runs again once its countdown has passed, as Celery would."""
    from types import SimpleNamespace

    from celery import Task
    from celery.exceptions import Retry

    import workers.runtime
    from pipelines.tasks import run_stage_task
    from workers.wire import Keys

    rt = SimpleNamespace(redis_url=REDIS_URL, worker_id="llm-1", engines={"busy": engine}, run_task=asyncio.run)
    monkeypatch.setattr(workers.runtime, "current", lambda: rt)
    monkeypatch.setattr(Task, "retry", lambda self, exc, countdown: Retry(exc=exc, when=countdown))

    def beat() -> None:
        h.sync.set(Keys(h.prefix).worker("llm-1"), json.dumps({"modality": "llm"}), px=5000)

    def play(chain_id: str, dispatch: int) -> None:
        beat()
        while True:
            try:
                run_stage_task.run(chain_id, "llm", h.prefix, last=True, dispatch=dispatch)
                return
            except Retry as retry:
                beat()
                time.sleep(float(retry.when))
            except Exception:  # noqa: BLE001 - the chain failed: the follower reports it
                return

    return play


def test_a_stage_a_busy_engine_refuses_waits_for_capacity(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Celery dispatch.) The stage task of an LLM stage refused by a full engine queue (the
    route's 429) is retried after a countdown, without using up an attempt: refused more times
    than ``max_attempts``, the chain succeeds. While it waits (longer than ``STALL_S``: its task
    is held by a worker, not queued) the follower does not send the chain again, and progress
    shows ``waiting_for_capacity``. Refused past its ``max_wait_s``, the chain fails its job with
    the route's 429."""
    import pipelines.chain as chain
    import pipelines.follower as follower
    from gateway.errors import APIError
    from tests.test_pipeline_core import BusyLLM, chain_at_llm

    monkeypatch.setattr(follower, "STALL_S", 0.3)
    monkeypatch.setattr(chain, "MAX_WAIT_S", 0.5)  # (the engine asks for 1 s: the cap shortens it)
    h.plays["busy"] = play_stage_tasks(h, BusyLLM(3), monkeypatch)
    chain_at_llm(h.store, "busy", max_attempts=2)
    details: list[dict[str, Any]] = []
    opts = h.store.options("busy")
    asyncio.run(h.follow("busy", opts, progress=lambda *_, detail: details.append(detail)))
    assert h.sent == [("busy", 1)]  # (never taken for stalled)
    llm = h.store.status("busy")["stages"]["llm"]
    assert llm["attempts"] == 1 and llm["worker"] == "llm-1" and 1.4 < llm["waited_s"] <= 1.5, llm
    assert any(d.get("waiting_for_capacity") == "llm" for d in details)
    assert "waiting_for_capacity" not in details[-1]

    h.plays["full"] = play_stage_tasks(h, BusyLLM(1000), monkeypatch)
    chain_at_llm(h.store, "full", max_attempts=2, max_wait_s=0.6)
    with pytest.raises(APIError) as failed:
        asyncio.run(h.follow("full", h.store.options("full")))
    error = failed.value.to_dict()["error"]
    assert failed.value.status_code == 429 and (error["type"], error["code"]) == (
        "rate_limit_error",
        "rate_limit_exceeded",
    )
    assert error["message"].startswith("the server is busy") and "waited 0.6 s for capacity" in error["message"]
    assert h.store.status("full")["stages"]["llm"]["attempts"] == 1


def test_a_stale_attempt_runs_nothing_and_keeps_nothing() -> None:
    """A task of a chain sent again (or of an ended chain) is a no-op: no attempt counted; one that
    goes stale while it runs stores no output; an attempt counts before its engines are looked
    up, so a worker without them uses up attempts instead of retrying forever."""
    store = StageStore(None)
    store.create("c", np.zeros(16_000, np.float32), ChainOptions())
    assert store.redispatch("c") == 1
    asyncio.run(run_stage(store, "c", "vad", Services(), dispatch=0))
    assert store.attempts("c", "vad") == 0 and store.output("c", "vad") is None
    asyncio.run(run_stage(store, "c", "vad", Services(), dispatch=1))
    assert store.attempts("c", "vad") == 1 and store.output("c", "vad") == []  # (silence: no speech)

    def missing(opts: ChainOptions) -> Services:
        raise ServiceMissing("no asr model named 'x' is served")

    with pytest.raises(ServiceMissing):
        asyncio.run(run_stage(store, "c", "asr", missing, dispatch=1))
    assert store.attempts("c", "asr") == 1
    assert store.finish("c", "asr", [], 0.1, dispatch=1) and store.output("c", "asr") == []
    store.redispatch("c")
    assert not store.finish("c", "llm", [], 0.1, dispatch=1) and store.output("c", "llm") is None
    store.set_status("c", "failed", "llm: boom")
    asyncio.run(run_stage(store, "c", "tts", Services(), dispatch=2))
    assert store.attempts("c", "tts") == 0


def test_deleting_a_job_deletes_its_chain(h: Harness, tmp_path: Any) -> None:
    """``DELETE /v1/jobs/{id}`` of a cancelled ``audio.pipeline`` job (celery dispatch, no worker:
    its chain is written here as its worker would) leaves none of the chain's keys in Redis."""
    import httpx

    import pipelines.plugin  # noqa: F401 - registers audio.pipeline
    from gateway.app import create_app
    from tests.helpers import serve_app, serving
    from workers.jobs.plugin import router
    from workers.jobs.runner import JobsConfig, JobService

    cfg = JobsConfig(
        dispatch="celery",
        redis_url=REDIS_URL,
        key_prefix=f"{h.prefix}:jobs",
        queue_prefix=h.prefix,
        store={"type": "local", "root": str(tmp_path)},
    )
    app = create_app({}, routers=[router])
    app.state.jobs = JobService(cfg, serving("asr"))
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        files = {"file": ("q.wav", bytes(3200), "audio/wav")}
        fid = http.post("/v1/files", files=files, data={"purpose": "user_data"}).json()["id"]
        job = http.post("/v1/jobs", json={"kind": "audio.pipeline", "params": {"file_id": fid}}).json()
        h.chain(job["id"])
        h.store.finish(job["id"], "vad", [], 0.1)
        assert len(list(h.sync.scan_iter(f"{h.prefix}:chain:{job['id']}:*"))) == 3  # input, meta, out:vad
        assert http.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
        assert http.delete(f"/v1/jobs/{job['id']}").status_code == 200
        assert http.get(f"/v1/jobs/{job['id']}").status_code == 404
    assert list(h.sync.scan_iter(f"{h.prefix}:chain:*")) == []
    # A stage sent before the job was deleted starts nothing (its chain is not live: nothing is
    # written); one under way that fails then writes its chain's meta anew: it expires too.
    assert h.store.begin(job["id"], "asr", "w1") == 0
    assert list(h.sync.scan_iter(f"{h.prefix}:chain:*")) == []
    h.store.set_status(job["id"], "failed", "asr: gone")
    assert 0 < h.sync.ttl(h.store.meta_key(job["id"])) <= h.store.ttl
