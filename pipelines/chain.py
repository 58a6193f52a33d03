"""The uploaded-audio chain: VAD → ASR → LLM (→ TTS), one stage per modality.

Each stage is a small processor pipeline run depth-first over the previous stage's output frames;
its output frames, timing and attempt count are persisted in a ``StageStore`` (Redis, shared by
the gateway and the workers) before the next stage starts. So a failed stage is retried alone
(earlier outputs are read back, never recomputed), and running a chain again skips the stages
already done; a stage a busy engine refused waits for capacity instead (``after_failure``).
``run_local`` runs the stages in-process (local dispatch); ``celery_chain`` builds a Celery chain
with each stage task on its modality's queue (``pipelines.tasks``) so each stage scales with its
own workers.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any, TypeVar

import numpy as np

from gateway.errors import APIError, failure_error, is_input_error, retry_after, too_busy
from modalities.audio import ASR_RATE
from pipelines.conversation import Conversation
from pipelines.frames import AudioFrame, End, Frame, LLMDone, Transcript, TTSAudio, UserAudio
from pipelines.processor import Pipeline, Processor
from pipelines.reply import LLM, LLMOptions
from pipelines.services import Services
from pipelines.speech import ASR, TTS, Sentences, TTSOptions
from pipelines.stage_store import ChainOptions, Progress, StageFailed, StageStore, no_progress

# -- processors only the chain needs ---------------------------------------------------------------


class SpeechSegments(Processor):
    """A whole recording → one ``UserAudio`` per speech segment (the shared offline VAD)."""

    def __init__(self, backend: str = "webrtc") -> None:
        self.backend = backend

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if not isinstance(frame, AudioFrame):
            yield frame
            return
        from modalities.vad import speech_segments

        for i, (start, end) in enumerate(speech_segments(frame.samples, self.backend)):
            lo, hi = int(start * ASR_RATE), int(end * ASR_RATE)
            ms = (int(start * 1000), int(end * 1000))
            yield UserAudio(frame.samples[lo:hi], ASR_RATE, *ms, item_id=f"seg_{i:04d}", respond=False)


class JoinTranscripts(Processor):
    """Segment transcripts → one user turn (at ``End``) that asks for a reply."""

    def __init__(self) -> None:
        self.parts: list[Transcript] = []

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, Transcript):
            self.parts.append(frame)
        elif isinstance(frame, End):
            text = " ".join(p.text for p in self.parts if p.text)
            if text:
                yield Transcript(text, self.parts[0].start_ms, self.parts[-1].end_ms, item_id="user", respond=True)
            yield frame
        else:
            yield frame


def stage_pipeline(name: str, services: Services, opts: ChainOptions) -> Pipeline:
    if name == "vad":
        return Pipeline([SpeechSegments()])
    if name == "asr":
        return Pipeline([ASR(services)])
    if name == "llm":
        conv = Conversation(opts.instructions) if opts.instructions else Conversation()
        llm_opts = LLMOptions(max_tokens=opts.max_tokens, temperature=opts.temperature)
        return Pipeline([JoinTranscripts(), LLM(services, conv, llm_opts), Sentences()])
    if name == "tts":
        return Pipeline([TTS(services, TTSOptions(True, opts.voice, opts.sample_rate))])
    raise ValueError(f"unknown stage {name!r}")


# -- running ---------------------------------------------------------------------------------------

logger = logging.getLogger("mmserve.pipelines")
LIVE_CHECK_S = 0.25  # how often a running stage looks whether its chain still wants it
RETRY_S = 0.2  # a failed attempt is tried again after this
MAX_WAIT_S = 30.0  # the longest single wait for a busy engine, whatever its Retry-After
WAIT_JITTER = 0.5  # a wait is its Retry-After times 1 to 1 + this: a burst refused at once comes back spread
T = TypeVar("T")


async def while_live(store: StageStore, chain_id: str, dispatch: int | None, work: Awaitable[T]) -> T | None:
    """``work``, or None once the chain ended (its job was cancelled) or was sent again while it
    ran: then it is cancelled, and with it the stage's engine requests (an LLM decode, a TTS
    stream), not left to run to the end on a worker."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=LIVE_CHECK_S))[0]:
            if not await _live(store, chain_id, dispatch):
                return None
        return task.result()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # (done: its failure is nobody's now)


