"""ASR on the shared engine, with the real Whisper tiny.en (converted from the packaged CTranslate2
model) on real synthetic speech (Piper and eSpeak NG voices):

- greedy tokens equal transformers ``generate()`` on the same audio and prompt, decoded in one
  continuous batch with other clips;
- word error rate ≤ 10% on the fixed 20-sentence corpus for both voices, transcribed as one long
  recording (VAD → packed ≤30 s windows), with segment timestamps on the known sentence bounds;
- a long span with no pauses is split into overlapping windows and stitched with no lost or
  repeated words;
- streaming deltas concatenate to the final text; cross-attention K/V are freed after requests;
- preemption (a KV cache too small for the batch) recomputes to the same tokens;
- Whisper's per-window figures: no-speech probability equals transformers' at the
  <|startoftranscript|> position, avg_logprob equals whisper's formula over ``generate()``'s scores;
  temperature fallback on a window the model cannot read (reversed speech), seeded and
  reproducible; a noise window is judged silent and yields no text; when every temperature
  fails, the last decode stands, or with ``fallback_keep="best"`` the most likely one.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import gc
import itertools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.cpu_linear import HalfStoredLinear
from engine.foreground import FOREGROUND, INTERACTIVE
from engine.native import f16_linear_kernel
from modalities.asr.engine import AsrConfig, AsrEngine, TranscriptionRequest
from modalities.asr.longform import Window
from modalities.asr.model import load_whisper
from modalities.asr.quality import WindowResult, kept
from modalities.asr.speech_corpus import SENTENCES, corpus, long_recording, normalize_text, word_error_rate
from tests.helpers import DEADLINE_S, until

RATE = 16_000


@pytest.fixture(scope="module")
def engine() -> Iterator[AsrEngine]:
    eng = AsrEngine(load_whisper("tiny.en"), AsrConfig(max_encoder_batch=4))
    yield eng
    asyncio.run(eng.shutdown())


def _wer(ref: list[str], hyp: str) -> float:
    return word_error_rate([" ".join(ref)], [hyp])


@functools.cache
def _pristine() -> Any:
    """The reference: the same checkpoint as loaded by transformers, untouched by the engine's
    module swaps (the engine prepacks its encoder's linears)."""
    return load_whisper("tiny.en")


def _reference_tokens(engine: AsrEngine, audio: np.ndarray, prompt_ids: list[int]) -> list[int]:
    return generate_tokens(_pristine(), audio, prompt_ids, engine.config.max_new_tokens)


def generate_tokens(w: Any, audio: np.ndarray, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers ``generate()`` of Whisper ``w`` (a ``WhisperModel``, on its own device):
    the tokens after the prompt, eos excluded."""
    dev = w.model.device
    feats = w.feature_extractor(audio, sampling_rate=RATE, return_tensors="pt").input_features.to(dev)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=dev)
        out = w.model.generate(feats, decoder_input_ids=ids, max_new_tokens=max_new_tokens)[0].tolist()
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
    if f16_linear_kernel() is not None:  # tiny.en's weights are fp16 values: its head reads an fp16 copy
        assert isinstance(engine.adapter._head, HalfStoredLinear)
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


async def test_sentence_segments_are_cues_at_the_sentences_times(engine: AsrEngine) -> None:
    """``sentence_segments`` (srt, vtt, verbose_json): a segment per sentence, at its words'
    times, each with its window's figures and its own tokens."""
    audio, bounds = long_recording("piper", gap_s=1.0)
    t = await engine.run(TranscriptionRequest(audio, sentence_segments=True))
    assert t.words is None  # (not asked for)
    assert len(t.segments) == len(SENTENCES), [s.text for s in t.segments]
    for seg, (start, end) in zip(t.segments, bounds, strict=True):
        assert abs(seg.start - start) < 0.5 and abs(seg.end - end) < 0.5, (seg, start, end)
        assert engine.whisper.tokenizer.decode(seg.tokens).strip() == seg.text and seg.avg_logprob < 0
    assert [s.id for s in t.segments] == list(range(len(SENTENCES)))
    assert " ".join(s.text for s in t.segments) == t.text


def test_words_heard_counts_the_words_of_scripts_written_without_spaces() -> None:
    """Whether a window's text stopped early goes by words a second (``MIN_WORDS_PER_S``): 8 s
    of Chinese at an everyday 4 characters a second is not one that did (it was, counted by
    spaces: one "word"), and pays no alignment pass."""
    from modalities.asr.engine import MIN_WORDS_PER_S
    from modalities.asr.quality import words_heard

    chinese = "今天天气很好我们去公园散步吧" + "明天我们一起去看电影好不好" + "晚上七点在门口见面"  # 36 characters
    assert words_heard(chinese) == 36 / 1.5 and words_heard(chinese) > MIN_WORDS_PER_S * 8
    assert len(chinese.split()) < MIN_WORDS_PER_S * 8  # (the old count)
    assert words_heard("Hello there, how are you?") == 5
    assert words_heard("日本の 首都 is Tokyo") == pytest.approx(5 / 1.5 + 2)


def test_sentence_segments_cut_at_sentence_ends_and_pauses() -> None:
    from modalities.asr.longform import sentence_segments
    from modalities.asr.types import Segment, Word

    seg = Segment(0, 0.5, 9.0, "Hi there. So, well it is late", [1, 2], -0.2, 0.0, 1.1, 0.01)
    times = [(0.6, 0.8), (0.8, 1.2), (1.5, 1.7), (1.7, 2.0), (4.0, 4.3), (4.3, 4.5), (4.5, 8.9)]
    words = [Word(w, a, b) for w, (a, b) in zip(seg.text.split(), times, strict=True)]
    out = sentence_segments([seg], words, lambda text: [len(text)])
    assert [(s.id, s.start, s.end, s.text, s.tokens) for s in out] == [
        (0, 0.5, 1.2, "Hi there.", [9]),
        (1, 1.5, 2.0, "So, well", [8]),  # (a pause of 2 s next)
        (2, 4.0, 9.0, "it is late", [10]),
    ]
    assert all(s.avg_logprob == -0.2 and s.compression_ratio == 1.1 for s in out)
    assert sentence_segments([seg], words[:-1], len) == [seg]  # (words that do not match: as they are)


async def test_long_span_is_split_with_overlap_and_stitched(engine: AsrEngine) -> None:
    # 0.25 s gaps and no VAD: one 55 s span, cut into overlapping windows at quiet points.
    audio, _ = long_recording("piper", gap_s=0.25)
    transcript = await engine.run(TranscriptionRequest(audio, vad=False, logprobs=True))
    assert len(transcript.segments) >= 2
    # the logprobs are those of the kept words' tokens: the overlap's, once
    assert transcript.logprobs is not None and all(lp.logprob <= 0 for lp in transcript.logprobs)
    assert "".join(lp.token for lp in transcript.logprobs).split() == transcript.text.split()
    assert all(bytes(lp.bytes).decode() == lp.token for lp in transcript.logprobs)
    # the windows overlap; their segments meet in the middle of the overlap instead
    windows = engine._windows(audio, False)
    assert windows[1].overlaps_prev and windows[1].start < windows[0].end
    assert transcript.segments[1].start == transcript.segments[0].end
    assert transcript.segments[0].end == round((windows[1].start + windows[0].end) / 2, 3)
    assert transcript.segments[0].start == 0.0 and transcript.segments[-1].end == round(windows[-1].end, 3)
    ref, hyp = normalize_text(" ".join(SENTENCES)).split(), normalize_text(transcript.text).split()
    assert _wer(SENTENCES, transcript.text) <= 0.05, transcript.text
    # Nothing lost or doubled at the cut: no run of words missing or repeated (tiny.en's own
    # slips, "sea shells" -> "seashells", change the count by one word at a time).
    edits = difflib.SequenceMatcher(a=ref, b=hyp, autojunk=False).get_opcodes()
    assert max(abs((i2 - i1) - (j2 - j1)) for _, i1, i2, j1, j2 in edits) <= 1, edits


async def test_a_window_whose_text_stops_early_is_decoded_on(engine: AsrEngine) -> None:
    """Speech cut mid-sentence at both ends (tests/data/stops_early.flac, Piper, 7.5 s) on which
    tiny.en's decode ends at 3.8 s ("... envelopes local") and says nothing of the last 3.5 s: the
    rest of the window, from its last word on, is decoded too and joined, its words timed."""
    import soundfile as sf

    audio, rate = sf.read(Path(__file__).parent / "data" / "stops_early.flac", dtype="float32")
    assert rate == RATE
    first = await engine.decode_tokens(audio, engine.prompt_ids())  # the decode alone (generate()'s)
    assert engine.whisper.tokenizer.decode(first).split()[-1].lower() == "local"
    before = engine.num_rest_decodes
    t = await engine.run(TranscriptionRequest(audio, word_timestamps=True, logprobs=True))
    assert engine.num_rest_decodes > before
    assert t.logprobs is not None and "".join(lp.token for lp in t.logprobs).split() == t.text.split()  # (joined too)
    words = normalize_text(t.text).split()
    assert words[:4] == ["trade", "tomato", "and", "bean"] and "homework" in words, t.text
    assert words.count("local") == 1 and words[-3:-1] == ["and", "many"], t.text  # (the last one is cut)
    assert t.words is not None and [w.word for w in t.words] == t.text.split()
    assert all(a.end <= b.start + 1e-6 for a, b in itertools.pairwise(t.words)) and t.words[-1].end <= 7.5
    homework = next(w for w in t.words if "homework" in w.word)
    assert 6.0 < homework.start < 6.8  # (said at 6.38 s)
    # Speech then 8 s of silence: nothing is decoded on (Whisper would make words of the silence).
    quiet = np.concatenate([audio[: 3 * RATE], np.zeros(8 * RATE, np.float32)])
    before = engine.num_rest_decodes
    t = await engine.run(TranscriptionRequest(quiet, vad=False))
    assert engine.num_rest_decodes == before and normalize_text(t.text).split()[-2:] == ["paper", "envelopes"]


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


async def test_a_long_span_split_in_windows_streams_as_it_decodes(engine: AsrEngine) -> None:
    """One span of speech longer than a window (overlapping windows, stitched): its text streams
    while the windows decode, all but the words a stitch may drop, and builds the final text."""
    from modalities.asr.longform import stable_spans, stable_text

    audio, _ = long_recording("piper", gap_s=0.25)
    req = TranscriptionRequest(audio, vad=False, logprobs=True)
    assert len(engine._windows(audio, False)) >= 2
    deltas, final = [], None
    async for d in engine.stream(req):
        if d.transcript is not None:
            final = d.transcript
        else:
            deltas.append(d)
    assert final is not None and "".join(d.text for d in deltas) == final.text
    assert len(deltas) > 10  # word by word (before: the whole text once every window was done)
    # Each delta's token logprobs spell it (the first's with a leading space), across the stitch.
    for i, d in enumerate(deltas):
        assert "".join(lp.token for lp in d.logprobs or []) == (" " if i == 0 else "") + d.text
    assert [lp for d in deltas for lp in d.logprobs or []] == final.logprobs
    # The stitch only ever drops the last words of the earlier window: held back until it is done.
    windows = [Window(0.0, 30.0), Window(28.0, 40.0, overlaps_prev=True)]
    one, two = "a b c d e f g h i j k l m n o p", "m n o p q r"
    assert stable_text([one, ""], stable_spans(windows, [one, ""], [False, False])) == "a b c d"
    assert stable_text([one, "m n"], stable_spans(windows, [one, "m n"], [True, False])) == "a b c d"
    assert (
        stable_text([one, two], stable_spans(windows, [one, two], [True, True]))
        == "a b c d e f g h i j k l m n o p q r"
    )


def test_delta_logprobs_are_the_new_words_tokens_counted_in_bytes(engine: AsrEngine) -> None:
    """The stream's bookkeeping (no decoding; the real tokenizer): a delta gets the tokens of the
    words it adds; a fallback decode that splits words already sent into other tokens sends none
    of them again; a live text its tokens do not spell holds its tokens back until its window is
    done; the transcript's tokens not yet sent come last; a decode that lengthens the last word
    sent ("cat" -> "category") is no delta; a window decoded again after its text went out adds
    no tokens at the end."""
    from modalities.asr.assemble import DeltaLogprobs, TranscriptSoFar
    from modalities.asr.longform import stable_spans
    from modalities.asr.types import Transcript

    tok, eos = engine.whisper.tokenizer, engine._eos

    def decoded(*pieces: str) -> tuple[list[int], list[float]]:
        ids = [t for p in pieces for t in tok(p, add_special_tokens=False).input_ids]
        return ids, [-0.01 * (k + 1) for k in range(len(ids))]

    def spelled(lps: list[Any]) -> str:
        return "".join(lp.token for lp in lps)

    windows = [Window(0.0, 5.0), Window(6.0, 10.0)]
    deltas = DeltaLogprobs(tok, eos)

    def step(texts: list[str], done: list[bool], *dec: tuple[list[int], list[float]]) -> str:
        return spelled(deltas.of_stable(stable_spans(windows, texts, done), texts, done, list(dec)))

    assert (
        step([" What is the capital", ""], [False, False], decoded(" What is the capital"), ([], [])) == " What is the"
    )
    # A fallback decode says the same words in other tokens (" th" "e"): only the new words' go out.
    live = decoded(" What is", " th", "e", " cap", "ital", " of France")
    assert step([" What is the capital of France", ""], [False, False], live, ([], [])) == " capital of"
    final = decoded(" What is the capital of France?")
    texts = ["What is the capital of France?", " Paris is big and"]
    assert step(texts, [True, False], final, decoded(" Lyon")) == " France?"  # (window 1's tokens: held back)
    second = decoded(" Paris is big and old.")
    assert step([texts[0], "Paris is big and old."], [True, True], final, second) == " Paris is big and old."
    # The transcript's tokens past those sent come last (none, or here one more window's).
    assert deltas.rest(Transcript("", [], "en", 10.0, None, _all(tok, eos, final, second))) == []
    rest = deltas.rest(Transcript("", [], "en", 15.0, None, _all(tok, eos, final, second, decoded(" Hi."))))
    assert spelled(rest) == " Hi."
    # The live text as a stream sees it: a lengthened last word is not a delta.
    so_far = TranscriptSoFar(TranscriptionRequest(np.zeros(16_000, np.float32)), windows, tok, eos)
    assert (d := so_far.update(0, " the cat sat", None, ([], []))) is not None and d.text == "the cat"
    assert so_far.update(0, " the category is", None, ([], [])) is None
    assert (d := so_far.update(0, " the cat sat on", None, ([], []))) is not None and d.text == " sat"
    # Two spaces in a decode: the live words keep them, so the done text goes on from them (the
    # stream stalled there when a part of a text was rebuilt with single spaces).
    so_far = TranscriptSoFar(TranscriptionRequest(np.zeros(16_000, np.float32)), windows[:1], tok, eos)
    assert (d := so_far.update(0, " the cat  sat on", None, ([], []))) is not None and d.text == "the cat  sat"
    kept = WindowResult("the cat  sat on.", [], 0.2, -0.5, 1.0, 0.0)
    assert (d := so_far.update(0, kept.text, kept, ([], []))) is not None and d.text == " on."
    assert [d.text for d in so_far.finish()] == [""]
    # A window decoded again after its live text went out (it failed the checks at its end): the
    # stream ends with the done item alone, no tokens of a text that was never sent.
    req = TranscriptionRequest(np.zeros(16_000, np.float32), logprobs=True)
    so_far = TranscriptSoFar(req, windows[:1], tok, eos)
    assert (d := so_far.update(0, " the cat sat on", None, decoded(" the cat sat on"))) is not None
    assert spelled(d.logprobs or []) == " the cat sat"
    ids, lps = decoded(" A dog ran.")
    so_far.update(0, "A dog ran.", WindowResult("A dog ran.", ids, 0.2, -0.5, 1.0, 0.0, token_logprobs=lps), (ids, lps))
    *deltas_left, done = so_far.finish()
    assert deltas_left == [] and done.transcript is not None and done.transcript.text == "A dog ran."
    assert spelled(done.transcript.logprobs or []) == " A dog ran."


def test_a_window_decoded_again_after_its_words_went_out_does_not_stop_the_stream(engine: AsrEngine) -> None:
    """A window whose live words went out is kept with other words (a fallback decode): the
    client keeps its words, gets the kept decode's words past as many (and their tokens), then
    every later window as it comes; the deltas differ from the done text in that window only,
    and their tokens add up to the deltas' text."""
    from modalities.asr.assemble import TranscriptSoFar

    tok, eos = engine.whisper.tokenizer, engine._eos

    def decoded(text: str) -> tuple[list[int], list[float]]:
        ids = tok(text, add_special_tokens=False).input_ids
        return ids, [-0.01 * (k + 1) for k in range(len(ids))]

    def kept(text: str) -> tuple[WindowResult, tuple[list[int], list[float]]]:
        ids, lps = decoded(" " + text)
        return WindowResult(text, ids, 1.0, -0.5, 1.0, 0.0, token_logprobs=lps), (ids, lps)

    windows = [Window(0.0, 5.0), Window(6.0, 10.0), Window(11.0, 15.0)]
    so_far = TranscriptSoFar(TranscriptionRequest(np.zeros(16 * 15_000, np.float32), logprobs=True), windows, tok, eos)
    out = [so_far.update(0, " the cat sat on", None, decoded(" the cat sat on"))]
    assert out[-1] is not None and out[-1].text == "the cat sat"
    out.append(so_far.update(0, "A dog ran off home.", *kept("A dog ran off home.")))
    assert out[-1] is not None and out[-1].text == " off home."  # (its first 3 words count as sent)
    out.append(so_far.update(1, " Then we left", None, decoded(" Then we left")))
    out.append(so_far.update(1, "Then we left.", *kept("Then we left.")))
    out.append(so_far.update(2, "Bye.", *kept("Bye.")))
    *rest, done = so_far.finish()
    deltas = [d for d in [*out, *rest] if d is not None]
    said = "".join(d.text for d in deltas)
    assert said == "the cat sat off home. Then we left. Bye."
    assert done.transcript is not None and done.transcript.text == "A dog ran off home. Then we left. Bye."
    assert "".join(lp.token for d in deltas for lp in d.logprobs or []) == " " + said

    def said_by(windows: list[Window], *updates: tuple[int, str, bool]) -> str:
        so_far = TranscriptSoFar(TranscriptionRequest(np.zeros(16 * 55_000, np.float32)), windows, tok, eos)
        out = [so_far.update(i, text, kept(text)[0] if done else None, ([], [])) for i, text, done in updates]
        return "".join(d.text for d in [*out, *so_far.finish()] if d is not None)

    # Kept as silence: the client's words stay, the next window's come after a space.
    two = [Window(0.0, 5.0), Window(6.0, 10.0)]
    got = said_by(
        two, (0, " the cat sat on", False), (0, "", True), (1, " Then we left", False), (1, "Then we left.", True)
    )
    assert got == "the cat sat Then we left."

    # Overlapping windows: 28 of 40 live words went out (12 wait for the stitch); the kept decode
    # has 30; the stitch with the next window keeps them all: the stream goes on from word 29.
    def words(n: int, p: str) -> str:
        return " ".join(f"{p}{k}" for k in range(n))

    chain = [Window(0.0, 30.0), Window(25.0, 55.0, overlaps_prev=True)]
    later = " ".join(words(30, "k").split()[-5:]) + " " + words(20, "b")
    got = said_by(chain, (0, words(40, "x"), False), (0, words(30, "k"), True), (1, later, True))
    assert got == words(28, "x") + " k28 k29 " + words(20, "b")


def _all(tok: Any, eos: int, *decodes: tuple[list[int], list[float]]) -> list[Any]:
    """Every token of whole-window ``decodes`` (``span_logprobs``)."""
    from modalities.asr.alignment import span_logprobs

    out: list[Any] = []
    for ids, lps in decodes:
        text = tok.decode(ids)
        out += span_logprobs(tok, ids, lps, text, 0, len(text.split()), eos) or []
    return out


def test_batched_cross_attention_equals_one_call_per_sequence(engine: AsrEngine) -> None:
    """A GPU's batched cross-attention (padded queries, stacked K/V) gives what the CPU's call per
    sequence gives, in a step mixing prompt rows and decode rows."""
    a, g = engine.adapter, torch.Generator().manual_seed(0)
    cross = [torch.randn(a.num_layers, 2, a.num_heads, 50, a.head_dim, generator=g) for _ in range(3)]
    spans, cq = [0, 3, 4, 6], torch.randn(a.num_heads, 6, a.head_dim, generator=g)
    one, batched = a.cross_attention(cross, spans, batched=False), a.cross_attention(cross, spans, batched=True)
    for i in range(a.num_layers):
        torch.testing.assert_close(batched(i, cq), one(i, cq))
    # The stacked K/V are reused while the batch is the same and rebuilt when it changes.
    assert a._stacked is not None
    held = a._stacked[1]
    a.cross_attention(list(cross), spans, batched=True)
    assert a._stacked[1] is held
    a.cross_attention(cross[:2], [0, 1, 2], batched=True)
    assert a._stacked[1] is not held
    # The stacked copy goes as soon as one of its requests ends (its encoder output is freed).
    gc.collect()  # earlier tests' encoder outputs go now, not between the counts below
    cached = a.num_cached_cross
    encs = [torch.randn(50, a.hidden_size, generator=g) for _ in range(2)]
    a.cross_attention([a.cross_kv(e) for e in encs], [0, 1, 2], batched=True)
    assert a._stacked is not None and a.num_cached_cross == cached + 2
    del encs[0]
    gc.collect()
    assert a._stacked is None and a.num_cached_cross == cached + 1


def _pause_first_pass() -> tuple[threading.Event, threading.Event, Callable[..., None]]:
    """(started, go, hook): a layer pre-hook that holds the first pass reaching it until ``go`` is
    set (``started`` says one got there); later passes go through."""
    started, go = threading.Event(), threading.Event()

    def pause_once(*_: Any) -> None:
        if not started.is_set():
            started.set()
            go.wait(DEADLINE_S)

    return started, go, pause_once


async def test_an_abandoned_encoder_pass_stops_at_the_next_layer(engine: AsrEngine) -> None:
    """A cancelled caller (a voice turn's speculative ASR when speech resumes) stops the encoder
    batch it alone waits for: later layers never run, and the next call is served normally."""
    layers = engine.whisper.model.model.encoder.layers
    started, go, pause_once = _pause_first_pass()
    ran: list[int] = []
    hooks = [layers[0].register_forward_pre_hook(pause_once)]
    hooks += [layer.register_forward_hook(lambda *_, i=i: ran.append(i)) for i, layer in enumerate(layers)]
    clip = corpus("piper")[0]
    prompt = engine.prompt_ids()
    abandoned = engine.encoder.num_abandoned
    try:
        task = asyncio.create_task(engine.decode_tokens(clip, prompt))
        assert await asyncio.to_thread(started.wait, DEADLINE_S)
        task.cancel()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: engine.encoder.num_abandoned > abandoned, "the pass ends on the worker thread")
        assert engine.encoder.num_abandoned == abandoned + 1
        assert ran == [0]
    finally:
        go.set()
        hooks[0].remove()
    ran.clear()
    try:
        assert await engine.decode_tokens(clip, prompt) == _reference_tokens(engine, clip, prompt)
        assert ran == list(range(len(layers)))
    finally:
        for h in hooks[1:]:
            h.remove()


async def test_an_abandoned_pass_stops_only_its_own_batcher(engine: AsrEngine) -> None:
    """Engines share one model: one engine's abandoned pass must not stop another engine's pass
    running at the same time (whose callers would then wait forever)."""
    other = AsrEngine(engine.whisper, AsrConfig(kv_cache_mb=1))
    layers = engine.whisper.model.model.encoder.layers
    started, go, pause_once = _pause_first_pass()

    hook = layers[0].register_forward_pre_hook(pause_once)
    clip, prompt = corpus("piper")[0], engine.prompt_ids()
    stuck = asyncio.create_task(engine._encode(clip, prompt))
    try:
        assert await asyncio.to_thread(started.wait, DEADLINE_S)
        stuck.cancel()  # the engine's pass, paused in layer 0, now waits for nobody
        enc, _ = await asyncio.wait_for(other._encode(clip, prompt), DEADLINE_S)
        assert enc.shape == (engine.whisper.model.config.max_source_positions, engine.adapter.hidden_size)
    finally:
        go.set()
        hook.remove()
        with contextlib.suppress(asyncio.CancelledError):
            await stuck
        await other.shutdown()


async def test_closing_the_encoder_cancels_its_callers(engine: AsrEngine) -> None:
    """A pass in flight and a window queued behind it when the engine shuts down: both callers
    are cancelled rather than left waiting."""
    other = AsrEngine(engine.whisper, AsrConfig(kv_cache_mb=1))
    started, go, pause_once = _pause_first_pass()

    hook = engine.whisper.model.model.encoder.layers[0].register_forward_pre_hook(pause_once)
    clip, prompt = corpus("piper")[0], engine.prompt_ids()
    try:
        running = asyncio.create_task(other._encode(clip, prompt))
        assert await asyncio.to_thread(started.wait, DEADLINE_S)
        queued = asyncio.create_task(other._encode(clip, prompt))
        await until(lambda: other.encoder.num_queued == 1, "queued")
        await other.shutdown()
        for task in (running, queued):
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, DEADLINE_S)
    finally:
        go.set()
        hook.remove()


