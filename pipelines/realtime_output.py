"""The server side of a ``/v1/realtime`` session: the voice pipeline's output frames as
OpenAI Realtime server events (``RealtimeSession`` handles the client's events). ``ServerEvents``
sends them and turns the user's side into events (speech started and stopped, committed items,
their transcripts and failures); ``pipelines.realtime_replies`` turns the replies' frames into
theirs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

from fastapi import WebSocket

from gateway.errors import error_object
from modalities.asr.formats import logprobs_field
from pipelines import realtime_ga
from pipelines.conversation import Conversation, heard_text
from pipelines.frames import (
    ErrorFrame,
    Frame,
    Heard,
    ResponseRequest,
    SpeechStarted,
    SpeechStopped,
    TimedOut,
    TurnReset,
)
from pipelines.realtime_config import SessionConfig
from pipelines.realtime_items import (
    Reply,
    content_part,
    item_event,
)
from pipelines.services import Services
from pipelines.speech import TTSOptions
from pipelines.vad import VADConfig


class ServerEvents:
    """Sends server events and turns the user's side of the pipeline's frames into them (a
    reply's: ``realtime_replies.ReplyEvents``); the session's state is shared with
    ``RealtimeSession``, which sets every attribute below."""

    ws: WebSocket
    services: Services
    config: SessionConfig
    conv: Conversation
    tts_options: TTSOptions
    inbox: asyncio.Queue[Frame]
    reply: Reply | None  # the latest response (active until done)
    in_band: Reply | None  # the latest response in the conversation (barge-in)
    replies: dict[str, Reply]  # the latest responses in the conversation by item id (truncation)
    conversation_id: str  # its one conversation's (OpenAI's "conv_...")
    unheard: set[str]  # user audio items created, their transcript still to come
    failed: set[str]  # user audio items whose transcription failed (kept, with no text)
    turn_ended: float | None  # when the VAD ended the user's last turn (monotonic)
    metrics: Any
    vad_config: VADConfig
    requested: ResponseRequest | None  # a response.create, queued
    expected: str | None  # the turn (server VAD's) whose automatic reply is on its way
    cancel_pending: bool  # ... and a response.cancel came before that reply started
    withdrawn: dict[int, float]  # client requests cancelled before they started (number: made at)
    silenced: set[str]  # the replies of those that started anyway, being stopped
    appended_ms: float  # audio appended since the last turn boundary
    ga: bool  # the GA dialect (pipelines.realtime_ga), once a session.update says so
    transcription: bool  # a transcription session (pipelines.realtime_transcription): no replies
    _event_ids: itertools.count[int]
    _send_lock: asyncio.Lock

    @property
    def active(self) -> bool:
        """A response is asked for, expected (a turn's) or in progress."""
        return (
            self.requested is not None or self.expected is not None or (self.reply is not None and not self.reply.done)
        )

    # -- sending ------------------------------------------------------------------------------
    async def send(self, type_: str, in_conversation: bool = True, **fields: Any) -> None:
        """One server event (``in_conversation`` False: its item is an out-of-band reply's)."""
        await self.send_together([{"type": type_, **fields}], in_conversation)

    async def send_together(self, events: list[dict[str, Any]], in_conversation: bool = True) -> None:
        """Server ``events`` one after the other, none of another task's between them."""
        if self.ga:
            events = [out for event in events for out in realtime_ga.translate(event, in_conversation)]
        async with self._send_lock:
            for event in events:
                await self.ws.send_text(json.dumps({"event_id": f"event_{next(self._event_ids):06d}", **event}))

    async def send_error(
        self, message: str, code: str = "invalid_value", param: str | None = None, **extra: Any
    ) -> None:
        err = {**error_object(message, "invalid_request_error", param, code), **extra}
        await self.send("error", error=err)

    # -- hooks (``pipelines.realtime_idle``) --------------------------------------------------
    def _reply_ended(self, r: Reply, status: str) -> None:
        """Reply ``r`` has ended with ``status`` (its ``response.done`` is sent)."""

    def _reply_cut(self) -> None:
        """The client's playback of the latest reply was cut now (a truncation)."""

    def _speech_started(self) -> None:
        """The VAD heard the user start speaking."""

    def _speech_stopped(self) -> None:
        """The VAD heard the user stop speaking."""

    def _went_quiet(self) -> None:
        """A user turn ended, was heard or failed: unless a reply is on its way, the session may be idle."""

    def _turn_reset(self) -> None:
        """A commit or a clear ended a turn the VAD had heard start (``TurnReset``)."""

    async def _timed_out(self, frame: TimedOut) -> None:
        """The VAD's answer to an idle commit (``TimedOut``)."""

    # -- pipeline output ----------------------------------------------------------------------
    def _no_reply(self, item_id: str) -> None:
        """Turn ``item_id`` gets no automatic reply (nothing heard, a failure, deleted); a
        response.cancel sent while it was expected has nothing left to cancel."""
        if item_id and item_id == self.expected:
            self.expected, self.cancel_pending = None, False

    async def _user_item_created(self, item_id: str) -> None:
        """The committed audio ``item_id`` joins the conversation at once, empty until it is heard
        (the client may put items after it); its transcript is to come. (Before any await: the
        turn's ``Transcript`` or its failure may come next.)"""
        if self.conv.get(item_id) is None:  # (not already heard)
            self.conv.add("user", "", item_id, audio=True, pending=True)
        if item_id not in self.failed:
            self.unheard.add(item_id)
        previous = self._previous(item_id)
        await self.send("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        content = [content_part("user", True, None)]
        await self.send(
            "conversation.item.created", previous_item_id=previous, item=item_event(item_id, "user", content)
        )

    async def _truncate(self, reply: Reply, audio_end_ms: float) -> None:
        item = self.conv.get(reply.item_id)
        if item is not None:
            item.text = heard_text(reply.spoken, audio_end_ms) if reply.audio else item.text
            item.truncated = True
        await self.send(
            "conversation.item.truncated", item_id=reply.item_id, content_index=0, audio_end_ms=int(audio_end_ms)
        )
        self._reply_cut()

    async def _on_frame(self, frame: Frame) -> None:
        """A frame of the user's side (or an error) as its events; any other frame: none."""
        r = self.reply
        if isinstance(frame, SpeechStarted):
            self._speech_started()
            await self.send("input_audio_buffer.speech_started", audio_start_ms=frame.audio_ms, item_id=frame.item_id)
        elif isinstance(frame, SpeechStopped):
            self._speech_stopped()
            self.appended_ms = 0.0
            self.turn_ended = frame.created
            if self.vad_config.create_response:  # (a client's response.create now is refused)
                self.expected = frame.item_id
            await self.send("input_audio_buffer.speech_stopped", audio_end_ms=frame.audio_ms, item_id=frame.item_id)
            await self._user_item_created(frame.item_id)
            self._went_quiet()
        elif isinstance(frame, Heard):
            if not frame.text:  # nothing said: no reply
                self._no_reply(frame.item_id)
            unheard = frame.item_id in self.unheard  # (else the client deleted it)
            self.unheard.discard(frame.item_id)
            if self.transcription:  # (no reply stage hears it)
                self.conv.hear(frame.item_id, frame.text)
            if unheard and self.config.input_audio_transcription is not None:  # null: the client asked for none
                # (``include``d: the transcript's tokens, as OpenAI's gpt-4o-transcribe gives them)
                logprobs = logprobs_field(frame.logprobs)
                if self.transcription and frame.text:  # (whole, as OpenAI's whisper-1 sends it)
                    delta = {"item_id": frame.item_id, "content_index": 0, "delta": frame.text, **logprobs}
                    await self.send("conversation.item.input_audio_transcription.delta", **delta)
                await self.send(
                    "conversation.item.input_audio_transcription.completed",
                    item_id=frame.item_id,
                    content_index=0,
                    transcript=frame.text,
                    **logprobs,
                    usage={"type": "duration", "seconds": round(max(0, frame.end_ms - frame.start_ms) / 1000, 3)},
                )
            self._went_quiet()
        elif isinstance(frame, TimedOut):
            await self._timed_out(frame)
        elif isinstance(frame, TurnReset):
            self._turn_reset()
        elif isinstance(frame, ErrorFrame) and frame.response_id and (r is None or r.id != frame.response_id or r.done):
            return  # work for a reply cancelled or stopped unseen: the client was told it ended
        elif isinstance(frame, ErrorFrame):
            error = error_object(frame.message, frame.error_type, frame.param, frame.code)
            unheard = frame.item_id in self.unheard  # its transcript will not come
            self.unheard.discard(frame.item_id)
            self._no_reply(frame.item_id)
            if frame.item_id:  # (a user item's failure: it gets no reply)
                self._went_quiet()
            if not unheard and frame.item_id and self.conv.removed(frame.item_id):
                return  # (speech the client deleted)
            if unheard:  # the item stays, as audio with no transcript
                self.failed.add(frame.item_id)
                if (item := self.conv.get(frame.item_id)) is not None:
                    item.pending = False
            if unheard and self.config.input_audio_transcription is not None:
                await self.send(
                    "conversation.item.input_audio_transcription.failed",
                    item_id=frame.item_id,
                    content_index=0,
                    error=error,
                )
            else:
                await self.send("error", error={**error, "event_id": frame.event_id})

    def _previous(self, item_id: str | None) -> str | None:
        """The id of the item the client knows before ``item_id`` (None: before a new last
        item); a reply whose message is not announced yet is skipped (it may never be)."""
        r = self.reply
        hidden = r.item_id if r is not None and not r.opened and not r.done else None
        at = next((k for k, i in enumerate(self.conv.items) if i.id == item_id), len(self.conv.items))
        return next((i.id for i in reversed(self.conv.items[:at]) if i.id != hidden), None)
