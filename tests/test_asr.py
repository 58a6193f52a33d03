"""ASR on the shared engine, with the real Whisper tiny.en (converted from the packaged CTranslate2
model) on real synthetic speech (Piper and eSpeak NG voices):

- greedy tokens equal transformers ``generate()`` on the same audio and prompt, decoded in one
  continuous batch with other clips;
- word error rate ≤ 10% on the fixed 20-sentence corpus for both voices, transcribed as one long
  recording (VAD → packed ≤30 s windows), with segment timestamps on the known sentence bounds;
- a long span with no pauses is split into overlapping windows and stitched with no lost or
  repeated words;
- streaming deltas concatenate to the final text; cross-attention K/V are freed after requests;
- preemption (a KV cache too small for the batch) recomputes to the same tokens.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import re
from collections.abc import Iterator
from typing import Any

import jiwer
import numpy as np
import pytest
import torch

from modalities.asr.engine import AsrConfig, AsrEngine, TranscriptionRequest
from modalities.asr.model import load_whisper
from modalities.asr.speech_corpus import SENTENCES, corpus, long_recording

RATE = 16_000


@pytest.fixture(scope="module")
def engine() -> Iterator[AsrEngine]:
    eng = AsrEngine(load_whisper("tiny.en"), AsrConfig(max_encoder_batch=4))
    yield eng
    asyncio.run(eng.shutdown())


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w' ]", " ", text.lower())).strip()


def _wer(ref: list[str], hyp: str) -> float:
    return float(jiwer.wer(_norm(" ".join(ref)), _norm(hyp)))


@functools.cache
def _pristine() -> Any:
    """The reference: the same checkpoint as loaded by transformers, untouched by the engine's
    module swaps (the engine prepacks its encoder's linears)."""
    return load_whisper("tiny.en")


def _reference_tokens(engine: AsrEngine, audio: np.ndarray, prompt_ids: list[int]) -> list[int]:
    w = _pristine()
    feats = w.feature_extractor(audio, sampling_rate=RATE, return_tensors="pt").input_features
    with torch.inference_mode():
        out = w.model.generate(
            feats, decoder_input_ids=torch.tensor([prompt_ids]), max_new_tokens=engine.config.max_new_tokens
        )[0].tolist()
    # Depending on the inputs, generate() may echo the prompt (or all but its first token) first.
    for head in (prompt_ids, prompt_ids[1:]):
        if out[: len(head)] == head:
            out = out[len(head) :]
            break
    eos = w.model.generation_config.eos_token_id
    return [t for t in out if t != eos]


async def test_greedy_tokens_match_transformers_generate(engine: AsrEngine) -> None:
    piper, espeak = corpus("piper"), corpus("espeak")
    clips = [piper[0], espeak[3], piper[12]]
    prompt = engine.prompt_ids()
    got = await asyncio.gather(*(engine.decode_tokens(c, prompt) for c in clips))  # one batch
    for clip, tokens in zip(clips, got, strict=True):
        assert len(tokens) > 5
        assert tokens == _reference_tokens(engine, clip, prompt)
    # A text prompt (<|startofprev|> ...) takes the same path on both sides.
    with_prompt = engine.prompt_ids(prompt="Fox and dog.")
    assert with_prompt[0] == engine.whisper.tokenizer.convert_tokens_to_ids("<|startofprev|>")
    assert await engine.decode_tokens(clips[0], with_prompt) == _reference_tokens(engine, clips[0], with_prompt)


@pytest.mark.parametrize("voice", ["piper", "espeak"])
async def test_wer_and_segment_timestamps_on_long_recording(engine: AsrEngine, voice: str) -> None:
    audio, bounds = long_recording(voice, gap_s=1.0)
    assert len(audio) / RATE > 60  # several windows
    transcript = await engine.run(TranscriptionRequest(audio))
    wer = _wer(SENTENCES, transcript.text)
    assert wer <= 0.10, (wer, transcript.text)
    segs = transcript.segments
    assert len(segs) >= 3 and all(s.end - s.start <= 30.0 for s in segs)
    assert abs(transcript.duration - len(audio) / RATE) < 1e-6
    # Every sentence lies inside exactly one segment, and that segment's text holds its last word
    # (windows are cut in the pauses, so no sentence is split).
    for sentence, (start, end) in zip(SENTENCES, bounds, strict=True):
        owners = [s for s in segs if s.start - 0.35 <= start and end <= s.end + 0.35]
        assert len(owners) == 1, (sentence, start, end, [(s.start, s.end) for s in segs])
    # Segment bounds sit on speech: each starts near its first sentence and ends near its last.
    for s in segs:
        inside = [(a, b) for a, b in bounds if s.start - 0.35 <= a and b <= s.end + 0.35]
        assert abs(s.start - inside[0][0]) < 0.35 and abs(s.end - inside[-1][1]) < 0.35


async def test_long_span_is_split_with_overlap_and_stitched(engine: AsrEngine) -> None:
    # 0.25 s gaps and no VAD: one 55 s span, cut into overlapping windows at quiet points.
    audio, _ = long_recording("piper", gap_s=0.25)
    transcript = await engine.run(TranscriptionRequest(audio, vad=False))
    assert len(transcript.segments) >= 2
    assert transcript.segments[1].start < transcript.segments[0].end  # the windows overlap
    ref, hyp = _norm(" ".join(SENTENCES)).split(), _norm(transcript.text).split()
    assert _wer(SENTENCES, transcript.text) <= 0.05, transcript.text
    assert abs(len(hyp) - len(ref)) <= 2  # nothing lost or doubled at the cut


async def test_stream_deltas_build_the_final_text(engine: AsrEngine) -> None:
    audio, _ = long_recording("piper", gap_s=1.0, sentences=range(3))
    deltas, final = [], None
    async for d in engine.stream(TranscriptionRequest(audio)):
        if d.transcript is not None:
            final = d.transcript
        else:
            deltas.append(d.text)
    assert final is not None and len(deltas) > 3  # word by word, not one blob
    assert "".join(deltas) == final.text
    assert final.text == (await engine.transcribe(audio)).text


async def test_cross_attention_cache_released_and_bad_language(engine: AsrEngine) -> None:
    await engine.transcribe(corpus("piper")[1])
    gc.collect()
    assert engine.adapter.num_cached_cross == 0
    with pytest.raises(ValueError, match="English-only"):
        await engine.transcribe(corpus("piper")[1], language="de")
    silence = np.zeros(RATE * 40, np.float32)  # no speech at all: VAD finds nothing
    assert (await engine.transcribe(silence)).text == ""


async def test_preemption_under_a_tiny_kv_cache_gives_the_same_tokens(engine: AsrEngine) -> None:
    small = AsrEngine(engine.whisper, AsrConfig(kv_cache_mb=1))  # 5 blocks of 16 tokens
    try:  # 3 clips of ~40 tokens each: 9 blocks wanted at once
        clips = [long_recording("piper", 0.3, range(i, i + 3))[0] for i in (4, 8, 12)]
        prompt = small.prompt_ids()
        # Hold every clip until all three are encoded, so their decodes overlap in the engine
        # (otherwise a fast first decode can finish before the others start: no preemption).
        encode, encoded = small._encode, asyncio.Barrier(len(clips))

        async def encode_together(audio: np.ndarray) -> object:
            out = await encode(audio)
            await encoded.wait()
            return out

        small._encode = encode_together  # type: ignore[method-assign]
        got = await asyncio.gather(*(small.decode_tokens(c, prompt) for c in clips))
        assert small.stats()["decoder_num_preemptions"] > 0
        assert got == [await engine.decode_tokens(c, prompt) for c in clips]
    finally:
        await small.shutdown()
