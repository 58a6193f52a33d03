"""Incremental detokenisation (multi-byte characters split over byte-level tokens) and stop
strings: the matcher itself, the per-request streaming logic, and real generations through
the sync and async engines."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel, load_model
from engine.output_processor import RequestState
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, PromptInputs, Sequence, SequenceStatus

TEXTS = [
    "🦙🚀",
    "llamas 🦙🚀 to the moon",
    "日本語のテキスト、中文文本",
    "naïve café",
    "Ångström résumé — “quoted” ñ Ωmega",
    "mixed 🦙 llama 羊驼 and 🚀 rocket: done",
    "  spaces   and\n\nnewlines\t tabs",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    return [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


# -- incremental detokenisation ----------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode(tokenizer, text: str) -> None:
    ids = tokenizer(text).input_ids
    pieces = [tokenizer.decode([i]) for i in ids]
    if any(ord(c) >= 0x2E80 for c in text):
        # The point of the test: emoji and CJK characters really are split over several tokens.
        assert any("\ufffd" in p for p in pieces)
    for chunk in (1, 2, 3):
        deltas = _stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True), ids, chunk)
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_after_a_prompt(tokenizer, text: str) -> None:
    prompt = tokenizer("Please repeat this:").input_ids
    ids = tokenizer(text).input_ids
    deltas = _stream(IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True), ids)
    assert all("\ufffd" not in d for d in deltas)
    full = tokenizer.decode(prompt + ids)
    assert "".join(deltas) == full[len(tokenizer.decode(prompt)) :]


def test_emoji_released_only_when_complete(tokenizer) -> None:
    ids = tokenizer("🦙🚀").input_ids
    assert len(ids) > 2  # each emoji takes several byte-level tokens
    deltas = _stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True), ids)
    assert [d for d in deltas if d] == ["🦙", "🚀"]
    assert deltas[0] == ""  # a lone leading byte is held back


def test_prompt_split_inside_a_character(tokenizer) -> None:
    ids = tokenizer("ok 🦙🚀 日本語 done").input_ids
    for k in range(1, len(ids)):
        deltas = _stream(IncrementalDetokenizer(tokenizer, ids[:k], skip_special_tokens=True), ids[k:])
        text = "".join(deltas)
        assert "\ufffd" not in text
        assert text.endswith(" done")
        if "\ufffd" not in tokenizer.decode(ids[:k]):
            assert text == tokenizer.decode(ids)[len(tokenizer.decode(ids[:k])) :]


def test_special_tokens(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    ids = tokenizer("hi").input_ids + [eos] + tokenizer(" there").input_ids
    skipped = "".join(_stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True), ids))
    kept = "".join(_stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False), ids))
    assert skipped == "hi there"
    assert kept == f"hi{tokenizer.eos_token} there"


# -- StopStringMatcher ---------------------------------------------------------------------------------
def test_matcher_finds_earliest_stop() -> None:
    text = "hello STOP world END"
    m = StopStringMatcher(["END", "STOP"], include_in_output=False)
    assert m.find(text, new_chars=len(text)) == (6, "STOP")
    assert StopStringMatcher(["END", "STOP"], include_in_output=True).find(text, len(text)) == (10, "STOP")
    # Overlapping candidates: the one starting first wins.
    assert StopStringMatcher(["b", "ab"], include_in_output=False).find("xab", 3) == (1, "ab")
    assert m.find("nothing here", 12) is None
    assert StopStringMatcher([], include_in_output=False).find("END", 3) is None


def test_matcher_stop_spanning_deltas() -> None:
    m = StopStringMatcher(["END"], include_in_output=False)
    assert m.find("abc E", 2) is None
    # "E" arrived earlier, "ND" now: the search window reaches back by the holdback.
    assert m.find("abc END", 2) == (4, "END")


def test_matcher_releasable_holds_back() -> None:
    m = StopStringMatcher(["</s>", "STOP"], include_in_output=False)
    assert m.holdback == 3
    assert m.releasable("abcdef", finished=False) == 3
    assert m.releasable("ab", finished=False) == 0
    assert m.releasable("abcdef", finished=True) == 6
    assert StopStringMatcher([], include_in_output=False).releasable("abcdef", finished=False) == 6


def _assert_no_stop_prefix_released(pending: str, visible: str, stops: list[str]) -> None:
    """``visible`` (a prefix of ``pending``) must not reach into a tail of ``pending`` that could
    still grow into a stop string."""
    assert pending.startswith(visible)
    for s in stops:
        for k in range(1, len(s)):
            if pending.endswith(s[:k]):
                assert len(visible) <= len(pending) - k, (pending, visible, s)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("wait END ONLY then END OF story, more", ["END OF"], "wait END ONLY then "),
        ("a 🦙 b 🦙🚀 c", ["🚀"], "a 🦙 b 🦙"),
        ("one, two; three. four", ["never", "; t", "."], "one, two"),
    ],
)
def test_streaming_stop_strings(tokenizer, text: str, stops: list[str], expected: str, include: bool) -> None:
    """Drive the per-request output logic token by token, as the engine does."""
    prompt = tokenizer("Say:").input_ids
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=100)
    seq = Sequence("r", 0, PromptInputs(prompt), params)
    state = RequestState("r", [seq], tokenizer)
    streamed, stop_str = "", None
    for token in tokenizer(text).input_ids:
        seq.append_token(token)
        stop_str = state.add_token(seq, None)
        if stop_str is not None:
            seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, FinishReason.STOP, stop_str
        out = state.make_output().outputs[0]
        streamed += out.delta_text
        assert out.text == streamed and "\ufffd" not in streamed
        if stop_str is not None:
            break
        _assert_no_stop_prefix_released(state.texts[0].text, out.text, stops)
    matched = next(s for s in stops if s in text)
    assert stop_str == matched
    assert out.finish_reason == "stop" and out.stop_reason == matched
    assert streamed == (expected + matched if include else expected)


# -- real generations ----------------------------------------------------------------------------------
PROMPT = "The weather today is"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> LoadedModel:
    return load_model(str(tiny_model_dir("llama")), max_model_len=MAX_MODEL_LEN)


def _engine(loaded: LoadedModel) -> LLMEngine:
    config = EngineConfig(model=str(loaded.path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=32)
    return LLMEngine(config, loaded=loaded)


@pytest.fixture(scope="module")
def reference(loaded) -> tuple[str, str]:
    """(full greedy text without stops, a stop string taken from its middle)."""
    (out,) = _engine(loaded).generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    full = out.outputs[0].text
    assert out.outputs[0].finish_reason == "length"
    assert len(full) > 40 and "\ufffd" not in full
    stop = full[len(full) // 2 : len(full) // 2 + 5]  # usually starts inside a token
    return full, stop


def test_engine_stop_string(loaded, reference) -> None:
    full, stop = reference
    cut = full.find(stop)
    engine = _engine(loaded)
    base = dict(temperature=0, max_tokens=20, ignore_eos=True)
    (out,) = engine.generate([PROMPT], SamplingParams(**base, stop=[stop]))
    o = out.outputs[0]
    assert o.text == full[:cut]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert len(o.token_ids) < 20

    (out,) = engine.generate([PROMPT], SamplingParams(**base, stop=[stop], include_stop_str_in_output=True))
    o = out.outputs[0]
    assert o.text == full[: cut + len(stop)] and o.text.endswith(stop)
    assert o.finish_reason == "stop" and o.stop_reason == stop

    # Several stop strings: the earliest in the text wins; one that never occurs changes nothing.
    early = full[3:6]
    first_cut, first = min((full.find(early), early), (cut, stop))
    (out,) = engine.generate([PROMPT], SamplingParams(**base, stop=[stop, early, "\u2603never"]))
    assert out.outputs[0].text == full[:first_cut] and out.outputs[0].stop_reason == first
    (out,) = engine.generate([PROMPT], SamplingParams(**base, stop=["\u2603never"]))
    assert out.outputs[0].text == full and out.outputs[0].finish_reason == "length"


def test_stop_string_on_the_last_allowed_token(loaded, reference) -> None:
    """The token completing a stop string is also the max_tokens-th: the text is cut, so the
    request ended on the stop string, not on the length limit."""
    full, _ = reference
    stop = full[-4:]
    assert full.find(stop) == len(full) - 4
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    (out,) = _engine(loaded).generate([PROMPT], params)
    o = out.outputs[0]
    assert len(o.token_ids) == 20
    assert o.text == full[:-4]
    assert o.finish_reason == "stop" and o.stop_reason == stop


@pytest.mark.parametrize("include", [False, True])
async def test_async_streaming_stop_string(loaded, reference, include: bool) -> None:
    full, stop = reference
    cut = full.find(stop)
    expected = full[: cut + len(stop)] if include else full[:cut]
    engine = AsyncEngine(_engine(loaded))
    try:
        params = SamplingParams(
            temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=include
        )
        streamed, last = "", None
        async for out in engine.generate(None, PROMPT, params):
            last = out.outputs[0]
            streamed += last.delta_text
            assert last.text == streamed
            assert expected.startswith(streamed)  # never a character past the cut
            if not out.finished:
                assert stop not in streamed
        assert last is not None and last.finish_reason == "stop" and last.stop_reason == stop
        assert streamed == last.text == expected
    finally:
        await engine.shutdown()