async def test_interactive_windows_are_encoded_first_and_alone(engine: AsrEngine) -> None:
    """Windows queued while a bulk pass of two runs: the interactive ones (voice turns) are
    encoded after that pass's current step (on a CPU one window's layer), one per pass, and are
    done before it; the bulk ones then share a pass (the fixture batches up to 4)."""
    layers = engine.whisper.model.model.encoder.layers
    started, go, pause_once = _pause_first_pass()
    names = ["running1", "running2", "bulk1", "bulk2", "voice1", "voice2"]
    clips = {name: corpus("piper")[i] for i, name in enumerate(names)}
    ids = {id(clip): name for name, clip in clips.items()}
    events: list[Any] = []  # a pass's windows as it begins; the batch size of each layer-0 step
    done: list[str] = []
    begin = engine.encoder.begin

    def recording(jobs: list[Any]) -> Any:
        events.append([ids[id(audio)] for audio, _ in jobs])
        return begin(jobs)

    async def encode(name: str, priority: int = 0) -> None:
        await engine._encode(clips[name], prompt, priority)
        done.append(name)

    engine.encoder.begin = recording  # type: ignore[method-assign]
    hooks = [layers[0].register_forward_pre_hook(lambda _, args: events.append(args[0].shape[0]))]
    hooks.append(layers[0].register_forward_pre_hook(pause_once))
    prompt = engine.prompt_ids()
    try:
        running = [asyncio.create_task(encode(name)) for name in ("running1", "running2")]
        assert await asyncio.to_thread(started.wait, DEADLINE_S)
        queued = [
            asyncio.create_task(encode(name, priority))
            for name, priority in (("bulk1", 0), ("voice1", INTERACTIVE), ("bulk2", 0), ("voice2", INTERACTIVE))
        ]
        await until(lambda: engine.encoder.num_queued == 4, "all four queued")
        go.set()
        await asyncio.gather(*running, *queued)
    finally:
        go.set()
        for h in hooks:
            h.remove()
        del engine.encoder.begin
    assert [e for e in events if isinstance(e, list)] == [
        ["running1", "running2"],
        ["voice1"],
        ["voice2"],
        ["bulk1", "bulk2"],
    ]
    assert events[:3] == [["running1", "running2"], 1, ["voice1"]]  # one window's layer, then the voice
    assert done[:4] == ["voice1", "voice2", "running1", "running2"]


