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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import WebSocket, WebSocketDisconnect

from engine.foreground import INTERACTIVE
from gateway.errors import error_object
from modalities.audio import ASR_RATE
from modalities.llm.tools import declared
from pipelines import realtime_ga
from pipelines import realtime_transcription as transcribing
from pipelines.conversation import Conversation
from pipelines.frames import (
    AudioFrame,
    ClearFrame,
    CommitFrame,
    End,
    Frame,
    ResponseRequest,
)
from pipelines.realtime_audio import FORMATS
from pipelines.realtime_config import SessionConfig
from pipelines.realtime_events import EventError, decode_append, item_id_of, parse_event
from pipelines.realtime_fields import check_language, check_voice, reply_tokens
from pipelines.realtime_idle import IdleTimeout
from pipelines.realtime_items import client_item, content_part, function_item_event, item_event, truncation
from pipelines.realtime_replies import ReplyEvents
from pipelines.realtime_response import response_request
from pipelines.realtime_tools import shown_tools, tools_grammar
from pipelines.reply import LLMOptions
from pipelines.services import Services
from pipelines.speech import ASROptions, TTSOptions
from pipelines.turns import EAGERNESS
from pipelines.vad import MAX_BUFFER_SAMPLES, VADConfig
from pipelines.voice import transcription_pipeline, voice_pipeline

if TYPE_CHECKING:
    from gateway.ratelimit import Charge

logger = logging.getLogger("mmserve.realtime")
MAX_BUFFER_S = MAX_BUFFER_SAMPLES / ASR_RATE
_sessions = itertools.count(1)
# The client events handled (``_ev_<type with "." as "_">``).
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
SERVER_ID = re.compile(r"(item|item_in|item_cm|resp)_\d{6}")  # the ids the server makes
INBOX_FRAMES = 256  # client events queued for the pipeline; beyond this the WebSocket reader waits


def _says_beta(ws: WebSocket) -> bool:
    """Whether the client asks for the beta protocol: the ``OpenAI-Beta: realtime=v1`` header
    (the SDK's beta client), or the subprotocol ``openai-beta.realtime-v1`` (a browser's)."""
    header = "realtime=v1" in (part.strip() for part in ws.headers.get("openai-beta", "").lower().split(","))
    return header or "openai-beta.realtime-v1" in ws.scope.get("subprotocols", [])


