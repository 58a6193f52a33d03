"""The ``audio.pipeline`` job kind: ``POST /v1/jobs {"kind": "audio.pipeline", "params": {...}}``
with ``params.file_id`` an audio file uploaded through ``POST /v1/files``.

The job id comes back at once (202). Under local dispatch the stages run in the gateway process;
under Celery dispatch the job runs on an ASR worker, which sends the stage chain (VAD and ASR on
``mmserve.asr``, LLM on ``mmserve.llm``, TTS on ``mmserve.tts``) and follows it in the stage store.
The job runs on the worker's engine loop, so it polls the chain with the worker's async Redis
client and does its blocking calls on threads; the Celery app and the stage store
(``pipelines.chain.shared_store``) are made once per process.
The job's result: transcript, segments, reply text, usage, per-stage attempts and seconds, and
``reply.wav`` in the result store.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # imported lazily at run time: the plugin stays light
    from pipelines.chain import ChainOptions, StageStore

KIND = "audio.pipeline"
logger = logging.getLogger("mmserve.pipelines")


class PipelineParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file_id: str = Field(min_length=1, max_length=300)
    respond: bool = True
    speak: bool = True
    instructions: str | None = Field(default=None, max_length=4000)
    max_tokens: int = Field(default=64, ge=1, le=1024)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    voice: str | None = None
    llm: str | None = None
    asr: str | None = None
    tts: str | None = None
    fail_once: list[Literal["vad", "asr", "llm", "tts"]] = Field(default_factory=list)

    def options(self) -> ChainOptions:
        from pipelines.chain import ChainOptions

        fields = self.model_dump(exclude={"file_id"})
        return ChainOptions(**fields)


def validate(params: dict[str, Any], engines: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """Params are checked in the gateway, before any compute (a 400 naming the field): the fields,
    and the ``llm``, ``asr``, ``tts`` models and the ``voice`` named, among the engines this
    gateway has of that modality (under celery the proxies of what the workers serve; with none,
    the workers judge). The stored params name the served models: a worker knows no aliases."""
    from modalities.tts.registry import unknown_voice
    from pipelines.services import ServiceMissing, has_modality, pick
    from workers.jobs import ParamError, parse_params

    p = parse_params(PipelineParams, params)
    for modality in ("llm", "asr", "tts"):
        name = getattr(p, modality)
        if name is not None and has_modality(engines, modality):
            served = aliases.get(name, name)
            try:
                pick(engines, modality, served)
            except ServiceMissing as exc:
                raise ParamError(modality, str(exc)) from None
            setattr(p, modality, served)
    if p.voice is not None and has_modality(engines, "tts"):
        if error := unknown_voice(p.voice, pick(engines, "tts", p.tts).voices):
            raise ParamError("voice", error)
    return p.model_dump()


def cost(params: dict[str, Any], engines: dict[str, Any], file_bytes: int = 0) -> tuple[str, float]:
    """``audio_seconds`` of the input, estimated from its size as ``audio.transcription`` does (the
    LLM and TTS stages it triggers are bounded by ``max_tokens``)."""
    from modalities.asr.jobs import cost as audio_cost

    return audio_cost(params, engines, file_bytes)


@functools.cache
def _celery_app(redis_url: str) -> Any:
    """One Celery app per process (and Redis URL) sends every job's chain."""
    from workers.celery_app import make_celery

    return make_celery(redis_url)


LIVENESS_CHECK_S = 1.0  # how often a followed chain's running stage is checked for a lost worker


def _running(meta: dict[bytes, bytes]) -> tuple[str, str] | None:
    """``(stage, worker)`` of the chain's stage under way, from its ``meta`` hash (None: none is)."""
    status = meta.get(b"status", b"").decode()
    if not status.startswith("running:"):
        return None
    stage = status.removeprefix("running:")
    where = meta.get(f"{stage}.where".encode())
    return None if where is None or f"{stage}.finished".encode() in meta else (stage, where.decode())


async def _lost(rt: Any, meta: dict[bytes, bytes]) -> tuple[str, str] | None:
    """``(stage, worker)`` of the stage under way if its worker's heartbeat is gone (it expires
    3 periods after the last one)."""
    from workers.wire import Keys

    running = _running(meta)
    if running is None or await rt.redis.exists(Keys(rt.prefix).worker(running[1])):
        return None
    return running


