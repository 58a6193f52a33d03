"""A ``/v1/realtime`` session's responses: a reply's frames as its server events.

A response's lifecycle: ``LLMStarted`` opens it (``response.created``, and its message item and
content part, which a reply that may call functions announces only at its first text or
audio), ``TextDelta`` and ``TTSAudio`` stream into it, a ``ToolCallStarted`` adds a function call
item, ``LLMDone`` records its text and usage, ``TTSDone`` completes it, and an ``Interrupt``
(barge-in or ``response.cancel``) cancels it, truncating its item to what the client has played.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Collection
from typing import Any

from gateway.errors import error_object
from modalities.audio import resample
from pipelines.conversation import Item, Spoken
from pipelines.frames import (
    Frame,
    Interrupt,
    LLMDone,
    LLMReserved,
    LLMStarted,
    ReplyFrame,
    ResponseRequest,
    TextDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallStarted,
    TTSAudio,
    TTSDone,
)
from pipelines.realtime_audio import FORMATS
from pipelines.realtime_items import (
    MAX_TRUNCATABLE,
    Reply,
    content_part,
    function_item_event,
    item_event,
    response_event,
    response_settings,
    usage_object,
)
from pipelines.realtime_limits import rate_limits
from pipelines.realtime_output import ServerEvents
from pipelines.speech import spoken


class ReplyEvents(ServerEvents):
    """A reply's frames (and the barge-ins and cancels that end it) as its events; the session's
    other frames are the user's side (``ServerEvents``)."""

    def _observe_turn(self, first_audio: float) -> None:
        """Server-side voice-to-voice: the VAD's end of turn to the first reply audio sent."""
        if self.metrics is not None and self.turn_ended is not None:
            self.metrics.observe(
                "realtime_turn_to_first_audio_seconds",
                first_audio - self.turn_ended,
                help="/v1/realtime: end of the user's turn (VAD) to the first reply audio",
                model=self.config.model,
            )
        self.turn_ended = None

    def _encode(self, r: Reply, frame: TTSAudio) -> bytes:
        """A chunk in the reply's format, fixed as it starts. (Its TTS fixed the rate a moment
        before: a session.update in between leaves a chunk at the other rate, resampled.)"""
        fmt = FORMATS[r.audio_format]
        samples = frame.samples
        if frame.sample_rate != fmt.rate:
            samples = resample(samples, frame.sample_rate, fmt.rate)
        return fmt.encode(samples)

    async def _on_frame(self, frame: Frame) -> None:
        """A reply's frame as its events (those of a reply ended already: none)."""
        r = self.reply
        if isinstance(frame, Interrupt):
            await self._interrupted(frame)
        elif isinstance(frame, LLMStarted):
            await self._started(frame)
        elif not isinstance(frame, ReplyFrame):
            await super()._on_frame(frame)
        elif r is None or frame.response_id != r.id or r.done:
            return  # a frame of a cancelled reply
        elif isinstance(frame, LLMReserved):  # its start, as OpenAI's: the limits with its tokens reserved
            r.settle = frame.settle
            if limits := await rate_limits(self.ws, self.services.llm, frame.tokens):
                await self.send("rate_limits.updated", rate_limits=limits)
        elif isinstance(frame, TextDelta):
            await self._open(r)
            r.text += frame.text
            if frame.prompt_tokens:  # (so far: what a reply cancelled before its LLMDone reports)
                r.usage = usage_object(frame.prompt_tokens, frame.completion_tokens, frame.cached_tokens)
            kind = "response.audio_transcript.delta" if r.audio else "response.text.delta"
            await self.send(kind, **self._where(r), delta=frame.text)
        elif isinstance(frame, TTSAudio):
            await self._open(r)
            pcm = self._encode(r, frame)
            ms = len(frame.samples) / frame.sample_rate * 1000
            if frame.text or not r.spoken:
                r.spoken.append(Spoken(frame.text, 0.0))
            r.spoken[-1].ms += ms
            r.audio_ms += ms
            if r.first_audio is None:
                r.first_audio = time.monotonic()
                if not r.out_of_band:  # a turn's reply, not a side request
                    self._observe_turn(r.first_audio)
            await self.send("response.audio.delta", **self._where(r), delta=base64.b64encode(pcm).decode())
        elif isinstance(frame, ToolCallStarted):
            await self._call_started(r, frame)
        elif isinstance(frame, ToolCallArguments | ToolCall) and r.writing and r.writing[0]["item_id"] == frame.item_id:
            if isinstance(frame, ToolCall):
                await self._call_done(r, frame.arguments)
            else:
                r.writing[1]["arguments"] += frame.delta
                await self.send("response.function_call_arguments.delta", **r.writing[0], delta=frame.delta)
        elif isinstance(frame, LLMDone) and frame.error is not None:  # the engine refused or failed it
            r.error = error_object(frame.error, frame.error_type, code=frame.error_code)
            await self.send("error", error={**r.error, "event_id": r.event_id})
            await self._finish(r, "failed")
        elif isinstance(frame, LLMDone):
            r.text, r.cut = frame.text, frame.cut
            r.usage = usage_object(frame.prompt_tokens, frame.completion_tokens, frame.cached_tokens)
        elif isinstance(frame, TTSDone) and r.cut:
            await self._finish(r, "incomplete", "max_output_tokens")
        elif isinstance(frame, TTSDone):
            await self._finish(r, "completed")

    async def _call_started(self, r: Reply, frame: ToolCallStarted) -> None:
        """A function call: an output item of its own after the reply's message (closed here:
        the reply's text ends where a call starts), its arguments streamed as they are written."""
        if r.opened and r.message is None:
            await self._close_message(r, "completed")
        if not r.opened:  # a call alone: its reply has no message item
            self.conv.remove(r.item_id)
        item = self.conv.get(frame.item_id) or Item(  # (an out-of-band reply's call is in no conversation)
            frame.item_id, "assistant", kind="function_call", call_id=frame.call_id, name=frame.name
        )
        where = {"response_id": r.id, "output_index": int(r.opened) + len(r.calls)}
        added = {**function_item_event(item, "in_progress"), "arguments": ""}
        await self.send("response.output_item.added", **where, item=added)
        if not r.out_of_band and item in self.conv.items:  # (the client may have deleted it)
            await self.send("conversation.item.created", previous_item_id=self._previous(item.id), item=added)
        r.writing = ({**where, "item_id": item.id, "call_id": item.call_id}, added)

    async def _call_done(self, r: Reply, arguments: str | None) -> None:
        """The call being written ends: whole, with ``arguments``, or cut short (None: it is
        "incomplete" and stays in the conversation with the arguments the client was sent, as a
        cut message keeps what was heard)."""
        assert r.writing is not None
        call, added = r.writing
        r.writing = None
        status = "completed" if arguments is not None else "incomplete"
        if arguments is None:
            arguments = added["arguments"]
        else:
            await self.send("response.function_call_arguments.done", **call, name=added["name"], arguments=arguments)
        if (item := self.conv.get(call["item_id"])) is not None:
            item.status, item.text = status, arguments
        r.calls.append({**added, "status": status, "arguments": arguments})
        where = {"response_id": r.id, "output_index": call["output_index"]}
        in_conversation = not r.out_of_band and item is not None  # (the client may have deleted it)
        await self.send("response.output_item.done", in_conversation, **where, item=r.calls[-1])

    def _where(self, r: Reply) -> dict[str, Any]:
        return {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}

    async def _started(self, frame: LLMStarted) -> None:
        if self.withdrawn.pop(frame.request, None) is not None:  # cancelled before it started
            self.silenced.add(frame.response_id)
            self._forget(frame.response_id)
            self.conv.remove(frame.item_id)
            await self.inbox.put(Interrupt("client_cancelled", frame.response_id))
            return
        asked = self.requested if self.requested is not None and frame.request == self.requested.number else None
        if asked is not None:
            self.requested = None
        elif not frame.request:  # a turn's own reply
            self.expected = None
        audio = spoken(frame.audio, self.tts_options, self.services)
        self.reply = r = Reply(
            frame.response_id,
            frame.item_id,
            audio,
            out_of_band=frame.out_of_band,
            conversation_id=None if frame.out_of_band else self.conversation_id,
            metadata=frame.metadata,
            audio_format=frame.audio_format or self.config.output_audio_format,
            event_id=frame.event_id,
            **response_settings(self.config, asked),
        )
        if (reply_item := self.conv.get(r.item_id)) is not None:
            reply_item.audio = audio
        await self.send("response.created", response=response_event(r, "in_progress", []))
        if not frame.calls:  # (with tools, a reply may be a call alone: no message)
            await self._open(r)
        if self.cancel_pending and not frame.request:  # the turn's reply, cancelled before it started
            self.cancel_pending = False
            await self._cancel(frame.response_id)

    async def _cancel(self, response_id: str) -> None:
        """A client's cancel of reply ``response_id``: it ends for the client now (a
        ``response.create`` right behind the cancel is not refused), and the pipeline stops its
        work (the ``Interrupt``, when it comes out, finds it done)."""
        stop = Interrupt("client_cancelled", response_id)
        await self._interrupted(stop)
        await self.inbox.put(stop)

    async def _open(self, r: Reply) -> None:
        """Announce the reply's message item (once)."""
        if r.opened:
            return
        r.opened = True
        if not r.out_of_band:
            self.in_band = r  # the latest reply the user may hear
            self.replies[r.item_id] = r  # (a client playing behind may truncate an earlier one)
            while len(self.replies) > MAX_TRUNCATABLE:
                del self.replies[next(iter(self.replies))]
        item = item_event(r.item_id, "assistant", [], status="in_progress")
        await self.send("response.output_item.added", response_id=r.id, output_index=0, item=item)
        if not r.out_of_band:
            await self.send("conversation.item.created", previous_item_id=self._previous(r.item_id), item=item)
        await self.send("response.content_part.added", **self._where(r), part=content_part("assistant", r.audio, ""))

    def _part(self, r: Reply) -> dict[str, Any]:
        item = self.conv.get(r.item_id)
        return content_part("assistant", r.audio, item.text if item is not None else r.text)

    async def _close_message(self, r: Reply, status: str) -> None:
        where = self._where(r)
        part = self._part(r)
        # Whatever ended it (as OpenAI's: also when interrupted, incomplete or cancelled): the
        # part's text as the conversation has it (what was heard, after a barge-in's truncate).
        if r.audio:
            await self.send("response.audio.done", **where)
            await self.send("response.audio_transcript.done", **where, transcript=part["transcript"])
        else:
            await self.send("response.text.done", **where, text=part["text"])
        await self.send("response.content_part.done", **where, part=part)
        item = item_event(r.item_id, "assistant", [part], status="completed" if status == "completed" else "incomplete")
        if (conv_item := self.conv.get(r.item_id)) is not None:
            conv_item.status = item["status"]
        r.message = item
        await self.send("response.output_item.done", not r.out_of_band, response_id=r.id, output_index=0, item=item)

    async def _finish(self, r: Reply, status: str, reason: str | None = None) -> None:
        """Close the reply: its message (an empty one if it had neither text nor a call; none if
        it only called functions, and its empty item leaves the conversation), then the response
        (``status`` "completed", "incomplete" at max_output_tokens, "cancelled" or "failed")."""
        r.done = True
        if not r.opened and not r.calls and r.writing is None and status in ("completed", "incomplete"):
            await self._open(r)
        if r.opened and r.message is None:
            await self._close_message(r, status)
        if not r.opened:
            self.conv.remove(r.item_id)
        if r.writing is not None:
            await self._call_done(r, None)
        if status != "completed":  # calls the client was never told of leave the conversation too
            self._forget(r.id, keep={c["id"] for c in r.calls})
        output = [r.message] if r.message is not None else []
        await self._done(r, status, [*output, *r.calls], reason)

    async def _done(self, r: Reply, status: str, output: list[dict[str, Any]], reason: str | None = None) -> None:
        """``response.done``, then ``rate_limits.updated`` adjusted to what the reply used
        (``pipelines.realtime_limits``)."""
        if r.settle is not None:  # what it reports it used, or what it generated if more (the first settle counts)
            await r.settle(r.usage.get("total_tokens", 0))
        events = [{"type": "response.done", "response": response_event(r, status, output, reason)}]
        if limits := await rate_limits(self.ws, self.services.llm, r.usage.get("total_tokens", 0)):
            events.append({"type": "rate_limits.updated", "rate_limits": limits})
        await self.send_together(events)
        self._reply_ended(r, status)

    async def _cancelled_unstarted(self, asked: ResponseRequest, reason: str = "turn_detected") -> None:
        """The events of a response cancelled before it started (as OpenAI's, which starts at
        the request: created, then done, "cancelled" for ``reason``)."""
        r = Reply(
            self.conv.new_id("resp"),
            "",
            spoken(asked.audio, self.tts_options, self.services),
            out_of_band=asked.out_of_band,
            conversation_id=None if asked.out_of_band else self.conversation_id,
            metadata=asked.metadata,
            audio_format=asked.audio_format or self.config.output_audio_format,
            **response_settings(self.config, asked),
        )
        await self.send("response.created", response=response_event(r, "in_progress", []))
        r.done = True
        await self._done(r, "cancelled", [], reason)

    def _forget(self, response_id: str, keep: Collection[str] = ()) -> None:
        """Remove the items (function calls) reply ``response_id`` made, but for those in ``keep``."""
        for item in [i for i in self.conv.items if i.response_id == response_id and i.id not in keep]:
            self.conv.remove(item.id)

    async def _interrupted(self, frame: Interrupt) -> None:
        """Cancel the active response, and after a barge-in the one asked for before it; the
        conversation keeps what the user heard of the latest reply in it (an out-of-band
        response may have come after that reply). A reply stopped unseen (``silenced``) leaves
        no items; a client's cancel of a reply no longer the current one does nothing."""
        r, talk = self.reply, self.in_band
        if frame.response_id in self.silenced:  # the client was told it ended: its items leave too
            self.silenced.discard(frame.response_id)
            self._forget(frame.response_id)
            return
        if frame.response_id is not None and (r is None or r.id != frame.response_id or r.done):
            return  # a client's cancel of a reply that ended meanwhile (or already cancelled)
        if frame.takes_turn:  # (a client's cancel leaves the replies not started alone: frames.Interrupt)
            self.expected = None
            asked = self.requested
            if asked is not None and asked.created <= frame.created:  # asked for before the user spoke
                self.requested = None
                await self._cancelled_unstarted(asked)
            self.cancel_pending = False  # (it was for the turn's reply)
            self.withdrawn = {n: t for n, t in self.withdrawn.items() if t > frame.created}  # (the rest are dropped)
        if r is not None and not r.done:
            if r is talk:
                if r.audio and r.opened:
                    if r.heard_ms is None:  # (a client's truncation already says what it heard)
                        await self._truncate(r, r.played_ms())
                elif (item := self.conv.get(r.item_id)) is not None:
                    item.truncated = True  # text only: the client saw every delta sent
                talk = None  # cut here
            reason = "turn_detected" if frame.reason == "speech_started" else "client_cancelled"
            await self._finish(r, "cancelled", reason)
        if talk is not None and talk.playing():  # finished sending but still playing: cut what is unheard
            await self._truncate(talk, talk.played_ms())
