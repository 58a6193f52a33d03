"""Speech pipelines plugin: ``/v1/realtime`` (voice sessions over WebSocket) and the uploaded-audio
chain (VAD → ASR → LLM → TTS) as stages on the modality queues.

Imports stay light: the models are the engines the modality plugins already serve.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, WebSocket

from gateway.auth import ws_subprotocol
from gateway.errors import error_object

__all__ = ["router"]

router = APIRouter()


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket, model: str | None = None, intent: str | None = None) -> None:
    """An OpenAI Realtime session. ``model`` picks a served LLM (unknown names, e.g. OpenAI's,
    get the default one); ASR and TTS are the served speech engines. ``intent=transcription``:
    a transcription session (``pipelines.realtime_transcription``), which needs only an ASR."""
    from pipelines.realtime import RealtimeSession
    from pipelines.services import ServiceMissing, Services

    state = ws.app.state
    engines, aliases = state.engines, getattr(state, "aliases", {})
    await ws.accept(subprotocol=ws_subprotocol(ws, "realtime"))
    if intent not in (None, "transcription"):
        await _refuse(ws, f"intent must be 'transcription' or absent, got {intent!r}", "invalid_value", "intent")
        return
    transcription = intent == "transcription"
    need = ("asr",) if transcription else ("llm",)
    name = model if model is not None and (aliases.get(model, model) in engines) else None
    try:
        try:
            services = Services.from_engines(engines, aliases=aliases, need=need, **{need[0]: name})
        except ServiceMissing:  # (a served model of another kind, as an unknown name: the default)
            services = Services.from_engines(engines, aliases=aliases, need=need)
    except ServiceMissing as exc:
        await _refuse(ws, str(exc), "model_not_found", "model")
        return
    main = services.asr if transcription else services.llm
    served = next(n for n, e in engines.items() if e is main)
    await RealtimeSession(ws, services, served, transcription).run()


async def _refuse(ws: WebSocket, message: str, code: str, param: str) -> None:
    """The session is not opened: one ``error`` event, then the socket closes."""
    err = error_object(message, "invalid_request_error", param, code)
    await ws.send_json({"event_id": "event_000000", "type": "error", "error": err})
    await ws.close(code=1008)


async def warm_up(engines: dict[str, Any]) -> None:
    """A spoken turn through the voice pipeline (``pipelines.voice.warm_up``)."""
    from pipelines.voice import warm_up as voice_turn

    await voice_turn(engines)


def _register_job_kind() -> None:
    from pipelines import jobs
    from workers.jobs import register_job_kind

    register_job_kind(
        jobs.KIND, "asr", jobs.run, validate=jobs.validate, concurrency=4, cost=jobs.cost, forget=jobs.forget
    )


_register_job_kind()