async def test_bulk_encoder_steps_wait_for_a_foreground_hold(engine: AsrEngine) -> None:
    """While a TTS first piece holds the foreground, a bulk pass runs no layer (here up to 30 s);
    a voice window arriving while it waits runs at once. The bulk pass goes on once the hold ends."""
    other = AsrEngine(engine.whisper, AsrConfig(kv_cache_mb=1, foreground_wait_s=30.0))
    ran: list[int] = []
    hook = engine.whisper.model.model.encoder.layers[0].register_forward_pre_hook(
        lambda _, args: ran.append(args[0].shape[0])
    )
    began = threading.Event()
    begin = other.encoder.begin

    def recording(jobs: list[Any]) -> Any:
        out = begin(jobs)
        began.set()
        return out

    other.encoder.begin = recording  # type: ignore[method-assign]
    clip, prompt = corpus("piper")[0], engine.prompt_ids()
    try:
        with FOREGROUND.hold():
            bulk = asyncio.create_task(other._encode(clip, prompt))
            assert await asyncio.to_thread(began.wait, DEADLINE_S)
            await asyncio.sleep(0.5)  # the bulk pass now waits for the hold; unheld, it would be done
            assert ran == [] and not bulk.done()
            began.clear()
            await asyncio.wait_for(other._encode(clip, prompt, INTERACTIVE), 5.0)  # not held back
            assert began.is_set() and ran == [1] and not bulk.done()
        enc, _ = await asyncio.wait_for(bulk, DEADLINE_S)
        assert ran == [1, 1] and enc.shape[0] == engine.whisper.model.config.max_source_positions
    finally:
        hook.remove()
        await other.shutdown()


