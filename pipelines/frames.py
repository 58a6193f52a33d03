"""Typed frames: the only things that flow between pipeline processors (Pipecat's design).

Data frames (audio, utterances, transcripts, text, speech) are processed in order by each
processor. System frames (``SystemFrame`` subclasses: speech started/stopped, interrupt, errors) skip
the queues: a concurrent pipeline hands them to the output at once, and an ``Interrupt`` cancels the
work in flight of every interruptible processor after the one that emitted it.

Every frame is a picklable dataclass, so frames also travel between Celery stages (an
``AudioFrame``'s ``refund`` and an ``LLMReserved``'s ``settle`` excepted: only a live realtime
session sets them, and its frames stay in its process).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    from modalities.asr.types import TokenLogprob
    from pipelines.conversation import Item


@dataclass
class Frame:
    """Base frame; ``created`` is a ``time.monotonic()`` stamp (latency accounting)."""

    created: float = field(default_factory=time.monotonic, kw_only=True)

    def interrupted(self, by: Interrupt) -> Frame | None:
        """This frame as it stays queued after ``by`` (None: dropped): the frames of the replies
        it cancels are dropped (every reply's, or ``by.response_id``'s); after a barge-in
        (``by.takes_turn``) so are requests for a reply, and speech that already ended keeps its
        place but asks for no reply."""
        return self


@dataclass
class SystemFrame(Frame):
    """Out-of-band frame: delivered ahead of queued data frames."""


# -- audio in -------------------------------------------------------------------------------------


@dataclass
class AudioFrame(Frame):
    """A chunk of mono float32 audio in [-1, 1] at ``sample_rate``; ``refund``, if given, is
    awaited when the input buffer refuses it (what was charged for it is given back). A frame
    with a ``refund`` does not pickle: it is for a realtime session's own pipeline only."""

    samples: np.ndarray
    sample_rate: int
    refund: Callable[[], Awaitable[None]] | None = None
    event_id: str | None = None  # the client event that sent it (an error about it names it)


@dataclass
class CommitFrame(Frame):
    """End of the user's input: whatever audio is buffered is one utterance (manual turn taking).
    ``idle``: the session's idle timeout commits it, silence and all (an empty buffer too)."""

    item_id: str = ""
    idle: bool = False


@dataclass
class ClearFrame(Frame):
    """Drop the buffered input audio."""


@dataclass
class TimedOut(SystemFrame):
    """The VAD's answer to an idle commit (``CommitFrame.idle``): the input up to ``end_ms`` is
    user item ``item_id`` (its ``UserAudio`` follows), or, ``committed`` False, the user is
    speaking and nothing was committed."""

    item_id: str
    end_ms: int = 0
    committed: bool = True


@dataclass
class TurnReset(SystemFrame):
    """A commit or a clear ended a turn whose speech the VAD had heard start (no ``SpeechStopped``
    will come for it)."""


@dataclass
class SpeechStarted(SystemFrame):
    """The VAD heard speech begin; ``audio_ms`` is its position in the input audio."""

    audio_ms: int
    item_id: str = ""


@dataclass
class SpeechStopped(SystemFrame):
    """The VAD heard speech end (after the silence window); ``audio_ms`` is where speech ended."""

    audio_ms: int
    item_id: str = ""


@dataclass
class UserAudio(Frame):
    """One utterance (16 kHz mono float32), from ``start_ms`` to ``end_ms`` of the input;
    ``respond``: the LLM answers it as soon as it is transcribed. ``tentative``: the speaker
    paused but the turn is not over yet (ASR may start early); a final utterance with the same
    ``turn_key`` (the end-of-speech sample) had no speech since, so its transcript is the same.
    ``judged``: a VAD cut it out as speech; False for a manual commit, which the ASR's own VAD
    judges (Whisper makes words, "you", of silence)."""

    samples: np.ndarray
    sample_rate: int
    start_ms: int = 0
    end_ms: int = 0
    item_id: str = ""
    respond: bool = True
    tentative: bool = False
    turn_key: int = -1
    judged: bool = True

    def interrupted(self, by: Interrupt) -> UserAudio:
        return _unanswered(self, by)


