"""The ``audio.pipeline`` job kind: ``POST /v1/jobs {"kind": "audio.pipeline", "params": {...}}``
with ``params.file_id`` an audio file uploaded through ``POST /v1/files``.

The job id comes back at once (202). Under local dispatch the stages run in the gateway process;
under Celery dispatch the job runs on an ASR worker, which sends the stage chain (VAD and ASR on
``mmserve.asr``, LLM on ``mmserve.llm``, TTS on ``mmserve.tts``) and follows it in the stage store
(``pipelines.follower``: a stage lost with its worker is sent again).
The job runs on the worker's engine loop, so it polls the chain with the worker's async Redis
client and does its blocking calls on threads; the Celery app and the stage store
(``pipelines.stage_store.shared_store``) are made once per process.
The job's result: transcript, segments, reply text, usage, per-stage attempts and seconds, and
``reply.wav`` in the result store.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # imported lazily at run time: the plugin stays light
    from pipelines.stage_store import ChainOptions
    from workers.jobs.runner import JobsConfig

KIND = "audio.pipeline"


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
        from pipelines.stage_store import ChainOptions

        fields = self.model_dump(exclude={"file_id"})
        return ChainOptions(**fields)


def validate(params: dict[str, Any], engines: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """Params are checked in the gateway, before any compute (a 400 naming the field): the fields,
    and the ``llm``, ``asr``, ``tts`` models and ``voice`` among the engines this gateway has of
    that modality (under celery the proxies of what the workers serve; with none, the workers
    judge), the TTS as the speech route resolves it. The stored params name the served models
    and voice: a worker knows no aliases."""
    from gateway.errors import APIError
    from modalities.tts.registry import resolve_tts
    from pipelines.services import ServiceMissing, has_modality, pick
    from workers.jobs import ParamError, parse_params

    p = parse_params(PipelineParams, params)
    if p.fail_once and os.environ.get("MMSERVE_FAULT_INJECTION") != "1":
        raise ParamError("fail_once", "fault injection is off on this server (MMSERVE_FAULT_INJECTION=1 turns it on)")
    if p.speak and not p.respond and "speak" in p.model_fields_set:
        raise ParamError("speak", "speak needs respond: the TTS stage speaks the LLM's reply")
    p.speak = p.speak and p.respond  # (stored as run: the params shown can be sent again)
    for modality in ("asr", "llm"):
        if (name := getattr(p, modality)) is not None and has_modality(engines, modality):
            served = aliases.get(name, name)
            try:
                pick(engines, modality, served)
            except ServiceMissing:
                raise ParamError(modality, f"no {modality} model named {name!r} is served") from None
            setattr(p, modality, served)
    if has_modality(engines, "tts"):
        try:
            p.tts, _, p.voice = resolve_tts(engines, p.tts, p.voice, aliases)
        except APIError as exc:
            raise ParamError("voice" if exc.param == "voice" else "tts", exc.message) from None
    return p.model_dump()


def cost(params: dict[str, Any], engines: dict[str, Any], file_bytes: int = 0) -> tuple[str, float]:
    """``audio_seconds`` of the input, estimated from its size as ``audio.transcription`` does (the
    LLM and TTS stages it triggers are bounded by ``max_tokens``)."""
    from modalities.asr.jobs import cost as audio_cost

    return audio_cost(params, engines, file_bytes)


def forget(job_id: str, cfg: JobsConfig) -> None:
    """A deleted job's chain goes with it: under celery its stage store in Redis (the input audio,
    the stages' outputs, its meta; the workers' ``--prefix`` is the gateway's). A local chain
    lived in the job's memory only."""
    from pipelines.stage_store import shared_store

    if cfg.dispatch == "celery":
        shared_store(cfg.redis_url, cfg.queue_prefix).delete(job_id)


async def run(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    from modalities.audio import ASR_RATE, MAX_AUDIO_S, decode_audio, encode_audio
    from pipelines.chain import result, run_local
    from pipelines.follower import ChainFollower
    from pipelines.services import Services
    from pipelines.stage_store import StageStore, shared_store
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
        await ChainFollower(rt, store, chain_id, opts, ctx.progress).follow(ctx.check_cancelled)
    out = await asyncio.to_thread(result, store, chain_id)
    files = {}
    audio_out, rate = out.pop("audio", None), out.pop("sample_rate", None)  # (a silent input has no reply audio)
    if audio_out is not None and audio_out.size:
        wav = await asyncio.to_thread(encode_audio, audio_out, rate, "wav")
        files["audio"] = await asyncio.to_thread(ctx.store.put, ctx.job_id, "reply.wav", wav, "audio/wav")
    status = out.pop("status")
    out["stages"] = status["stages"]
    files["result"] = await asyncio.to_thread(
        ctx.store.put, ctx.job_id, "result.json", json.dumps(out).encode(), "application/json"
    )
    out["files"] = files
    return out