async def test_voice_decodes_are_admitted_before_queued_bulk_ones(engine: AsrEngine) -> None:
    """One decoder slot, three decodes submitted together: the interactive one (a voice turn)
    goes ahead of the waiting bulk one (the first bulk one may have started before it came)."""
    other = AsrEngine(engine.whisper, AsrConfig(kv_cache_mb=1, max_num_seqs=1))
    prompt = engine.prompt_ids()
    order: list[str] = []

    async def decode(name: str, enc: Any, priority: int) -> None:
        async for *_, finished, _ in other._generate(enc, prompt, 0.0, priority=priority):
            if finished:
                order.append(name)

    try:
        await other.start()
        encs = [(await other._encode(corpus("piper")[i], prompt))[0] for i in range(3)]
        await asyncio.wait_for(
            asyncio.gather(
                decode("bulk1", encs[0], 0), decode("bulk2", encs[1], 0), decode("voice", encs[2], INTERACTIVE)
            ),
            DEADLINE_S,
        )
    finally:
        await other.shutdown()
    assert order in (["voice", "bulk1", "bulk2"], ["bulk1", "voice", "bulk2"])


async def test_the_stepped_encoder_pass_equals_the_encoder(engine: AsrEngine) -> None:
    """The batcher runs ``WhisperEncoder.forward`` a step at a time (on a CPU a window at a time):
    each window's output is bit-identical to the encoder's on that window."""
    clips = [corpus("piper")[i] for i in range(2)]
    prompt = engine.prompt_ids()
    outs = await asyncio.gather(*(engine._encode(clip, prompt) for clip in clips))  # one bulk pass
    for clip, (out, no_speech) in zip(clips, outs, strict=True):
        feats = engine.whisper.feature_extractor([clip], sampling_rate=16_000, return_tensors="pt")
        with torch.inference_mode():
            ref = engine.whisper.model.model.encoder(input_features=feats.input_features).last_hidden_state
        assert torch.equal(out, ref[0])
        assert 0.0 <= no_speech <= 1.0


