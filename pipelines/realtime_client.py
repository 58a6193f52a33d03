"""A ``/v1/realtime`` session's client events on its conversation (``ClientEvents``): the input
audio buffer's (append, commit, clear; the audio appended is charged to the tenant's
``audio_seconds``), the items' (create, retrieve, delete, truncate) and the responses' (create,
cancel). Each is checked (a refusal is an ``EventError``: an ``error`` event, and the session goes
on), then becomes a frame for the pipeline or is answered at once. ``RealtimeSession`` reads the
events and handles ``session.update`` itself (its settings).
"""

from __future__ import annotations

import itertools
import re
from typing import TYPE_CHECKING, Any

from modalities.audio import ASR_RATE
from pipelines.frames import AudioFrame, ClearFrame, CommitFrame, ResponseRequest
from pipelines.realtime_audio import FORMATS
from pipelines.realtime_events import EventError, decode_append, item_id_of
from pipelines.realtime_items import client_item, content_part, function_item_event, item_event, truncation
from pipelines.realtime_output import ServerEvents
from pipelines.realtime_response import response_request
from pipelines.vad import MAX_BUFFER_SAMPLES

if TYPE_CHECKING:
    from gateway.ratelimit import Charge

MAX_BUFFER_S = MAX_BUFFER_SAMPLES / ASR_RATE
SERVER_ID = re.compile(r"(item|item_in|item_cm|resp)_\d{6}")  # the ids the server makes


class ClientEvents(ServerEvents):
    """The client's events on the conversation, as ``_ev_<type with "." as "_">`` handlers
    (``RealtimeSession._handle`` dispatches them); the session's state is ``RealtimeSession``'s."""

    fill_known: bool  # whether ``appended_ms`` is the buffer's fill (manual turns since it was empty)
    _requests: itertools.count[int]  # numbers the response.create requests

    if TYPE_CHECKING:  # (RealtimeSession's and ReplyEvents')

        async def _charge(self, unit: str, amount: float) -> Charge: ...

        async def _cancel(self, response_id: str) -> None: ...

        async def _cancelled_unstarted(self, asked: ResponseRequest, reason: str = "turn_detected") -> None: ...

    # -- the input audio buffer ---------------------------------------------------------------
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

    # -- items --------------------------------------------------------------------------------
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

    async def _ev_conversation_item_truncate(self, event: dict[str, Any]) -> None:
        reply, end_ms = truncation(event, self.conv, self.replies)
        reply.heard_ms = end_ms  # (the client's word: a barge-in's own estimate does not bound it)
        await self._truncate(reply, end_ms)

    # -- responses ----------------------------------------------------------------------------
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