# -- text ----------------------------------------------------------------------------------------


@dataclass
class SpeechResumed(Frame):
    """The speaker went on after a pause: speculative work on the utterance so far is stale."""


@dataclass
class Heard(SystemFrame):
    """A final transcript for the client, at once: the ``Transcript`` itself may wait in the
    LLM stage behind a reply in flight (``turn_detection.interrupt_response`` false).
    ``logprobs``: the text's tokens (``modalities.asr.types.TokenLogprob``), when asked for."""

    text: str
    start_ms: int = 0
    end_ms: int = 0
    item_id: str = ""
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Transcript(Frame):
    """The final transcript of one utterance (``respond``: as in ``UserAudio``). ``tentative``:
    the transcript of a pause's utterance (``UserAudio.tentative``), for a speculative reply (if
    ``respond``) and a semantic VAD's verdict only; it never reaches the conversation or the
    client."""

    text: str
    start_ms: int = 0
    end_ms: int = 0
    item_id: str = ""
    respond: bool = True
    tentative: bool = False
    turn_key: int = -1  # tentative: its pause's (``UserAudio.turn_key``)

    def interrupted(self, by: Interrupt) -> Transcript:
        return _unanswered(self, by)


@dataclass
class ResponseRequest(Frame):
    """Ask the LLM for a reply to the conversation so far (``response.create``); ``audio``:
    whether it is spoken (None: as the session says); ``input``: conversation items to reply
    to instead of the conversation; ``out_of_band``: the reply stays out of the conversation."""

    instructions: str | None = None
    audio: bool | None = None
    input: list[Item] | None = None
    out_of_band: bool = False
    metadata: dict[str, Any] | None = None  # the client's, echoed with the reply
    temperature: float | None = None  # for this reply only (None: the session's)
    max_tokens: int | None = None  # for this reply only (None: the session's)
    max_output_tokens: int | str | None = None  # ... as the client gave it ("inf" too): the response shows it
    voice: str | None = None  # for this reply only (None: the session's)
    # Its speech's rate and the transport's name for its encoding, for this reply only (None: the session's)
    sample_rate: int | None = None
    audio_format: str | None = None
    tools: list[dict[str, Any]] | None = None  # for this reply only, chat-shaped ([]: none; None: the session's)
    grammar: str | None = None  # with ``tools``: what its tool_choice holds the reply to
    # The conversation's ``clock`` when it was asked for: the client's items added later are not
    # in its prompt, and its item goes before them (None: as the conversation is when it starts).
    asked: int | None = None
    number: int = 0  # the session's count of the client's requests (0: a turn's own reply)
    event_id: str | None = None  # the client's response.create (an error about the reply names it)
    # The client cancelled it before it started (the session sets it on the queued request;
    # the reply stage skips it, and stops a reply it had already started: LLMStarted.request).
    cancelled: bool = False

    def interrupted(self, by: Interrupt) -> ResponseRequest | None:
        return None if by.takes_turn and self.created <= by.created else self  # (a later one stands)


@dataclass
class ReplyFrame(Frame):
    """A frame of one reply; an ``Interrupt`` that cancels the reply drops its queued frames
    (nobody will hear them)."""

    response_id: str

    def interrupted(self, by: Interrupt) -> ReplyFrame | None:
        return None if by.cancels(self.response_id) else self


@dataclass
class LLMStarted(ReplyFrame):
    """A reply began (``response_id`` names it in every later frame of that reply); its text
    goes into conversation item ``item_id``; ``audio``: spoken or not, whatever the session says
    (None: as it says)."""

    item_id: str = ""
    audio: bool | None = None
    out_of_band: bool = False  # the item is not in the conversation
    metadata: dict[str, Any] | None = None  # of the ResponseRequest that asked for it
    voice: str | None = None  # of the ResponseRequest that asked for it (None: the session's)
    sample_rate: int | None = None  # the same
    audio_format: str | None = None  # the same
    calls: bool = False  # it may call functions (then its text may be none at all)
    request: int = 0  # the ``ResponseRequest.number`` it answers
    event_id: str | None = None  # the same


