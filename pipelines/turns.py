"""Semantic turn detection (Realtime's ``semantic_vad``): does the user's turn end at this pause?

The served LLM is asked how likely its chat template's end-of-message token is right after the
user's words so far, in the conversation: the idea of LiveKit's turn detector (a small LM scoring
the end of the user's turn), with the model already served and no extra weights. The words are
lower-cased and stripped of punctuation first, as LiveKit's detector reads them: Whisper ends a
cut-off sentence with "." or "?" as readily as a finished one ("What is the capital?"), and the
model believes the punctuation. So read, SmolLM2-135M puts the token's probability at 1e-8.3 to
1e-10.1 after ten cut-off sentences ("what is the weather in") and at 1e-7.6 to 1e-1.3 after
thirteen finished messages ("okay", "who wrote hamlet"); the default threshold lies between
(tests/test_realtime.py holds such cases). Heard through Whisper, a finished question may still
score low ("who wrote romeo and juliet", 1e-8.5) and a misheard cut-off one high ("can you tell
me the weather end", 1e-6.8): the eagerness moves the threshold as well as the longest wait.

A pause in speech gets its transcript early (``pipelines.speech.ASR``); the reply stage scores it
and, at or above the eagerness's threshold, the VAD stage ends the turn once
``VADConfig.complete_ms`` silent; otherwise the turn waits for more speech, up to the
eagerness's longest silence.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.offload import run_sized
from pipelines.conversation import Conversation
from pipelines.frames import Frame, SpeechResumed, Transcript
from pipelines.processor import Processor

logger = logging.getLogger("mmserve.pipelines")


@dataclass(frozen=True)
class Eagerness:
    """semantic_vad's ``eagerness``: how likely an end must be to end the turn at a pause, and
    the longest silence a turn that seems unfinished waits (OpenAI's documented maximum
    timeouts: 8 s for low, 4 s for medium and auto, 2 s for high)."""

    end_p: float
    wait_ms: int


EAGERNESS = {
    "low": Eagerness(1e-7, 8000),
    "medium": Eagerness(1e-8, 4000),
    "auto": Eagerness(1e-8, 4000),
    "high": Eagerness(1e-9, 2000),
}


def words(text: str) -> str:
    """``text`` as the turn detector reads it: lower case, no punctuation but apostrophes."""
    return " ".join(re.sub(r"[^\w\s']", " ", text).lower().split())


MARK = "\ue000"  # (a private-use character: no template or transcript writes it)


def _turn_prompt(answering: Conversation, tokenizer: Any) -> tuple[list[int], int] | None:
    """``answering`` (whose user message ends with ``MARK``) rendered up to that message's end
    (token ids), and the token the template writes next (its end of message); None when the
    render does not show the mark once."""
    rendered = answering.render_text(tokenizer)
    if rendered.count(MARK) != 1:
        return None
    head, tail = rendered.split(MARK)
    after = tokenizer(tail, add_special_tokens=False).input_ids
    return (tokenizer(head, add_special_tokens=False).input_ids, after[0]) if after else None


async def end_of_turn(engine: Any, conv: Conversation, text: str, priority: int = 0) -> float:
    """The probability that the user's message ends after ``text`` (0.0 when it cannot be told).
    One engine step: the end-of-message token is the only one allowed, and its logprob is
    taken before that restriction (``Sampler``: raw logprobs)."""
    from engine.sampling_params import SamplingParams

    text = words(text)
    if not text:
        return 0.0
    answering = conv.answering(text + MARK)  # (a copy, here: the live items change meanwhile)
    prompt = await run_sized(answering.chars(), _turn_prompt, answering, engine.tokenizer)
    if prompt is None:
        return 0.0
    ids, end = prompt
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, allowed_token_ids=[end], detokenize=False)
    final = None
    async for out in engine.generate(f"turn-{uuid.uuid4().hex[:12]}", ids, params, priority=priority):
        final = out
    logprobs = final.outputs[0].logprobs if final is not None else None
    return math.exp(logprobs[0].logprob) if logprobs else 0.0


# The items a transcription session's pause is judged with (``Conversation.recent``): its
# conversation only grows, and would outgrow the LLM's context (no verdict then).
RECENT_ITEMS = 32


class TurnJudge:
    """Judges pauses in the background: ``start(text, key)`` scores a pause's transcript
    (``end_of_turn``) and, at or above ``threshold()``, calls ``end_turn(key)`` (the VAD stage's
    ``end_turn``); ``stop()`` drops the verdict to come (speech resumed, the turn ended).
    ``recent``: judge with the conversation's recent items only (``Conversation.recent``)."""

    def __init__(
        self,
        services: Any,
        conversation: Conversation,
        threshold: Callable[[], float | None],
        end_turn: Callable[[int], None] | None,
        priority: Callable[[], int],
        recent: int | None = None,
    ) -> None:
        self.services, self.conversation, self.recent = services, conversation, recent
        self.threshold, self.end_turn, self.priority = threshold, end_turn, priority
        self.task: asyncio.Task[None] | None = None

    def start(self, text: str, key: int) -> None:
        self.stop()
        if self.threshold() is not None and self.end_turn is not None and text and self.services.llm is not None:
            self.task = asyncio.create_task(self._judge(text, key))

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def _judge(self, text: str, key: int) -> None:
        try:
            conv = self.conversation if self.recent is None else self.conversation.recent(self.recent)
            p = await end_of_turn(self.services.llm, conv, text, self.priority())
        except Exception:  # noqa: BLE001 - no verdict (e.g. a prompt past the context): the turn waits out its silence
            logger.debug("scoring the end of a turn failed", exc_info=True)
            return
        threshold = self.threshold()
        if threshold is not None and p >= threshold and self.end_turn is not None:
            self.end_turn(key)


class JudgeTurns(Processor):
    """Semantic VAD where no reply stage judges the pauses (a transcription session): a pause's
    tentative ``Transcript`` is judged (``TurnJudge``) and consumed; speech resuming or the turn's
    final transcript drops the verdict to come."""

    def __init__(self, judge: TurnJudge) -> None:
        self.judge = judge

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, Transcript) and frame.tentative:
            self.judge.start(frame.text, frame.turn_key)
            return
        if isinstance(frame, SpeechResumed | Transcript):
            self.judge.stop()
        yield frame

    def close(self) -> None:
        self.judge.stop()