class RealtimeSession(IdleTimeout, ReplyEvents, transcribing.TranscriptionEvents):
    """One session: its client events become frames for the voice pipeline (``ServerEvents``
    and ``ReplyEvents`` turn the pipeline's output back into events; ``IdleTimeout`` adds the
    idle timeout)."""

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

    async def _ev_input_audio_buffer_append(self, event: dict[str, Any]) -> None:
        fmt = FORMATS[self.config.input_audio_format]
        samples = decode_append(event.get("audio"), fmt)
        if self.services.asr is None:
            raise EventError("this server has no speech recognition model; send text items", code="unsupported")
        seconds = len(samples) / fmt.rate
        if seconds > MAX_BUFFER_S:  # (15 MiB of 8 kHz G.711 is 33 minutes)
            raise EventError(
                f"audio chunk is too long: {seconds:.0f} s, the buffer holds {MAX_BUFFER_S:.0f} s", param="audio"
            )
        if self.fill_known and self.appended_ms / 1000 + seconds > MAX_BUFFER_S:
            # Manual turns buffer every chunk until a commit: refused here, before it is charged
            # and before a commit could count it (the VAD's own check runs later, on its task).
            raise EventError(
                f"the input audio buffer is full ({MAX_BUFFER_S:.0f} s of audio max); this audio was dropped",
                code="input_audio_buffer_full",
            )
        if len(samples):
            charged = await self._charge_audio(seconds)
            self.appended_ms += seconds * 1000
            await self.inbox.put(AudioFrame(samples, fmt.rate, charged.refund, event.get("event_id")))

    async def _charge(self, unit: str, amount: float) -> Charge:
        """``amount`` of ``unit`` from the budget of the session's tenant (``gateway.ratelimit.charge``:
        ``APIError`` 429 over it): the input audio's ``audio_seconds``, the replies' ``llm_tokens``."""
        from gateway.ratelimit import charge

        return await charge(self.ws, unit, amount)

    async def _charge_audio(self, seconds: float) -> Charge:
        """The tenant's ``audio_seconds`` budget pays for every second of input audio; over the
        limit, this chunk is dropped with an error event (the session stays usable)."""
        from gateway.errors import APIError

        try:
            return await self._charge("audio_seconds", seconds)
        except APIError as exc:
            retry = exc.headers.get("Retry-After") if exc.headers else None
            suffix = f" (retry after {retry}s)" if retry else ""
            raise EventError(
                f"{exc.message}{suffix}; this audio was dropped", code=exc.code or "rate_limit_exceeded"
            ) from exc

    async def _ev_input_audio_buffer_commit(self, event: dict[str, Any]) -> None:
        if self.appended_ms < 100:
            raise EventError(
                f"buffer too small: expected at least 100ms of audio, got {self.appended_ms:.0f}ms",
                code="input_audio_buffer_commit_empty",
            )
        self.appended_ms, self.fill_known = 0.0, not self.vad_config.server_vad
        item_id = self.conv.new_id("item_cm")  # (the VAD's turns are item_in_...)
        await self._user_item_created(item_id)  # before its frame goes: an ASR may fail it at once
        await self.inbox.put(CommitFrame(item_id=item_id))

    async def _ev_input_audio_buffer_clear(self, event: dict[str, Any]) -> None:
        self.appended_ms, self.fill_known = 0.0, not self.vad_config.server_vad
        await self.inbox.put(ClearFrame())
        await self.send("input_audio_buffer.cleared")

    async def _ev_conversation_item_create(self, event: dict[str, Any]) -> None:
        """A text message, a function call or a function's output, at the end or after
        ``previous_item_id`` ("root": first), with the client's ``item.id`` if it gives one."""
        role, text, fields = client_item(event.get("item"))
        item_id, after = event["item"].get("id"), event.get("previous_item_id")
        if item_id is not None and (not isinstance(item_id, str) or not 0 < len(item_id) <= 64):
            raise EventError("item.id must be a string of 1 to 64 characters", param="item.id")
        if item_id is not None and SERVER_ID.fullmatch(item_id):
            raise EventError(f"item ids like {item_id!r} are the server's; choose another", param="item.id")
        if item_id is not None and (self.conv.get(item_id) or item_id in self.unheard | self.failed):
            raise EventError(f"an item {item_id!r} already exists", param="item.id")
        if after is not None and not isinstance(after, str):
            raise EventError("previous_item_id must be a string", param="previous_item_id")
        try:
            item = self.conv.add(role, text, item_id, after=after, client=True, **fields)
        except KeyError:
            raise EventError(f"no item {after!r} in the conversation", "item_not_found", "previous_item_id") from None
        await self.send(
            "conversation.item.created",
            previous_item_id=self._previous(item.id),
            item=function_item_event(item) if fields else item_event(item.id, role, [content_part(role, False, text)]),
        )

    async def _ev_conversation_item_retrieve(self, event: dict[str, Any]) -> None:
        item_id = item_id_of(event)
        if (item := self.conv.get(item_id)) is None:
            raise EventError(f"no item {item_id!r} in the conversation", code="item_not_found", param="item_id")
        # The active reply's items as the client has them: the reply stage writes ahead of the events.
        r = self.reply if self.reply is not None and not self.reply.done else None
        if item.kind != "message":
            writing = r.writing if r is not None and r.writing and r.writing[0]["item_id"] == item.id else None
            await self.send(
                "conversation.item.retrieved", item=writing[1] if writing else function_item_event(item, item.status)
            )
            return
        if r is not None and r.item_id == item.id:
            status, text = "in_progress", r.text
        else:  # (a user's speech has no transcript yet, or never will)
            status, text = item.status, None if item.id in self.unheard | self.failed else item.text
        content = [content_part(item.role, item.audio, text)]
        await self.send("conversation.item.retrieved", item=item_event(item.id, item.role, content, status))

    async def _ev_conversation_item_delete(self, event: dict[str, Any]) -> None:
        item_id = item_id_of(event)
        if self.active and self.reply is not None and item_id == self.reply.item_id:
            raise EventError("the active response's item cannot be deleted; cancel it first", param="item_id")
        if not self.conv.remove(item_id, client=True):
            raise EventError(f"no item {item_id!r} in the conversation", code="item_not_found", param="item_id")
        self.failed.discard(item_id)
        self.unheard.discard(item_id)  # (its transcript, if it comes, is for no item)
        self._no_reply(item_id)
        self._went_quiet()
        await self.send("conversation.item.deleted", item_id=item_id)

    async def _ev_response_create(self, event: dict[str, Any]) -> None:
        if self.active:
            raise EventError(
                "the conversation already has an active response", code="conversation_already_has_active_response"
            )
        request = response_request(event.get("response"), self.ga, self.config, self.services, self.conv)
        request.number, request.event_id = next(self._requests), event.get("event_id")
        self.requested = request  # only once the request is valid: a refused one leaves none queued
        await self.inbox.put(request)

    async def _ev_response_cancel(self, event: dict[str, Any]) -> None:
        """Cancel the active response; with ``response_id``, only if that is the one in progress
        (a cancel of a reply that just ended must not stop the next one)."""
        if not self.active:
            raise EventError("there is no active response to cancel", code="response_cancel_not_active")
        if (rid := event.get("response_id")) is not None:
            if not isinstance(rid, str):
                raise EventError("response_id must be a string", param="response_id")
            if self.reply is None or self.reply.done or self.reply.id != rid:
                raise EventError(
                    f"response {rid!r} is not in progress", code="response_cancel_not_active", param="response_id"
                )
            await self._cancel(rid)
            return
        if self.requested is not None:
            # Asked for but not started: it ends now for the client, and is stopped as it starts
            # (its request may still be on its way through the stages before the LLM's).
            asked, self.requested = self.requested, None
            asked.cancelled = True  # (the reply stage skips it; one it already started is stopped)
            self.withdrawn[asked.number] = asked.created
            await self._cancelled_unstarted(asked, "client_cancelled")
            return
        if self.reply is None or self.reply.done:  # a turn's own reply, still to start
            self.cancel_pending = True
            return
        await self._cancel(self.reply.id)

    async def _ev_conversation_item_truncate(self, event: dict[str, Any]) -> None:
        reply, end_ms = truncation(event, self.conv, self.replies)
        reply.heard_ms = end_ms  # (the client's word: a barge-in's own estimate does not bound it)
        await self._truncate(reply, end_ms)