async def _follow(
    rt: Any,
    store: StageStore,
    chain_id: str,
    opts: ChainOptions,
    check_cancelled: Callable[[], None],
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> None:
    """Send the chain and wait for its end, reporting ``progress(stages done, stages)`` (checked
    every ``LIVENESS_CHECK_S``); raises if it failed, and marks it cancelled when the job stops. A retried job takes its chain over: sent again (done stages are skipped) unless it
    ended or a stage is under way on a live worker. A stage whose worker's heartbeat is gone is
    sent again with the rest of the chain (Redis would give its task back only after the
    visibility timeout, an hour), the lost tasks made no-ops; the lost attempt counts, and one
    past ``max_attempts`` fails the chain."""
    key = store.meta_key(chain_id)
    meta = await rt.redis.hgetall(key)
    if meta.get(b"status") not in (b"succeeded", b"failed") and (_running(meta) is None or await _lost(rt, meta)):
        await _send(rt, store, chain_id, opts)
    total = len(opts.stages())
    done = store.stages_done(meta, opts)
    progress(done, total)
    next_check = time.monotonic() + LIVENESS_CHECK_S
    try:  # the worker's async client: polling never blocks the engine loop
        while (raw := await rt.redis.hget(key, "status")) is not None and raw not in (b"succeeded", b"failed"):
            check_cancelled()
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + LIVENESS_CHECK_S
                meta = await rt.redis.hgetall(key)
                if (now_done := store.stages_done(meta, opts)) != done:
                    done = now_done
                    progress(done, total)
                if lost := await _lost(rt, meta):
                    await _send_again(rt, store, chain_id, opts, meta, *lost)
            await asyncio.sleep(0.05)
    except BaseException:
        store.set_status(chain_id, "cancelled")  # the stages still queued become no-ops
        raise
    if raw != b"succeeded":
        status = await asyncio.to_thread(store.status, chain_id)
        raise RuntimeError(f"pipeline failed: {status and status['error']}")
    progress(total, total)


async def _send(rt: Any, store: StageStore, chain_id: str, opts: ChainOptions) -> None:
    """Send the chain's stages as a new dispatch (the tasks of earlier ones become no-ops)."""
    from pipelines.chain import celery_chain

    dispatch = await asyncio.to_thread(store.redispatch, chain_id)
    chain = celery_chain(_celery_app(rt.redis_url), chain_id, opts, rt.prefix, dispatch)
    await asyncio.to_thread(chain.apply_async)


async def _send_again(
    rt: Any, store: StageStore, chain_id: str, opts: ChainOptions, meta: dict[bytes, bytes], stage: str, worker: str
) -> None:
    """The chain after ``stage``'s ``worker`` was lost: sent again, or failed if that was the
    stage's last attempt."""
    if int(meta.get(f"{stage}.attempts".encode(), 0)) >= opts.max_attempts:
        await asyncio.to_thread(store.set_status, chain_id, "failed", f"{stage}: worker {worker} was lost")
        return
    logger.warning("chain %s: worker %s of stage %s was lost; sending the chain again", chain_id, worker, stage)
    await _send(rt, store, chain_id, opts)


async def run(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    from modalities.audio import ASR_RATE, MAX_AUDIO_S, decode_audio, encode_audio
    from pipelines.chain import StageStore, result, run_local, shared_store
    from pipelines.services import Services
    from workers import runtime
    from workers.jobs.store import parse_file_id

    p = PipelineParams(**params)
    opts = p.options()
    data, _ = await asyncio.to_thread(ctx.store.get, *parse_file_id(p.file_id))
    audio = (await asyncio.to_thread(decode_audio, data, ASR_RATE, MAX_AUDIO_S)).samples
    rt = runtime.current()
    chain_id = ctx.job_id
    if rt is None:  # local dispatch: this process has the engines
        store = StageStore(None)
        store.create(chain_id, audio, opts)
        need = tuple(s.needs[0] for s in opts.stages() if s.needs)
        services = Services.from_engines(ctx.engines, opts.llm, opts.asr, opts.tts, ctx.aliases, need=need)
        await run_local(store, chain_id, services, ctx.check_cancelled, ctx.progress)
    else:
        store = shared_store(rt.redis_url, rt.prefix)
        if await asyncio.to_thread(store.status, chain_id) is None:  # a retried job resumes its chain
            await asyncio.to_thread(store.create, chain_id, audio, opts)
        await _follow(rt, store, chain_id, opts, ctx.check_cancelled, ctx.progress)
    out = await asyncio.to_thread(result, store, chain_id)
    files = {}
    audio_out = out.pop("audio", None)
    if audio_out is not None and audio_out.size:
        wav = await asyncio.to_thread(encode_audio, audio_out, out.pop("sample_rate"), "wav")
        files["audio"] = await asyncio.to_thread(ctx.store.put, ctx.job_id, "reply.wav", wav, "audio/wav")
    status = out.pop("status")
    out["stages"] = status["stages"]
    files["result"] = await asyncio.to_thread(
        ctx.store.put, ctx.job_id, "result.json", json.dumps(out).encode(), "application/json"
    )
    out["files"] = files
    return out