async def test_cross_attention_cache_released_and_bad_language(engine: AsrEngine) -> None:
    await engine.transcribe(corpus("piper")[1])
    gc.collect()
    assert engine.adapter.num_cached_cross == 0
    with pytest.raises(ValueError, match="English-only"):
        await engine.transcribe(corpus("piper")[1], language="de")
    silence = np.zeros(RATE * 40, np.float32)  # no speech at all: VAD finds nothing
    assert (await engine.transcribe(silence)).text == ""
    # a clip of one window with no speech is not decoded either (Whisper hears "you" in it)
    for seconds in (0.001, 5.0, 29.0):
        quiet = np.zeros(int(RATE * seconds), np.float32)
        transcript = await engine.run(TranscriptionRequest(quiet))
        assert transcript.text == "" and transcript.segments == []
    whole = await engine.run(TranscriptionRequest(np.zeros(RATE * 5, np.float32), vad=False))
    assert whole.text  # asked to decode it as it is, Whisper's words of silence


async def test_preemption_under_a_tiny_kv_cache_gives_the_same_tokens(engine: AsrEngine) -> None:
    small = AsrEngine(engine.whisper, AsrConfig(kv_cache_mb=1))  # 5 blocks of 16 tokens
    try:  # 3 clips of ~40 tokens each: 9 blocks wanted at once
        clips = [long_recording("piper", 0.3, range(i, i + 3))[0] for i in (4, 8, 12)]
        prompt = small.prompt_ids()
        # Hold every clip until all three are encoded, so their decodes overlap in the engine
        # (otherwise a fast first decode can finish before the others start: no preemption).
        encode, encoded = small._encode, asyncio.Barrier(len(clips))

        async def encode_together(audio: np.ndarray, prompt_ids: list[int]) -> object:
            out = await encode(audio, prompt_ids)
            await encoded.wait()
            return out

        small._encode = encode_together  # type: ignore[method-assign]
        got = await asyncio.gather(*(small.decode_tokens(c, prompt) for c in clips))
        assert small.stats()["decoder_num_preemptions"] > 0
        assert got == [await engine.decode_tokens(c, prompt) for c in clips]
    finally:
        await small.shutdown()


