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
    """The session's events with the idle timeout (``RealtimeSession`` sets the state): armed as
    a reply ends, stopped as the user's speech starts and as the session ends."""

    written_ms: float  # input audio appended since the session began
    speaking: bool  # between the VAD's speech_started and its speech_stopped
    _requests: itertools.count[int]
    _idle: asyncio.Task[None] | None

    def _reply_ended(self, r: Reply) -> None:
        self._arm_idle(r)

    def _speech_started(self) -> None:
        self.speaking = True
        self._stop_idle()

    def _speech_stopped(self) -> None:
        self.speaking = False

    def _idle_ms(self) -> int | None:
        td = self.config.turn_detection
        return None if td is None or self.transcription else td.get("idle_timeout_ms")

    def _arm_idle(self, r: Reply) -> None:
        """Reply ``r`` ended: the wait starts once the client has played its audio (estimated on a
        real-time clock from its first chunk, as a barge-in's truncation is)."""
        self._stop_idle()
        ms = self._idle_ms()
        if ms is None or r.out_of_band or self.speaking:
            return
        now = time.monotonic()
        played = now if r.first_audio is None else max(now, r.first_audio + r.audio_ms / 1000)
        self._idle = asyncio.get_running_loop().create_task(self._idle_wait(played, ms))

    def _stop_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    async def _idle_wait(self, played: float, ms: int) -> None:
        await asyncio.sleep(max(0.0, played - time.monotonic()) + ms / 1000)
        self._idle = None
        if self._idle_ms() is None or self.active or self.speaking:
            return  # (turned off meanwhile, or a reply is on its way)
        try:
            await self._timed_out(played)
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