async def _live(store: StageStore, chain_id: str, dispatch: int | None) -> bool:
    try:
        return await asyncio.to_thread(store.live, chain_id, dispatch)
    except Exception as exc:  # noqa: BLE001 - a Redis hiccup: the stage goes on (``finish`` checks again)
        logger.warning("chain %s: could not check whether it still runs: %r", chain_id, exc)
        return True


async def run_stage(
    store: StageStore,
    chain_id: str,
    stage: str,
    services: Services | Callable[[ChainOptions], Services],
    where: str = "local",
    dispatch: int | None = None,
) -> None:
    """One attempt of ``stage`` (on worker ``where``, sent as ``dispatch``) with ``services`` (or
    those it makes of the chain's options); a stage whose output is stored, of a chain that ended,
    or of a stale dispatch is skipped, and one whose chain ends while it runs is stopped
    (``while_live``). The attempt counts from the start, so one that fails on a missing engine is
    bounded by ``max_attempts`` too (one that fails on its input is not retried)."""
    if store.output(chain_id, stage) is not None or not store.live(chain_id, dispatch):
        return
    if not (attempt := store.begin(chain_id, stage, where, dispatch)):
        return  # (it ended, or was sent again, just now)
    opts = store.options(chain_id)
    if stage in opts.fail_once and attempt == 1:
        raise StageFailed(f"injected failure of stage {stage!r} (attempt 1)")
    frames = store.input_frames(chain_id, stage, opts)
    engines = services if isinstance(services, Services) else services(opts)
    t0 = time.perf_counter()
    out = await while_live(store, chain_id, dispatch, stage_pipeline(stage, engines, opts).run_all(frames))
    if out is None:
        return  # (the chain ended meanwhile: nothing to store)
    if (done := next((f for f in out if isinstance(f, LLMDone) and f.error), None)) is not None:
        if done.error_type == "invalid_request_error":  # refused for its input (a prompt too long)
            raise APIError(400, done.error or "", code=done.error_code)  # (not retried)
        if done.retry_after_s is not None:  # refused under load (a full queue): the stage waits
            raise too_busy(done.error or "", done.retry_after_s)
        raise StageFailed(done.error or "")  # the engine failed the reply: retry, then fail the chain
    store.finish(chain_id, stage, out, time.perf_counter() - t0, dispatch)


class StillBusy(APIError):
    """A stage refused by a busy engine once its chain has waited ``max_wait_s`` for capacity:
    the chain fails with the route's 429."""


def after_failure(store: StageStore, chain_id: str, stage: str, exc: Exception, dispatch: int | None = None) -> float:
    """The seconds until ``stage`` is tried again after its attempt failed with ``exc``.

    A busy engine's refusal (a 429 with Retry-After) is a wait, not a failed attempt: what it
    asked (jittered, at most ``MAX_WAIT_S``), recorded in the store (``StageStore.wait``) while
    the chain has waited less than its ``max_wait_s`` in all; then ``StillBusy``. Another failure
    is tried again after ``RETRY_S`` while attempts are left, unless it was the input's. Else the
    chain is failed (unless it ended or was sent again meanwhile) and the error raised."""
    opts = store.options(chain_id)
    error: Exception = exc
    if (asked := retry_after(exc)) is not None and store.live(chain_id, dispatch):
        meta = store.meta(chain_id)
        left = opts.max_wait_s - sum(v["waited_s"] for v in store.stages_view(meta, opts).values())
        if left > 0:
            seconds = min(asked * random.uniform(1, 1 + WAIT_JITTER), MAX_WAIT_S, left)
            if not store.wait(chain_id, stage, seconds, dispatch):
                raise exc  # (it ended, or was sent again, just now: not this task's to go on with)
            logger.info(
                "chain %s: a busy engine refused its %s stage; trying again in %.1f s", chain_id, stage, seconds
            )
            return seconds
        error = StillBusy(
            429, f"{exc} (the chain waited {opts.max_wait_s:g} s for capacity)", code="rate_limit_exceeded"
        )
    elif store.attempts(chain_id, stage) < opts.max_attempts and not is_input_error(exc):
        return RETRY_S
    if store.live(chain_id, dispatch):
        store.set_status(chain_id, "failed", f"{stage}: {error}", failure_error(error))
    raise error


