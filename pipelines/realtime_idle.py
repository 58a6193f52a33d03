"""``turn_detection.idle_timeout_ms`` (server VAD, as OpenAI's): once a reply's audio has played,
that long without the user speaking commits the input audio as it is (silence) to the
conversation and asks for a reply, so that the model prompts the user to go on (a phone call's
"are you still there?"). The client gets ``input_audio_buffer.timeout_triggered``, then the events
of a commit and of a ``response.create``. The wait starts again after every reply in the
conversation; the user's speech stops it.

The VAD decides, in order with the audio (``CommitFrame.idle``): speech it hears, even before it
is sure of a turn, keeps the input from being committed (``TimedOut`` with ``committed`` False).
"""

from __future__ import annotations

import asyncio
import itertools
import time

from pipelines.frames import CommitFrame, TimedOut
from pipelines.realtime_items import Reply
from pipelines.realtime_output import ServerEvents
from pipelines.realtime_response import response_request


class IdleTimeout(ServerEvents):
    """The session's events with the idle timeout (``RealtimeSession`` sets the state). The
    session is idle from the end of a reply's playback (estimated on a real-time clock from its
    first chunk, as a barge-in's truncation is; a cancelled or truncated reply's at the cut), or
    from the end of a user turn that gets no reply (a cough Whisper hears nothing in, or
    ``create_response`` off), until the user speaks or a reply is on its way; the wait runs while
    it is idle and the timeout is set. A new ``idle_timeout_ms`` counts from the same moment. A
    reply that only called functions leaves the session waiting for their output, not idle."""

    speaking: bool  # between the VAD's speech_started and the end of that turn
    idle_from: float | None  # when the session became idle (monotonic); None: it is not
    _requests: itertools.count[int]
    _idle: asyncio.Task[None] | None  # the wait, until its commit is in the inbox
    _idle_since: float | None  # the idle moment of the commit in flight

    # -- hooks ---------------------------------------------------------------------------------
    def _reply_ended(self, r: Reply, status: str) -> None:
        if not r.out_of_band and not self.speaking:  # (an out-of-band reply is not the conversation's)
            now = time.monotonic()
            if r.calls and status == "completed":
                self.idle_from = None  # (the client runs the functions: their output asks for the reply)
            elif status == "cancelled" or r.first_audio is None or r.heard_ms is not None:
                self.idle_from = now  # (a reply the client truncated stopped playing there)
            else:
                self.idle_from = max(now, r.first_audio + r.audio_ms / 1000)
        self._restart_idle()

    def _reply_cut(self) -> None:
        if self.idle_from is not None and self.idle_from > time.monotonic():  # (it stopped playing now)
            self.idle_from = time.monotonic()
            self._restart_idle()

    def _speech_started(self) -> None:
        self.speaking, self.idle_from = True, None
        self._stop_idle()

    def _speech_stopped(self) -> None:
        self.speaking = False

    def _turn_reset(self) -> None:
        self.speaking = False
        self._went_quiet()

    def _went_quiet(self) -> None:
        if self.speaking or self.active:
            return
        if self.idle_from is None:  # (a turn no reply answers)
            self.idle_from = time.monotonic()
        if self._idle is None:  # (a wait that ran out while a reply was expected goes on)
            self._restart_idle()

    async def _timed_out(self, frame: TimedOut) -> None:
        """The VAD's answer to the wait's commit: the events of the timeout and the commit, and
        the reply (unless the client asked for one meanwhile: it answers the same items)."""
        if not frame.committed:
            self._went_quiet()  # (speech it heard that never became a turn must not end the waits)
            return
        since = self._idle_since or time.monotonic()
        start_ms = max(0.0, frame.end_ms - (time.monotonic() - since) * 1000)  # (where playback ended)
        await self.send(
            "input_audio_buffer.timeout_triggered",
            audio_start_ms=int(start_ms),
            audio_end_ms=frame.end_ms,
            item_id=frame.item_id,
        )
        await self._user_item_created(frame.item_id)
        if not self.active:
            request = response_request(None, self.ga, self.config, self.services, self.conv)
            request.number = next(self._requests)
            self.requested = request
            await self.inbox.put(request)

    # -- the wait ------------------------------------------------------------------------------
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
        try:
            await asyncio.sleep(max(0.0, since + ms / 1000 - time.monotonic()))
            if self.active or self.speaking:
                return  # (a reply is on its way: its end, or its absence, starts the wait again)
            self.idle_from, self._idle_since = None, since
            self.appended_ms, self.fill_known = 0.0, False
            await self.inbox.put(CommitFrame(item_id=self.conv.new_id("item_cm"), idle=True))
        finally:
            if self._idle is asyncio.current_task():
                self._idle = None