async def _unreadable(engine: AsrEngine) -> np.ndarray:
    """Speech played backwards: speech-like sounds the model cannot read. Piper's synthesis is
    not seeded, so which clip decodes with a mean logprob under -1.0 (Whisper then falls back to
    sampling) varies between corpus builds: take the first reversed clip whose greedy decode does."""
    for clip in corpus("piper"):
        backwards = clip[::-1].copy()
        *_, (_, result, _) = [
            item async for item in engine.decode_window(backwards, engine.prompt_ids(), temperature=0.0)
        ]
        if result is not None and result.avg_logprob < -1.5:
            return backwards
    raise AssertionError("no reversed clip is unreadable enough to test the fallback")


async def test_no_speech_prob_and_avg_logprob_match_transformers(engine: AsrEngine) -> None:
    w = _pristine()
    sot = w.tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    no_speech = w.tokenizer.convert_tokens_to_ids("<|nocaptions|>")
    prompt = engine.prompt_ids()
    noise = (np.random.default_rng(0).standard_normal(RATE * 5) * 0.05).astype(np.float32)
    for clip in (corpus("piper")[0], corpus("espeak")[3], noise):
        *_, (_, res, _) = [item async for item in engine.decode_window(clip, prompt)]
        assert res is not None
        feats = w.feature_extractor(clip, sampling_rate=RATE, return_tensors="pt").input_features
        with torch.inference_mode():
            logits = w.model(input_features=feats, decoder_input_ids=torch.tensor([[sot]])).logits[0, -1]
            gen = w.model.generate(
                feats,
                decoder_input_ids=torch.tensor([prompt]),
                max_new_tokens=engine.config.max_new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
            )
        assert res.no_speech_prob == pytest.approx(float(logits.softmax(-1)[no_speech]), abs=1e-4)
        chosen = gen.sequences[0, -len(gen.scores) :].tolist()  # text tokens, then end-of-text
        lps = [float(torch.log_softmax(sc[0].float(), -1)[t]) for sc, t in zip(gen.scores, chosen, strict=True)]
        assert res.tokens == [t for t in chosen if t != w.model.generation_config.eos_token_id]
        assert res.avg_logprob == pytest.approx(sum(lps) / (len(res.tokens) + 1), abs=2e-3)
        assert res.token_logprobs == pytest.approx(lps[: len(res.tokens)], abs=5e-3)  # each token's (fp32 order)
        assert res.temperature == 0.0
    assert res.no_speech_prob > 0.6 and res.avg_logprob <= -1.0 and res.silent  # the noise
    streamed = [d async for d in engine.stream(TranscriptionRequest(noise))]  # nothing sent live either
    assert [d.text for d in streamed] == [""] and streamed[-1].transcript is not None
    assert streamed[-1].transcript.segments == [] and streamed[-1].transcript.text == ""