async def pause(seconds: float, check: Callable[[], None]) -> None:
    """Sleep ``seconds``, calling ``check()`` (which raises to stop) every ``LIVE_CHECK_S``."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        check()
        await asyncio.sleep(min(left, LIVE_CHECK_S))


async def run_local(
    store: StageStore,
    chain_id: str,
    services: Services,
    check: Callable[[], None] = lambda: None,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Every stage in-process, each tried again as ``after_failure`` says; returns ``result(...)``.
    ``check()`` runs before each attempt and while one waits (it raises to stop, e.g.
    ``JobContext.check_cancelled``); ``progress`` gets the stages done and their timings before
    each stage, after each failed attempt (a wait for capacity shows) and at the end."""
    opts = store.options(chain_id)
    stages = opts.stages()

    def report(done: int) -> None:
        progress(done, len(stages), detail=store.progress_detail(store.meta(chain_id), opts))

    for done, spec in enumerate(stages):
        report(done)
        while True:
            check()
            try:
                await run_stage(store, chain_id, spec.name, services)
                break
            except Exception as exc:
                delay = after_failure(store, chain_id, spec.name, exc)
            report(done)
            await pause(delay, check)
    report(len(stages))
    store.set_status(chain_id, "succeeded")
    return result(store, chain_id)


def celery_chain(
    app: Any, chain_id: str, opts: ChainOptions, prefix: str = "mmserve", dispatch: int = 0, keep_result: bool = True
) -> Any:
    """The Celery chain of stage tasks on ``app``, each routed to ``<prefix>.<modality>`` and
    carrying ``dispatch`` (``StageStore.redispatch``); ``.apply_async()`` returns at once. The
    last task returns ``result(...)`` (without audio). ``keep_result``: the tasks' results and
    failures are kept in the result backend (an hour) for the chain's ``AsyncResult.get()``;
    without, none is (a job has the chain's outcome; a stage that keeps none does not even keep
    its failure, and Celery then stores none for the last task either)."""
    from celery import chain

    from pipelines.tasks import TASK_NAME
    from workers.celery_app import modality_queue

    stages = opts.stages()
    sigs = [
        app.signature(
            TASK_NAME,
            args=(chain_id, s.name, prefix),
            kwargs={"last": i == len(stages) - 1, "dispatch": dispatch},
            immutable=True,
            queue=modality_queue(s.modality, prefix),
            ignore_result=not keep_result,
        )
        for i, s in enumerate(stages)
    ]
    return chain(*sigs, app=app)


def result(store: StageStore, chain_id: str) -> dict[str, Any]:
    """The chain's outputs: transcript, reply text, reply audio (float32 array at its rate), and
    the per-stage status (attempts, seconds)."""
    opts = store.options(chain_id)
    names = [s.name for s in opts.stages()]
    asr = store.output(chain_id, "asr") or []
    out: dict[str, Any] = {
        "transcript": " ".join(f.text for f in asr if isinstance(f, Transcript) and f.text),
        "segments": [asdict_light(f) for f in asr if isinstance(f, Transcript)],
        "status": store.status(chain_id),
    }
    if "llm" in names:
        llm = store.output(chain_id, "llm") or []
        done = next((f for f in llm if isinstance(f, LLMDone)), None)
        out["reply"] = done.text if done else ""
        out["usage"] = (
            {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens} if done else {}
        )
    if "tts" in names:
        chunks = [f.samples for f in store.output(chain_id, "tts") or [] if isinstance(f, TTSAudio)]
        out["audio"] = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        out["sample_rate"] = opts.sample_rate
    return out


def asdict_light(t: Transcript) -> dict[str, Any]:
    d = asdict(t)
    return {"text": d["text"], "start_ms": d["start_ms"], "end_ms": d["end_ms"]}
