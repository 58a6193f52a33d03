"""The ``audio.pipeline`` job kind: ``POST /v1/jobs {"kind": "audio.pipeline", "params": {...}}``
with ``params.file_id`` an audio file uploaded through ``POST /v1/files``.

The job id comes back at once (202). Under local dispatch the stages run in the gateway process;
under Celery dispatch the job runs on an ASR worker, which sends the stage chain (VAD and ASR on
``mmserve.asr``, LLM on ``mmserve.llm``, TTS on ``mmserve.tts``) and follows it in the stage store.
The job's result: transcript, segments, reply text, usage, per-stage attempts and seconds, and
``reply.wav`` in the result store.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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

    def options(self) -> Any:
        from pipelines.chain import ChainOptions

        fields = self.model_dump(exclude={"file_id"})
        return ChainOptions(**fields)


def validate(params: dict[str, Any], engines: dict[str, Any]) -> dict[str, Any]:
    """Params are checked in the gateway, before any compute (ValueError -> 400)."""
    try:
        return PipelineParams(**params).model_dump()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"params.{where}: {first['msg']}") from exc


def cost(params: dict[str, Any], engines: dict[str, Any], file_bytes: int = 0) -> tuple[str, float]:
    """``audio_seconds`` of the input, estimated from its size as ``audio.transcription`` does (the
    LLM and TTS stages it triggers are bounded by ``max_tokens``)."""
    from modalities.asr.jobs import cost as audio_cost

    return audio_cost(params, engines, file_bytes)


async def run(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    from modalities.audio import decode_audio, encode_audio
    from pipelines.chain import StageStore, celery_chain, result, run_local
    from pipelines.services import Services
    from workers import runtime
    from workers.jobs.store import parse_file_id

    p = PipelineParams(**params)
    opts = p.options()
    data, _ = await asyncio.to_thread(ctx.store.get, *parse_file_id(p.file_id))
    audio = (await asyncio.to_thread(decode_audio, data)).samples
    rt = runtime.current()
    chain_id = ctx.job_id
    if rt is None:  # local dispatch: this process has the engines
        store = StageStore(None)
        store.create(chain_id, audio, opts)
        need = tuple(s.needs[0] for s in opts.stages() if s.needs)
        services = Services.from_engines(ctx.engines, opts.llm, opts.asr, opts.tts, ctx.aliases, need=need)
        await run_local(store, chain_id, services, ctx.check_cancelled)
    else:
        from workers.celery_app import make_celery

        store = StageStore(rt.redis_url, rt.prefix)
        if store.status(chain_id) is None:  # a retried job resumes its chain: done stages are skipped
            store.create(chain_id, audio, opts)
        celery_chain(make_celery(rt.redis_url), chain_id, opts, rt.prefix).apply_async()
        try:
            while (status := store.status(chain_id)) is not None and status["status"] not in ("succeeded", "failed"):
                ctx.check_cancelled()
                await asyncio.sleep(0.05)
        except BaseException:
            store.set_status(chain_id, "cancelled")  # the stages still queued become no-ops
            raise
        if status is None or status["status"] == "failed":
            raise RuntimeError(f"pipeline failed: {status and status['error']}")
    out = result(store, chain_id)
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