async def test_temperature_fallback_is_seeded_and_reproducible(engine: AsrEngine) -> None:
    speech = await engine.run(TranscriptionRequest(corpus("piper")[0]))
    assert [s.temperature for s in speech.segments] == [0.0]  # clean speech: the greedy decode stands
    assert speech.segments[0].avg_logprob > -1.0 and speech.segments[0].no_speech_prob < 0.1
    clip = await _unreadable(engine)
    hot = [item async for item in engine.decode_window(clip, engine.prompt_ids(), temperature=1.0)]
    assert hot[-1][1] is not None and hot[-1][1].temperature == 1.0  # nothing above 1.0 to try
    first = await engine.run(TranscriptionRequest(clip, seed=7))
    (seg,) = first.segments
    assert seg.temperature > 0.0 and seg.text  # fell back (and is no silence)
    again = await engine.run(TranscriptionRequest(clip, seed=7))
    assert again.segments[0].tokens == seg.tokens and again.segments[0].temperature == seg.temperature
    others = [await engine.run(TranscriptionRequest(clip, seed=s)) for s in (8, 9)]
    assert any(o.segments[0].tokens != seg.tokens for o in others)  # the seed is what samples
    # Starting at 0.4 tries 0.4, 0.6, 0.8, 1.0 only.
    warm = await engine.run(TranscriptionRequest(clip, temperature=0.4, seed=7))
    assert warm.segments[0].temperature in (0.4, 0.6, 0.8, 1.0)


