"""The live voice pipeline (what a ``/v1/realtime`` session runs), and one turn through it at
start-up.

``voice_pipeline`` builds the stages: resample to 16 kHz, VAD, ASR, LLM, sentences, TTS, with the
speculative first sentence shared by the LLM and TTS stages.

``warm_up`` speaks a question with the served voice and runs it through that pipeline as a live
turn, so the first real turn after start-up does not pay for first use, and the default
instructions' blocks are in the prefix cache for every session. On fresh servers here the first
voice turn's first audio came 486-565 ms after the end of speech with it, 659-716 ms without
(docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from engine.foreground import INTERACTIVE
from modalities.audio import ASR_RATE
from pipelines.conversation import Conversation
from pipelines.frames import AudioFrame, End, ErrorFrame, Frame, LLMDone, Transcript, TTSAudio, TTSDone
from pipelines.processor import Pipeline
from pipelines.reply import LLM, LLMOptions
from pipelines.services import ServiceMissing, Services
from pipelines.speculation import SpeechPrefetch
from pipelines.speech import ASR, TTS, VAD, ASROptions, Resample, Sentences, TTSOptions
from pipelines.turns import RECENT_ITEMS, JudgeTurns, TurnJudge
from pipelines.vad import VADConfig

logger = logging.getLogger("mmserve.pipelines")

WARM_UP_QUESTION = "Hello, can you hear me?"
WARM_UP_TIMEOUT_S = 60.0


def voice_pipeline(
    services: Services,
    conv: Conversation,
    vad: VADConfig,
    llm: LLMOptions,
    tts: TTSOptions,
    asr: ASROptions,
) -> Pipeline:
    """The stages of a live voice session over ``conv``; the options objects stay live (a
    ``session.update`` changes them in place)."""
    prefetch = SpeechPrefetch(services, tts)  # a speculative reply's first sentence
    turns = VAD(vad)
    return Pipeline(
        [
            Resample(ASR_RATE),
            turns,
            ASR(services, asr),
            LLM(services, conv, llm, prefetch, end_turn=turns.end_turn),
            Sentences(),
            TTS(services, tts, prefetch),
        ]
    )


def transcription_pipeline(
    services: Services, conv: Conversation, vad: VADConfig, asr: ASROptions, llm: LLMOptions
) -> Pipeline:
    """The stages of a transcription session (no replies): resample to 16 kHz, VAD, ASR, and the
    pauses judged for semantic VAD (``llm.end_of_turn_p``; with a served LLM)."""
    turns = VAD(vad)
    judge = TurnJudge(services, conv, lambda: llm.end_of_turn_p, turns.end_turn, lambda: llm.priority, RECENT_ITEMS)
    return Pipeline([Resample(ASR_RATE), turns, ASR(services, asr), JudgeTurns(judge)])


async def warm_up(engines: dict[str, Any]) -> bool:
    """One spoken turn through ``voice_pipeline`` with the default session settings, if an LLM,
    an ASR and a TTS engine are served (else nothing: False). Raises if the turn fails, hears
    nothing or takes over ``WARM_UP_TIMEOUT_S``."""
    try:
        services = Services.from_engines(engines)
    except ServiceMissing:
        return False
    t0 = time.monotonic()
    await asyncio.wait_for(_turn(services), WARM_UP_TIMEOUT_S)
    logger.info("warm-up voice turn: %.2f s", time.monotonic() - t0)
    return True


async def _turn(services: Services) -> None:
    tts = TTSOptions(priority=INTERACTIVE)
    question = [c async for c in services.speak(WARM_UP_QUESTION, None, tts.sample_rate, INTERACTIVE)]
    audio = np.concatenate([*question, np.zeros(tts.sample_rate, np.float32)])  # then 1 s of silence
    llm, asr = LLMOptions(max_tokens=16, priority=INTERACTIVE), ASROptions(priority=INTERACTIVE)
    pipeline = voice_pipeline(services, Conversation(), VADConfig(), llm, tts, asr)
    over = asyncio.Event()

    async def source() -> AsyncIterator[Frame]:
        step = tts.sample_rate // 25  # 40 ms appends, as a client streams (not paced)
        for i in range(0, audio.size, step):
            yield AudioFrame(audio[i : i + step], tts.sample_rate)
        await over.wait()
        yield End()

    spoken = 0
    async with contextlib.aclosing(pipeline.stream(source())) as frames:  # a raise stops the stages
        async for frame in frames:
            if isinstance(frame, ErrorFrame):
                raise RuntimeError(f"warm-up turn failed in {frame.stage}: {frame.message}")
            if isinstance(frame, LLMDone) and frame.error:
                raise RuntimeError(f"warm-up turn failed in the LLM: {frame.error}")
            if isinstance(frame, Transcript) and not frame.text:  # no reply would follow
                raise RuntimeError("the warm-up question was not heard")
            spoken += isinstance(frame, TTSAudio)
            if isinstance(frame, TTSDone):
                over.set()
    if not spoken:
        raise RuntimeError("warm-up turn produced no audio")
