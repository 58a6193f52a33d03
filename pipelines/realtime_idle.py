"""``turn_detection.idle_timeout_ms`` (server VAD, as OpenAI's): once a reply's audio has played,
that long without the user speaking commits the input audio as it is (silence) to the
conversation and asks for a reply, so that the model prompts the user to go on (a phone call's
"are you still there?"). The client gets ``input_audio_buffer.timeout_triggered``, then the events
of a commit and of a ``response.create``. The wait starts again after every reply in the
conversation; the user's speech stops it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from fastapi import WebSocketDisconnect

from pipelines.frames import CommitFrame
from pipelines.realtime_items import Reply
from pipelines.realtime_output import ServerEvents
from pipelines.realtime_response import response_request

logger = logging.getLogger("mmserve.realtime")


class IdleTimeout(ServerEvents):
    """The session's events with the idle timeout (``RealtimeSession`` sets the state). The
    session is idle from the end of a reply's playback (estimated on a real-time clock from its
    first chunk, as a barge-in's truncation is), or from the end of a user turn that gets no
    reply (a cough Whisper hears nothing in, or ``create_response`` off), until the user speaks
    or a reply is on its way; the wait runs while it is idle and the timeout is set. A new
    ``idle_timeout_ms`` counts from the same moment (the wait is started again at each update)."""

    written_ms: float  # input audio appended since the session began
    speaking: bool  # between the VAD's speech_started and its speech_stopped
    idle_from: float | None  # when the session became idle (monotonic); None: it is not
    _requests: itertools.count[int]
    _idle: asyncio.Task[None] | None

    def _reply_ended(self, r: Reply) -> None:
        if not r.out_of_band and not self.speaking:  # (an out-of-band reply is not the conversation's)
            now = time.monotonic()
            self.idle_from = now if r.first_audio is None else max(now, r.first_audio + r.audio_ms / 1000)
        self._restart_idle()

    def _speech_started(self) -> None:
        self.speaking, self.idle_from = True, None
        self._stop_idle()

    def _speech_stopped(self) -> None:
        self.speaking = False

    def _went_quiet(self) -> None:
        if self.idle_from is None and not self.speaking and not self.active:  # (a turn no reply answers)
            self.idle_from = time.monotonic()
            self._restart_idle()

    def _idle_ms(self) -> int | None:
        td = self.config.turn_detection
        return None if td is None or self.transcription else td.get("idle_timeout_ms")

    def _restart_idle(self) -> None:
        """(Re)start the wait for the timeout as it is set now, from ``idle_from``."""
        self._stop_idle()
        ms = self._idle_ms()
        if ms is not None and self.idle_from is not None and not self.speaking:
            self._idle = asyncio.get_running_loop().create_task(self._idle_wait(self.idle_from, ms))

    def _stop_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    async def _idle_wait(self, since: float, ms: int) -> None:
        await asyncio.sleep(max(0.0, since + ms / 1000 - time.monotonic()))
        self._idle = None
        if self.active or self.speaking:
            return  # (a reply is on its way: its end starts the wait again)
        self.idle_from = None
        try:
            await self._timed_out(since)
        except (WebSocketDisconnect, RuntimeError):
            pass  # client gone
        except Exception:  # a bug here must not pass unseen in a task nobody awaits
            logger.exception("realtime idle timeout failed")

    async def _timed_out(self, played: float) -> None:
        item_id = self.conv.new_id("item_cm")
        end_ms = self.written_ms
        start_ms = max(0.0, end_ms - (time.monotonic() - played) * 1000)  # (where playback ended)
        await self.send(
            "input_audio_buffer.timeout_triggered",
            audio_start_ms=int(start_ms),
            audio_end_ms=int(end_ms),
            item_id=item_id,
        )
        self.appended_ms, self.fill_known = 0.0, False
        await self._user_item_created(item_id)
        await self.inbox.put(CommitFrame(item_id=item_id, idle=True))
        request = response_request(None, self.ga, self.config, self.services, self.conv)
        request.number = next(self._requests)
        self.requested = request
        await self.inbox.put(request)