@dataclass
class LLMReserved(ReplyFrame):
    """The reply's prompt is rendered and its ``tokens`` (prompt + ``max_tokens``) reserved, before
    its first text: the tenant's ``llm_tokens`` budget took them (``LLMOptions.budget``), or, with
    no budget, the context window holds them. ``settle``, if given, settles that charge to the
    tokens the reply used: those given, or those the reply stage has generated if more (a cut
    reply's text runs ahead of its audio); the first settle counts, the reply stage settles too."""

    tokens: int = 0
    settle: Callable[[float], Awaitable[None]] | None = None


@dataclass
class TextDelta(ReplyFrame):
    """Newly decoded reply text, with the reply's token counts so far (a cancelled reply's usage)."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class ToolCallStarted(ReplyFrame):
    """The reply began a call of function ``name`` (its name read: ``modalities.llm.tools``),
    conversation item ``item_id``; ``ToolCallArguments`` follow, then ``ToolCall``."""

    item_id: str
    call_id: str
    name: str


@dataclass
class ToolCallArguments(ReplyFrame):
    """More of the arguments of the call being written (item ``item_id``)."""

    item_id: str
    delta: str


@dataclass
class ToolCall(ReplyFrame):
    """The reply's call (``ToolCallStarted``) is whole: conversation item ``item_id``."""

    item_id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class LLMDone(ReplyFrame):
    """The reply's full text; ``cancelled`` when an interrupt cut it short; ``error`` when the
    engine refused or failed the request (the reply is over, as failed), with OpenAI's error
    ``error_type`` and ``error_code`` for it (``context_length_exceeded``: a refusal), and
    ``retry_after_s`` when it refused it under load (a full queue: the routes' 429 with
    ``Retry-After``)."""

    text: str
    cancelled: bool = False
    cut: bool = False  # it ended at its token limit (the response's max_output_tokens)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_type: str = "server_error"
    error_code: str | None = None
    retry_after_s: float | None = None


@dataclass
class Sentence(ReplyFrame):
    """A complete sentence of the reply, ready to speak."""

    text: str
    index: int


# -- audio out -----------------------------------------------------------------------------------


@dataclass
class TTSAudio(ReplyFrame):
    """Synthesised speech for sentence ``index`` of a reply (mono float32 at ``sample_rate``)."""

    samples: np.ndarray
    sample_rate: int
    index: int
    text: str = ""


@dataclass
class TTSDone(ReplyFrame):
    """Every sentence of reply ``response_id`` has been spoken."""


# -- control -------------------------------------------------------------------------------------


@dataclass
class Interrupt(SystemFrame):
    """Cancel the replies in flight downstream (LLM decode, TTS). A barge-in (``takes_turn``:
    the user spoke) also cancels every reply not started yet (queued frames:
    ``Frame.interrupted``; speech being transcribed: ``pipelines.speech.ASR``); a client's
    cancel, only its ``response_id`` (the work of other replies and turns goes on)."""

    reason: str = "speech_started"
    response_id: str | None = None

    @property
    def takes_turn(self) -> bool:
        return self.reason == "speech_started"

    def cancels(self, response_id: str | None) -> bool:
        """Whether it cancels reply ``response_id`` (None: work for no known reply)."""
        return self.response_id is None or self.response_id == response_id


@dataclass
class ErrorFrame(SystemFrame):
    """A processor failed on one frame, or refused it (``code``: e.g. ``input_audio_buffer_full``);
    the pipeline goes on. ``error_type`` is OpenAI's (``invalid_request_error``: the input's)."""

    message: str
    stage: str = ""
    code: str | None = None
    item_id: str = ""  # the conversation item of the frame it failed on, if any
    event_id: str | None = None  # the client event it refused, if any
    response_id: str | None = None  # the reply its work was for, if any
    param: str | None = None  # the request field a client error names, if any
    error_type: str = "server_error"


@dataclass
class End(Frame):
    """No more input: processors flush, then the pipeline stops (in order, after the data)."""


_Speech = TypeVar("_Speech", UserAudio, Transcript)


def _unanswered(frame: _Speech, by: Interrupt) -> _Speech:
    """Speech that ended before a barge-in keeps its place but asks for no reply."""
    return dataclasses.replace(frame, respond=False) if by.takes_turn else frame
