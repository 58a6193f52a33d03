"""``/v1/realtime``: one voice session per WebSocket, speaking OpenAI's Realtime events.

The session turns client events into frames for a concurrent pipeline (resample 24 → 16 kHz,
VAD, ASR, LLM, sentences, TTS at 24 kHz) and the pipeline's output frames into server events.
Barge-in: the VAD's ``Interrupt`` cancels the LLM and TTS work in flight (the engine requests are
aborted) and the replies not started yet (speech that ended before is heard but not answered:
the next turn's reply answers both; a response.create not started ends "cancelled"), and the
assistant item is truncated to what the client has played so far, estimated from the audio
sent and a real-time playback clock (or given by ``conversation.item.truncate``).

Speculation: with server VAD, a pause of ``turn_detection.speculative_silence_ms`` (an mmserve
extension; default ``VADConfig.eager_ms``, 60 ms; 0: off) starts the turn's ASR, LLM and first
sentence's TTS before ``silence_duration_ms`` commits the turn (``pipelines.speculation``); the
client sees the same events as without it, only sooner. With semantic VAD (``semantic_vad``,
``pipelines.turns``) that pause's transcript is also scored by the LLM: a likely end of the
user's message ends the turn after ``VADConfig.complete_ms`` of silence, any other pause waits
up to the eagerness's longest silence.

Dialects, by OpenAI's rule: a client that says it speaks beta (``_says_beta``) gets the beta
event protocol (and ``conversation.created``), any other OpenAI's GA one from its first event
(``pipelines.realtime_ga`` translates at the edge); a beta client's ``session.update`` with
``session.type == "realtime"`` switches it to GA.

A transcription session (``?intent=transcription``, ``pipelines.realtime_transcription``) runs
the pipeline up to the ASR: the user's turns are transcribed, and nothing replies.

Here: the session (``RealtimeSession``: its state, its settings and ``session.update``, the
WebSocket's reader and the pipeline's writer). Its other client events are handled in
``pipelines.realtime_client``; an event and what it carries are checked in ``realtime_events``,
``realtime_config``, ``realtime_fields`` and ``realtime_tools``; the pipeline's output becomes
server events in ``realtime_output`` (the user's side) and ``realtime_replies`` (the replies').
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import WebSocket, WebSocketDisconnect

from engine.foreground import INTERACTIVE
from gateway.errors import error_object
from modalities.llm.tools import declared
from pipelines import realtime_ga
from pipelines import realtime_transcription as transcribing
from pipelines.conversation import Conversation
from pipelines.frames import End, Frame, ResponseRequest
from pipelines.realtime_audio import FORMATS
from pipelines.realtime_client import ClientEvents
from pipelines.realtime_config import SessionConfig
from pipelines.realtime_events import EventError, parse_event
from pipelines.realtime_fields import check_language, check_voice, reply_tokens
from pipelines.realtime_idle import IdleTimeout
from pipelines.realtime_replies import ReplyEvents
from pipelines.realtime_tools import shown_tools, tools_grammar
from pipelines.reply import LLMOptions
from pipelines.services import Services
from pipelines.speech import ASROptions, TTSOptions
from pipelines.turns import EAGERNESS
from pipelines.vad import VADConfig
from pipelines.voice import transcription_pipeline, voice_pipeline

if TYPE_CHECKING:
    from gateway.ratelimit import Charge

logger = logging.getLogger("mmserve.realtime")
_sessions = itertools.count(1)
# The client events handled (``_ev_<type with "." as "_">``: session.update here,
# transcription_session.update in realtime_transcription, the others in realtime_client).
CLIENT_EVENTS = frozenset(
    (
        "session.update",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "input_audio_buffer.clear",
        "conversation.item.create",
        "conversation.item.retrieve",
        "conversation.item.delete",
        "conversation.item.truncate",
        "response.create",
        "response.cancel",
        "transcription_session.update",
    )
)
INBOX_FRAMES = 256  # client events queued for the pipeline; beyond this the WebSocket reader waits


def _says_beta(ws: WebSocket) -> bool:
    """Whether the client asks for the beta protocol: the ``OpenAI-Beta: realtime=v1`` header
    (the SDK's beta client), or the subprotocol ``openai-beta.realtime-v1`` (a browser's)."""
    header = "realtime=v1" in (part.strip() for part in ws.headers.get("openai-beta", "").lower().split(","))
    return header or "openai-beta.realtime-v1" in ws.scope.get("subprotocols", [])


class RealtimeSession(ClientEvents, IdleTimeout, ReplyEvents, transcribing.TranscriptionEvents):
    """One session: its client events become frames for the voice pipeline (``ClientEvents``
    handles those on the conversation; ``ServerEvents`` and ``ReplyEvents`` turn the pipeline's
    output back into events; ``IdleTimeout`` adds the idle timeout)."""

    def __init__(self, ws: WebSocket, services: Services, model: str, transcription: bool = False) -> None:
        self.ws, self.services = ws, services
        self.transcription = transcription  # a transcription session (no replies): realtime_transcription
        number = next(_sessions)
        self.id, self.conversation_id = f"sess_{number:06d}", f"conv_{number:06d}"
        speaks = services.tts is not None and not transcription
        voices = getattr(services.tts, "voices", None) if speaks else None  # (the first is the default)
        self.default_voice = voices[0] if voices else None  # shown for "no voice chosen" (null)
        self.config = SessionConfig(
            model, modalities=["text", "audio"] if speaks else ["text"], voice=self.default_voice
        )
        self.conv = Conversation(self.config.instructions)
        self.vad_config = VADConfig()
        # A live turn goes ahead of chat requests; the tenant pays for it as for a chat request.
        self.llm_options = LLMOptions(priority=INTERACTIVE, budget=functools.partial(self._charge, "llm_tokens"))
        self.tts_options = TTSOptions(priority=INTERACTIVE)  # its first pieces go first
        self.asr_options = ASROptions(priority=INTERACTIVE)  # its encoder passes go first
        # Whether ``appended_ms`` is the buffer's fill: with manual turns since the buffer was
        # empty (server VAD trims and takes the buffer unseen from here).
        self.fill_known, self.appended_ms = True, 0.0
        self.speaking, self.idle_from, self._idle, self._idle_since = False, None, None, None  # (realtime_idle)
        self._apply_config()
        self.inbox: asyncio.Queue[Frame] = asyncio.Queue(INBOX_FRAMES)  # a full inbox stalls the reader
        self.pipeline = (
            transcription_pipeline(services, self.conv, self.vad_config, self.asr_options, self.llm_options)
            if transcription
            else voice_pipeline(
                services, self.conv, self.vad_config, self.llm_options, self.tts_options, self.asr_options
            )
        )
        self.reply = None
        self.in_band = None
        self.replies = {}
        self.unheard = set()
        self.failed = set()
        self.turn_ended = None
        self.metrics = getattr(ws.app.state, "metrics", None)
        self.requested: ResponseRequest | None = None
        self.expected = None
        self.cancel_pending = False
        self._requests = itertools.count(1)
        self.withdrawn: dict[int, float] = {}  # requests cancelled before they started, when made
        self.silenced: set[str] = set()  # their replies, started: stopped unseen
        self._event_ids = itertools.count(1)
        self._send_lock = asyncio.Lock()
        self.ga = False  # the GA dialect (``run`` sets it for the client)

    # -- configuration ------------------------------------------------------------------------
    def _apply_config(self) -> None:
        c = self.config
        td = c.turn_detection
        self.vad_config.server_vad = td is not None
        self.vad_config.noise_reduction = (c.input_audio_noise_reduction or {}).get("type")
        self.fill_known = td is None and (self.fill_known or self.appended_ms == 0)
        eagerness = EAGERNESS[td["eagerness"]] if td is not None and td["type"] == "semantic_vad" else None
        self.vad_config.semantic = eagerness is not None
        self.llm_options.end_of_turn_p = None if eagerness is None else eagerness.end_p
        if td is not None:
            self.vad_config.threshold = float(td.get("threshold", VADConfig.threshold))
            self.vad_config.prefix_padding_ms = int(td.get("prefix_padding_ms", VADConfig.prefix_padding_ms))
            wait = eagerness.wait_ms if eagerness is not None else int(td["silence_duration_ms"])
            self.vad_config.silence_duration_ms = wait
            replies = not self.transcription
            self.vad_config.create_response = replies and bool(td.get("create_response", True))
            self.vad_config.interrupt_response = replies and bool(td.get("interrupt_response", True))
            self.vad_config.eager_ms = int(td.get("speculative_silence_ms", VADConfig.eager_ms))
            self.vad_config.floor_dbfs = float(td.get("silence_floor_dbfs", VADConfig.floor_dbfs))
        self.llm_options.temperature = c.temperature
        self.llm_options.max_tokens = reply_tokens(c.max_response_output_tokens)
        self.tts_options.enabled = "audio" in c.modalities and self.services.tts is not None
        self.tts_options.voice, self.tts_options.speed = c.voice, c.speed
        self.conv.tools = shown_tools(c)
        self.llm_options.tool_calls = None if self.conv.tools is None else declared(self.conv.tools)
        self.llm_options.grammar = tools_grammar(getattr(self.services.llm, "tokenizer", None), c)
        heard = c.input_audio_transcription or {}
        self.asr_options.language, self.asr_options.prompt = heard.get("language"), heard.get("prompt")
        self.asr_options.logprobs = c.logprobs
        self.tts_options.sample_rate = FORMATS[c.output_audio_format].rate
        self.conv.instructions = c.instructions

    # -- main loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        if self.metrics is not None:
            self.metrics.inc("realtime_sessions_total", help="/v1/realtime sessions opened", model=self.config.model)
        beta = _says_beta(self.ws)
        self.ga = not beta
        if not self.transcription:
            await self.send("session.created", session=self.config.to_dict(self.id))
            if beta:  # (GA has no such event)
                conversation = {"id": self.conversation_id, "object": "realtime.conversation"}
                await self.send("conversation.created", conversation=conversation)
        elif beta:
            await self.send("transcription_session.created", session=transcribing.beta_object(self.config, self.id))
        else:  # (the GA shape: a beta session.created has no transcription session)
            await self.send("session.created", session=transcribing.ga_object(self.config, self.id))
        writer = asyncio.create_task(self._write())
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("text") is None:  # a binary frame: the protocol is JSON text
                    await self.send_error("events are JSON text frames, not binary", "invalid_json", event_id=None)
                    continue
                await self._handle(message["text"])
        except (WebSocketDisconnect, RuntimeError):
            pass  # client gone
        finally:
            self._stop_idle()
            writer.cancel()  # closes the pipeline: engine requests in flight are aborted
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer

    async def _source(self) -> AsyncIterator[Frame]:
        while True:
            frame = await self.inbox.get()
            yield frame
            if isinstance(frame, End):
                return

    async def _write(self) -> None:
        try:
            # (closed at once when the client goes: the pipeline's stages and engine requests stop
            # then, not whenever the generator is collected)
            async with contextlib.aclosing(self.pipeline.stream(self._source())) as frames:
                async for frame in frames:
                    await self._on_frame(frame)
        except (WebSocketDisconnect, RuntimeError):
            pass  # client gone
        except Exception as exc:  # a bug here must end the session visibly, not hang it
            logger.exception("realtime session %s failed", self.id)
            with contextlib.suppress(Exception):
                await self.send("error", error=error_object(repr(exc), "server_error"))
                await self.ws.close(code=1011)

    # -- client events ------------------------------------------------------------------------
    async def _handle(self, raw: str) -> None:
        event_id = None
        try:
            event = parse_event(raw, CLIENT_EVENTS)
            event_id = event.get("event_id")
            if self.ga and event["type"] in realtime_ga.BETA_EVENTS:
                raise realtime_ga.beta_event(event["type"])
            if self.transcription and event["type"] in transcribing.REFUSED:
                raise EventError(f"a transcription session takes no {event['type']}", "unsupported", "type")
            await getattr(self, "_ev_" + event["type"].replace(".", "_"))(event)
        except EventError as exc:
            await self.send_error(str(exc), exc.code, exc.param, event_id=event_id or exc.event_id)
        except (WebSocketDisconnect, RuntimeError):
            raise  # the client left (the reader ends the session)
        except Exception as exc:  # noqa: BLE001 - a bug in one handler must not end the session
            logger.exception("realtime session %s failed on an event", self.id)
            err = error_object(f"{type(exc).__name__}: {exc}", "server_error")
            await self.send("error", error={**err, "event_id": event_id})

    async def _ev_session_update(self, event: dict[str, Any]) -> None:
        patch = event.get("session", {})
        if self.transcription or (isinstance(patch, dict) and patch.get("type") == "transcription"):
            await self._ga_transcription_update(patch)
            return
        self.ga = realtime_ga.is_ga(patch) or self.ga  # the client speaks GA from here on
        try:
            if not self.ga and isinstance(patch, dict):
                self.config.check_beta_fields(patch)
            patch = realtime_ga.session_patch(patch) if self.ga and isinstance(patch, dict) else patch
            check_voice(self.services.tts, patch)
            staged = dataclasses.replace(self.config)
            staged.update(patch)  # the patch's shape first, then what the models can do
            staged.voice = staged.voice or self.default_voice
            if "input_audio_transcription" in patch:
                check_language(self.services.asr, staged.input_audio_transcription)
            if (staged.turn_detection or {}).get("idle_timeout_ms") and self.services.asr is None:
                raise EventError(
                    "this server has no speech recognition model: an idle timeout commits audio to transcribe",
                    code="unsupported",
                    param="session.turn_detection.idle_timeout_ms",
                )
            tools_grammar(getattr(self.services.llm, "tokenizer", None), staged)
            self.config = staged
        except EventError as exc:
            if self.ga:
                raise realtime_ga.ga_error(exc) from None
            raise
        if "audio" in self.config.modalities and self.services.tts is None:
            self.config.modalities = ["text"]
        self._apply_config()
        self._restart_idle()  # (a new idle_timeout_ms counts from the same moment)
        await self.send("session.updated", session=self.config.to_dict(self.id))

    # -- the tenant's budget ------------------------------------------------------------------
    async def _charge(self, unit: str, amount: float) -> Charge:
        """``amount`` of ``unit`` from the budget of the session's tenant (``gateway.ratelimit.charge``:
        ``APIError`` 429 over it): the input audio's ``audio_seconds``, the replies' ``llm_tokens``."""
        from gateway.ratelimit import charge

        return await charge(self.ws, unit, amount)