def test_the_decode_kept_when_every_fallback_fails() -> None:
    def attempt(t: float, lp: float, cr: float = 1.5) -> WindowResult:
        return WindowResult(f"t{t}", [1], t, lp, cr, no_speech_prob=0.1)

    failed = [attempt(0.0, -1.4), attempt(0.2, -1.1, cr=2.6), attempt(0.4, -1.2), attempt(1.0, -2.5)]
    assert kept(failed) is failed[-1] and kept(failed, "last") is failed[-1]  # whisper's rule
    assert kept(failed, "best") is failed[2]  # the likeliest of those not too repetitive
    repetitive = [attempt(0.0, -1.3, cr=3.0), attempt(1.0, -1.6, cr=2.5)]
    assert kept(repetitive, "best") is repetitive[0]  # all repetitive: the likeliest of all
    passed = [attempt(0.0, -1.4), attempt(0.2, -0.5)]
    assert kept(passed, "best") is passed[-1]  # an attempt that passes always stands
    silent = [WindowResult("", [], 0.0, -1.5, 0.0, no_speech_prob=0.9)]
    assert kept(silent, "best") is silent[0]


async def test_fallback_keep_best_keeps_the_likeliest_attempt(engine: AsrEngine) -> None:
    clip = await _unreadable(engine)
    best_engine = AsrEngine(engine.whisper, AsrConfig(fallback_keep="best"))
    try:
        *_, (_, last, _) = [item async for item in engine.decode_window(clip, engine.prompt_ids(), seed=7)]
        *_, (text, best, _) = [item async for item in best_engine.decode_window(clip, best_engine.prompt_ids(), seed=7)]
    finally:
        await best_engine.shutdown()
    assert last is not None and best is not None
    if not last.needs_fallback:
        pytest.skip("a sampled decode of the unreadable clip passed the checks: nothing to choose")
    assert last.temperature == 1.0 and best.avg_logprob >= last.avg_logprob
    # the kept decode is one of the attempts: decoded alone at its temperature, with that
    # attempt's seed (seed + attempt), it gives the same tokens
    prompt = engine.prompt_ids()
    enc, _ = await engine._encode(clip, prompt)
    seed = 7 + round(best.temperature / 0.2) if best.temperature > 0 else None
    ids = [ids async for _, ids, _, _ in engine._generate(enc, prompt, best.temperature, seed)][-1]
    assert [t for t in ids if t != engine._eos] == best.tokens and text == best.text
    with pytest.raises(ValueError, match="fallback_keep"):
        AsrEngine(engine.whisper, AsrConfig(fallback_keep="first"))
