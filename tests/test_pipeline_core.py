"""Frames-and-processors core: pure logic with toy processors (no models)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

from modalities.asr.types import TokenLogprob
from modalities.asr.types import Transcript as AsrTranscript
from pipelines.frames import (
    End,
    ErrorFrame,
    Frame,
    Heard,
    Interrupt,
    LLMDone,
    ResponseRequest,
    SpeechStarted,
    TextDelta,
    Transcript,
    UserAudio,
)
from pipelines.processor import Pipeline, Processor


class Upper(Processor):
    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        yield Transcript(frame.text.upper()) if isinstance(frame, Transcript) else frame


class Split(Processor):
    """One ``TextDelta`` per word of a transcript, slowly (an interruptible "LLM")."""

    interruptible = True

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.cancelled = 0
        self.interrupts = 0

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if not isinstance(frame, Transcript):
            yield frame
            return
        try:
            for word in frame.text.split():
                await asyncio.sleep(self.delay)
                yield TextDelta("r1", word)
            yield LLMDone("r1", frame.text)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def on_interrupt(self, by: Interrupt) -> None:
        self.interrupts += 1


class Boom(Processor):
    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, Transcript) and frame.text == "boom":
            raise ValueError("bad frame")
        yield frame


async def _source(frames: list[Frame], gap: float = 0.0) -> AsyncIterator[Frame]:
    for f in frames:
        await asyncio.sleep(gap)
        yield f


def asr_said(text: str) -> AsrTranscript:
    """What a fake ASR service hears."""
    return AsrTranscript(text, [], "en", 0.0)


def test_sequential_pipeline_passes_frames_through_in_order() -> None:
    pipe = Pipeline([Upper(), Split()])
    out = asyncio.run(pipe.run_all([Transcript("hello big world"), SpeechStarted(5)]))
    kinds = [(type(f).__name__, getattr(f, "text", None)) for f in out]
    assert kinds == [
        ("TextDelta", "HELLO"),
        ("TextDelta", "BIG"),
        ("TextDelta", "WORLD"),
        ("LLMDone", "HELLO BIG WORLD"),
        ("SpeechStarted", None),
    ]


def test_pipelines_nest() -> None:
    inner = Pipeline([Upper()])
    out = asyncio.run(Pipeline([inner, Split()]).run_all([Transcript("a b")]))
    assert [f.text for f in out] == ["A", "B", "A B"]


def test_concurrent_stream_matches_sequential() -> None:
    frames: list[Frame] = [Transcript("one two"), Transcript("three")]

    async def run() -> list[Frame]:
        return [f async for f in Pipeline([Upper(), Split()]).stream(_source(frames))]

    out = asyncio.run(run())
    assert isinstance(out[-1], End)
    assert [f.text for f in out[:-1]] == ["ONE", "TWO", "ONE TWO", "THREE", "THREE"]


def test_interrupt_cancels_work_in_flight_and_drops_queued_replies() -> None:
    split = Split(delay=0.05)

    async def source() -> AsyncIterator[Frame]:
        yield Transcript("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10")
        await asyncio.sleep(0.12)  # a couple of words out
        yield Interrupt()
        yield Transcript("after")

    async def run() -> list[Frame]:
        return [f async for f in Pipeline([Upper(), split]).stream(source())]

    out = asyncio.run(run())
    names = [type(f).__name__ for f in out]
    cut = names.index("Interrupt")
    before = [f.text for f in out[:cut]]
    assert 1 <= len(before) < 10 and "W10" not in before  # the first reply was cut short
    assert not any(isinstance(f, LLMDone) and "W1" in f.text for f in out)
    assert [f.text for f in out[cut + 1 : -1]] == ["AFTER", "AFTER"]  # the pipeline goes on
    assert split.cancelled == 1 and split.interrupts == 1


def test_errors_become_error_frames_and_the_stage_keeps_going() -> None:
    async def run() -> list[Frame]:
        src = _source([Transcript("boom", item_id="item_7"), Transcript("ok")])
        return [f async for f in Pipeline([Boom(), Upper()]).stream(src)]

    out = asyncio.run(run())
    assert isinstance(out[0], ErrorFrame) and "bad frame" in out[0].message and out[0].stage == "Boom"
    assert out[0].item_id == "item_7"  # the item whose frame failed (a realtime session fails its transcript)
    assert [f.text for f in out if isinstance(f, Transcript)] == ["OK"]


def test_an_error_names_the_reply_its_work_was_for() -> None:
    """A stage failing on a reply's frame: the ErrorFrame names that reply (a realtime session
    drops the errors of replies it already ended); on a client event's frame, that event."""

    class Fails(Processor):
        async def process(self, frame: Frame) -> AsyncIterator[Frame]:
            if not isinstance(frame, End):
                raise ValueError("no voice")
            yield frame

    async def run() -> list[Frame]:
        asked = ResponseRequest(event_id="evt_9")  # (a client's response.create)
        frames = [TextDelta("resp_3", "Hi."), Transcript("x"), asked]
        return [f async for f in Pipeline([Fails()]).stream(_source(frames))]

    out = asyncio.run(run())
    errors = [f for f in out if isinstance(f, ErrorFrame)]
    assert [f.response_id for f in errors] == ["resp_3", None, None]
    assert [f.event_id for f in errors] == [None, None, "evt_9"]  # (the client event it failed on)


def test_a_nested_pipeline_passes_interrupts_to_its_stages() -> None:
    """A pipeline as a stage of a concurrent run: a client's cancel of a reply cancels its
    stage writing that reply (``reply_of`` through the nesting), and a barge-in is counted in
    its stages' ``turns_taken`` at once."""

    class Writes(Split):
        def reply_of(self, frame: Frame) -> str | None:
            return "r1"

    async def run(stop: Interrupt) -> Writes:
        writes = Writes(delay=0.05)

        async def source() -> AsyncIterator[Frame]:
            yield Transcript("w1 w2 w3 w4 w5 w6")
            await asyncio.sleep(0.12)
            yield stop

        [f async for f in Pipeline([Upper(), Pipeline([Upper(), writes])]).stream(source())]
        return writes

    cancelled = asyncio.run(run(Interrupt("client_cancelled", "r1")))
    assert cancelled.cancelled == 1 and cancelled.turns_taken == 0
    assert asyncio.run(run(Interrupt("client_cancelled", "r2"))).cancelled == 0  # another reply's cancel
    assert asyncio.run(run(Interrupt())).turns_taken == 1


def test_an_error_naming_a_request_field_is_the_inputs() -> None:
    from modalities.tts.protocol import TTSInputError

    class Refuses(Processor):
        async def process(self, frame: Frame) -> AsyncIterator[Frame]:
            raise TTSInputError("this text can't be spoken", "input")
            yield frame

    async def run() -> list[Frame]:
        return [f async for f in Pipeline([Refuses()]).stream(_source([Transcript("x")]))]

    out = asyncio.run(run())
    assert isinstance(out[0], ErrorFrame) and out[0].code == "invalid_value"
    assert out[0].error_type == "invalid_request_error"
    assert out[0].message == "this text can't be spoken" and out[0].param == "input"  # (no Python class name)


def test_an_engines_refusal_reads_as_its_routes_answer() -> None:
    """A stage refused by its engine (queue full, engine stopped) reports OpenAI's error for it,
    as the route would answer, not a server error naming a Python class."""
    from engine.errors import EngineDeadError, QueueFullError

    class Refused(Processor):
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        async def process(self, frame: Frame) -> AsyncIterator[Frame]:
            raise self.exc
            yield frame

    async def run(exc: Exception) -> ErrorFrame:
        out = [f async for f in Pipeline([Refused(exc)]).stream(_source([Transcript("x")]))]
        assert isinstance(out[0], ErrorFrame)
        return out[0]

    full = asyncio.run(run(QueueFullError(3)))
    assert (full.error_type, full.code) == ("rate_limit_error", "rate_limit_exceeded")
    assert full.message.startswith("the server is busy")
    dead = asyncio.run(run(EngineDeadError("stopped")))
    assert (dead.error_type, dead.code) == ("service_unavailable", "engine_dead")
    bug = asyncio.run(run(KeyError("k")))  # (not mmserve's: a bug, named for the logs)
    assert (bug.error_type, bug.code, bug.message) == ("server_error", None, "KeyError: 'k'")


def test_sequential_interrupt_reaches_later_stages() -> None:
    class Barge(Processor):
        async def process(self, frame: Frame) -> AsyncIterator[Frame]:
            yield Interrupt() if isinstance(frame, SpeechStarted) else frame

    split = Split()
    out = asyncio.run(Pipeline([Barge(), split]).run_all([SpeechStarted(0)]))
    assert [type(f) for f in out] == [Interrupt] and split.interrupts == 1


def test_leaving_the_stream_early_cancels_the_stages() -> None:
    split = Split(delay=0.2)

    async def run() -> None:
        agen = Pipeline([split]).stream(_source([Transcript("a b c d e f")]))
        first = await agen.__anext__()
        assert isinstance(first, TextDelta)
        await agen.aclose()

    asyncio.run(run())
    assert split.cancelled == 1


@pytest.mark.parametrize("n", [0, 3])
def test_end_is_last(n: int) -> None:
    async def run() -> list[Frame]:
        return [f async for f in Pipeline([Upper()] * n).stream(_source([Transcript("x")]))]

    out = asyncio.run(run())
    assert isinstance(out[-1], End) and [type(f) for f in out[:-1]] == [Transcript]


def test_sentences_split_a_short_first_piece_then_whole_sentences() -> None:
    from pipelines.frames import LLMStarted, Sentence
    from pipelines.speech import Sentences

    deltas = ["Paris is the capital", " of France, a big", " country. It has", " 2.1 million people! Bye"]
    frames: list[Frame] = [LLMStarted("r"), *(TextDelta("r", d) for d in deltas), LLMDone("r", "".join(deltas))]
    out = asyncio.run(Pipeline([Sentences()]).run_all(frames))
    said = [f.text for f in out if isinstance(f, Sentence)]
    assert said == ["Paris is the capital", "of France, a big country.", "It has 2.1 million people!", "Bye"]
    assert [f.index for f in out if isinstance(f, Sentence)] == [0, 1, 2, 3]
    assert sum(isinstance(f, TextDelta) for f in out) == 4 and isinstance(out[-1], LLMDone)


def test_a_long_first_sentence_is_cut_after_four_complete_words() -> None:
    from modalities.tts.text import SentenceSplitter

    splitter = SentenceSplitter()
    said = []
    for delta in ["The sky", " on a clear", " day is blue.", " It is", " blue to us all day."]:
        said += splitter.feed(delta)
    assert said == ["The sky on a clear", "day is blue."]  # "clear" waited for the space; not cut after "a"
    assert splitter.flush() == "It is blue to us all day."  # later sentences are never cut
    splitter = SentenceSplitter()
    assert splitter.feed("Sure! Here it is") == ["Sure!"]  # a sentence shorter than the cap


def test_heard_text_keeps_whole_sentences_then_a_proportional_part() -> None:
    from pipelines.conversation import Spoken, heard_text

    pieces = [Spoken("One two three.", 1000), Spoken("Four five six seven.", 2000)]
    assert heard_text(pieces, 0) == ""
    assert heard_text(pieces, 1000) == "One two three."
    assert heard_text(pieces, 2000) == "One two three. Four five"
    assert heard_text(pieces, 5000) == "One two three. Four five six seven."


def test_conversation_prompts_extend_each_other() -> None:
    from pipelines.conversation import Conversation

    class Tok:
        def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> list[int]:
            return [ord(c) for m in messages for c in f"<{m['role']}>{m['content']}"] + [0]

    conv = Conversation("sys")
    conv.add("user", "hi")
    first = conv.prompt_ids(Tok())
    conv.add("assistant", "hello")
    conv.add("user", "again")
    assert conv.prompt_ids(Tok())[: len(first) - 1] == first[:-1]  # warm prefix across turns


def test_conversation_leaves_out_the_oldest_items_to_fit_and_keeps_the_instructions() -> None:
    from pipelines.conversation import Conversation

    class Tok:
        def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> list[int]:
            return [ord(c) for m in messages for c in f"<{m['role']}>{m['content']}"]

    conv = Conversation("sys")
    for i in range(10):
        conv.add("user", f"question {i}")
        conv.add("assistant", f"answer {i}")
    ids = conv.prompt_ids(Tok(), limit=60)
    text = "".join(map(chr, ids))
    assert len(ids) <= 60 and text.startswith("<system>sys") and text.endswith("<assistant>answer 9")
    assert "question 0" not in text
    assert conv.prompt_ids(Tok(), limit=3) == [ord(c) for c in "<system>sys<assistant>answer 9"]  # the latest stays


@pytest.mark.parametrize("first", [0, 37, 180, 399])
def test_a_long_conversation_finds_what_to_leave_out_in_a_few_renders(first: int) -> None:
    """The oldest items left out are as many as dropping them one by one leaves out, found in
    ~2 log2(n) renders (one render per item left out took 28 s for 1000 short items here)."""
    from pipelines.conversation import Conversation

    renders = []

    class Tok:
        def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> list[int]:
            renders.append(len(messages))
            return [ord(c) for m in messages for c in f"<{m['role']}>{m['content']}"]

    conv = Conversation("sys")
    for i in range(400):
        conv.add("user" if i % 2 == 0 else "assistant", f"item {i} " * (1 + i % 3))
    full = len(conv.prompt_ids(Tok()))
    limit = full - sum(len(f"<{i.role}>{i.text}") for i in conv.items[:first])  # fits from `first` on
    renders.clear()
    ids = conv.prompt_ids(Tok(), limit=limit)
    assert conv._first == first and len(ids) <= limit
    assert first == 0 or len(conv.__class__("sys", conv.items[first - 1 :]).prompt_ids(Tok())) > limit
    assert len(renders) <= 2 * max(1, first).bit_length() + 2, len(renders)  # (+1: the text bound's)


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from engine.tiny_models import tiny_model_dir

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


def test_a_conversation_is_judged_by_what_it_renders(smollm2_tokenizer: Any) -> None:
    """Whitespace-only items render as nothing: no refusal, and no older item left out for them."""
    from engine.errors import PromptTooLongError
    from pipelines.conversation import Conversation

    tok = smollm2_tokenizer
    conv = Conversation()
    conv.add("user", "My name is Ann.")
    conv.add("user", " " * 800_000)
    conv.add("user", "\n" * 800_000)  # 1.6M characters: a 9.9k-token bound if counted
    conv.add("user", "What is my name?")
    text = tok.decode(conv.prompt_ids(tok, limit=8192 - 256, max_tokens=256))
    assert "Ann" in text and "What is my name?" in text and conv._first == 0
    conv.add("user", "hello world, " * 100_000)  # too long by its length alone: no render
    with pytest.raises(PromptTooLongError, match="characters, at least"):
        conv.prompt_ids(tok, limit=8192 - 256, max_tokens=256)


def test_a_reply_that_only_calls_a_function_renders_with_any_template(smollm2_tokenizer: Any) -> None:
    """A call alone is an assistant message with empty content (None fails or prints "None")."""
    from modalities.llm.chat import render_chat_text
    from modalities.llm.tools import CHATML_TOOLS
    from pipelines.conversation import Conversation

    conv = Conversation()
    conv.add("user", "What is the weather in Paris?")
    conv.add("assistant", '{"city": "Paris"}', kind="function_call", call_id="c1", name="weather", response_id="r1")
    conv.add("tool", '{"sky": "clear"}', kind="function_call_output", call_id="c1")
    with_tools = render_chat_text(smollm2_tokenizer, conv.messages(), chat_template=CHATML_TOOLS.read_text())
    assert '"city": "Paris"' in with_tools and "None" not in with_tools
    plain = render_chat_text(smollm2_tokenizer, conv.messages())  # (a template that knows no calls)
    assert "clear" in plain and "None" not in plain


def test_a_render_on_a_snapshot_leaves_out_the_same_items_of_the_live_conversation(smollm2_tokenizer: Any) -> None:
    """The session may delete an item while a long render runs on a thread: the items the render
    left out stay out, and the latest one stays in."""
    from pipelines.conversation import Conversation

    tok = smollm2_tokenizer
    conv = Conversation("Be brief.")
    old = conv.add("user", "one " * 300)
    conv.add("assistant", "two " * 300)
    conv.add("user", "What now?")
    rendered = conv.snapshot()
    assert conv.remove(old.id)  # meanwhile, on the event loop
    rendered.prompt_ids(tok, limit=60)
    assert rendered._first == 2
    conv.keep_from(rendered)
    assert [m["content"] for m in conv.messages(conv._first)] == ["Be brief.", "What now?"]


@pytest.mark.parametrize("failure", ["too_long", "worker_lost", "bug", "value_bug", "bad_param"])
def test_llm_refused_by_the_engine_ends_the_reply_with_an_error(failure: str) -> None:
    """The reply's ``LLMDone`` carries the error as the routes map it: an engine refusal, or a
    lost worker's 503 under celery dispatch (its code, as the HTTP routes give it), a bad
    parameter; a bug is a ``server_error`` with no code, a ValueError from Python's own code too."""
    from engine.errors import InvalidParamError, PromptTooLongError
    from gateway.errors import APIError
    from pipelines.conversation import Conversation
    from pipelines.frames import LLMDone, LLMReserved, LLMStarted, ResponseRequest
    from pipelines.reply import LLM
    from pipelines.services import Services

    raised = {
        "too_long": PromptTooLongError(3, 64, 8),
        "worker_lost": APIError(503, "worker w1 was lost mid-request", code="worker_lost"),
        "bug": KeyError("oops"),
        "value_bug": ValueError("not enough values to unpack (expected 2, got 1)"),
        "bad_param": InvalidParamError("temperature must be at most 2", "temperature"),
    }[failure]

    class Engine:
        tokenizer = type("Tok", (), {"apply_chat_template": lambda self, m, **_: [1, 2, 3]})()
        max_model_len = 8 if failure == "too_long" else 4096  # (too long: refused before generate)

        async def generate(self, *_: object, **__: object) -> AsyncIterator[object]:
            raise raised
            yield  # an async generator, like AsyncEngine.generate

    llm = LLM(Services(llm=Engine()), Conversation("sys"))
    out = asyncio.run(Pipeline([llm]).run_all([ResponseRequest()]))
    reserved = [] if failure == "too_long" else [LLMReserved]  # (refused as it is rendered: nothing reserved)
    assert [type(f) for f in out] == [LLMStarted, *reserved, LLMDone]
    done = out[-1]
    assert done.response_id == out[0].response_id
    expected = {
        "too_long": ("maximum context length", "invalid_request_error", "context_length_exceeded"),
        "worker_lost": ("was lost mid-request", "service_unavailable", "worker_lost"),
        "bug": ("oops", "server_error", None),
        "value_bug": ("ValueError: not enough values", "server_error", None),
        "bad_param": ("temperature must be", "invalid_request_error", "invalid_value"),
    }[failure]
    assert (done.error or "").find(expected[0]) >= 0 and (done.error_type, done.error_code) == expected[1:]


def test_a_request_cancelled_on_its_way_gets_no_reply() -> None:
    """The session marks a request the client cancelled before it started; the reply stage
    skips it (no engine request, no frame)."""
    from pipelines.conversation import Conversation
    from pipelines.frames import ResponseRequest
    from pipelines.reply import LLM
    from pipelines.services import Services

    class Engine:
        async def generate(self, *_: object, **__: object) -> AsyncIterator[object]:
            raise AssertionError("no reply was due")
            yield  # an async generator, like AsyncEngine.generate

    conv = Conversation("sys")
    conv.add("user", "Hi.")
    out = asyncio.run(Pipeline([LLM(Services(llm=Engine()), conv)]).run_all([ResponseRequest(cancelled=True)]))
    assert out == [] and [i.text for i in conv.items] == ["Hi."]


def test_speech_deleted_before_it_is_heard_gets_no_reply() -> None:
    """Its transcript stays out of the conversation, and no reply answers it."""
    from pipelines.conversation import Conversation
    from pipelines.reply import LLM
    from pipelines.services import Services

    class Engine:
        async def generate(self, *_: object, **__: object) -> AsyncIterator[object]:
            raise AssertionError("no reply was due")
            yield  # an async generator, like AsyncEngine.generate

    conv = Conversation("sys")
    conv.add("user", "", "item_in_000001", audio=True, pending=True)  # committed
    assert conv.remove("item_in_000001")  # deleted by the client
    heard = Transcript("Hello there.", item_id="item_in_000001", respond=True)
    out = asyncio.run(Pipeline([LLM(Services(llm=Engine()), conv)]).run_all([heard]))
    assert out == [heard] and conv.items == []


def test_vad_segmenter_buffer_is_capped_then_usable_after_take() -> None:
    from pipelines.vad import BufferFull, VADConfig, VADSegmenter

    seg = VADSegmenter(VADConfig(server_vad=False), max_samples=1000)
    for _ in range(3):
        seg.feed(np.ones(300, np.float32))
    with pytest.raises(BufferFull):
        seg.feed(np.ones(300, np.float32))  # dropped
    audio, start_ms, end_ms = seg.take()
    assert audio.size == 900 and (start_ms, end_ms) == (0, 900 // 16)
    seg.feed(np.ones(900, np.float32))
    assert seg.take()[0].size == 900


def test_a_commit_of_an_empty_buffer_fails_its_item() -> None:
    """The session created the committed item already: with no audio to hear (the buffer full,
    or server VAD took it), the VAD stage fails that item rather than leave it waiting."""
    from pipelines.frames import AudioFrame, CommitFrame, ErrorFrame, UserAudio
    from pipelines.speech import VAD
    from pipelines.vad import VADConfig

    vad = VAD(VADConfig(server_vad=False))

    async def go(frame: Any) -> list[Any]:
        return [f async for f in vad.process(frame)]

    (err,) = asyncio.run(go(CommitFrame(item_id="item_cm_1")))
    assert isinstance(err, ErrorFrame) and (err.code, err.item_id) == ("input_audio_buffer_commit_empty", "item_cm_1")
    assert asyncio.run(go(AudioFrame(np.ones(1600, np.float32), 16_000))) == []
    (heard,) = asyncio.run(go(CommitFrame(item_id="item_cm_2")))
    assert isinstance(heard, UserAudio) and heard.item_id == "item_cm_2" and heard.samples.size == 1600


def test_audio_the_full_buffer_refuses_is_refunded() -> None:
    """The session charged each chunk as it came; the VAD stage that refuses one gives it back,
    and its error names the client event that sent it (kept through the resampler)."""
    from pipelines.frames import AudioFrame, ErrorFrame
    from pipelines.speech import VAD, Resample
    from pipelines.vad import VADConfig

    vad = VAD(VADConfig(server_vad=False))
    vad.seg.max_samples = 2000
    refunded: list[int] = []

    def chunk(k: int) -> AudioFrame:
        async def refund() -> None:
            refunded.append(k)

        return AudioFrame(np.ones(800, np.float32), 16_000, refund, f"evt_{k}")

    async def go() -> list[Any]:
        return [f for k in range(3) async for f in vad.process(chunk(k))]

    (err,) = asyncio.run(go())
    assert isinstance(err, ErrorFrame) and err.code == "input_audio_buffer_full" and refunded == [2]
    assert err.event_id == "evt_2"
    sent = AudioFrame(np.ones(2400, np.float32), 24_000, event_id="evt_9")
    (out,) = asyncio.run(Pipeline([Resample(16_000)]).run_all([sent]))
    assert out.sample_rate == 16_000 and out.event_id == "evt_9" and out.created == sent.created


def _spoken(text: str) -> np.ndarray:
    """``text`` spoken by the Piper voice at 16 kHz with 0.5 s of silence before and 1 s after."""
    from modalities.asr.speech_corpus import synth_piper

    (audio,) = synth_piper([text], 16_000)
    return np.concatenate([np.zeros(8000, np.float32), audio, np.zeros(16000, np.float32)])


def test_vad_segmenter_pause_then_stop_on_real_speech() -> None:
    from pipelines.vad import VADConfig, VADSegmenter

    audio = _spoken("Hello there, how are you today?")
    seg = VADSegmenter(VADConfig(silence_duration_ms=500, eager_ms=200))
    events = [ev for i in range(0, audio.size, 320) for ev in seg.feed(audio[i : i + 320])]  # 20 ms chunks
    kinds = [e.kind for e in events]
    assert kinds[0] == "start" and kinds[-1] == "stop" and "pause" in kinds
    start, stop = events[0], events[-1]
    assert 200 <= start.ms <= 600 and stop.ms > start.ms + 1000
    assert stop.samples.size == (stop.ms - stop.start_ms) * 16
    last_pause = [e for e in events if e.kind == "pause"][-1]
    assert last_pause.key == stop.key  # no speech after the last pause: its transcript is reusable
    assert stop.samples[: last_pause.samples.size].tolist() == last_pause.samples.tolist()


def _in_noise(audio: np.ndarray, snr_db: float, lead_s: float, seed: int = 0) -> np.ndarray:
    """``audio`` after ``lead_s`` of silence, in white noise ``snr_db`` below its speech."""
    from modalities.asr.speech_corpus import in_noise

    audio = np.concatenate([np.zeros(round(lead_s * 16_000), np.float32), audio])
    return in_noise(audio, snr_db, np.random.default_rng(seed))


def test_noise_reduction_lets_a_turn_end_in_noise_and_keeps_the_original_audio() -> None:
    """White noise at 10 dB SNR: webrtcvad takes it for speech, so the turn never ends; with the
    session's noise reduction the detector hears the noise suppressed (once it has heard some
    noise alone) and ends the turn after the speech, and the utterance is the original audio."""
    from pipelines.vad import VADConfig, VADSegmenter

    clean = _spoken("What is the capital of France?")  # (speech from 0.5 s)
    audio = _in_noise(clean, 10, 1.5)
    end_ms = 1500 + (np.flatnonzero(np.abs(clean) > 0.01)[-1] + 1) // 16  # where the speech ends

    def events(reduction: str | None) -> list[Any]:
        seg = VADSegmenter(VADConfig(silence_duration_ms=500, noise_reduction=reduction))
        return [ev for i in range(0, audio.size, 640) for ev in seg.feed(audio[i : i + 640])]

    assert [e.kind for e in events(None) if e.kind in ("start", "stop")] == ["start"]  # (at 0 ms: the noise)
    for reduction in ("near_field", "far_field"):
        start, stop = (e for e in events(reduction) if e.kind in ("start", "stop"))
        assert 1500 <= start.ms <= 2000 <= end_ms < stop.ms <= end_ms + 800, (start.ms, end_ms, stop.ms)
        assert np.array_equal(stop.samples, audio[start.ms * 16 : stop.ms * 16])  # (not the suppressed audio)


def test_noise_reduction_switched_on_off_or_over_loses_no_sample_of_the_detectors_stream() -> None:
    """The detector hears every sample since its time 0, once: through a level switch, turning
    the suppression on and off, a commit, and turn detection off and on again."""
    from pipelines.vad import VADConfig, VADSegmenter

    config = VADConfig(noise_reduction="near_field")
    seg = VADSegmenter(config)
    audio = _in_noise(_spoken("Hello there."), 10, 0.5)
    steps = {3: ("noise_reduction", "far_field"), 6: ("noise_reduction", None), 9: ("noise_reduction", "near_field")}
    steps |= {12: ("server_vad", False), 14: ("server_vad", True)}
    for k, at in enumerate(range(0, 20 * 371, 371)):  # (chunks that are no multiple of a frame)
        if k in steps:
            setattr(config, *steps[k])
        if k == 17:
            seg.take()
        seg.feed(audio[at : at + 371])
        if seg.stream is not None:
            held = 0 if seg.denoiser is None else seg.denoiser.rest.size
            heard = seg.stream._frames * seg.stream.classifier.frame_samples + seg.stream._buf.size + held
            assert seg.pos - seg.origin == heard, k


def test_asr_reuses_the_early_transcript_only_for_the_same_turn() -> None:
    from engine.foreground import INTERACTIVE
    from pipelines.frames import UserAudio
    from pipelines.services import Services
    from pipelines.speech import ASR, ASROptions

    calls: list[int] = []
    priorities: list[int] = []
    hints: list[tuple[str | None, str | None]] = []

    class Fake(Services):
        async def transcribe(
            self,
            samples: np.ndarray,
            priority: int = 0,
            language: str | None = None,
            prompt: str | None = None,
            logprobs: bool = False,
            vad: bool | None = False,
        ) -> AsrTranscript:
            calls.append(samples.size)
            priorities.append(priority)
            hints.append((language, prompt))
            await asyncio.sleep(0.01)
            heard = asr_said(f"heard {samples.size}")
            heard.logprobs = [TokenLogprob(heard.text, -0.5, list(heard.text.encode()))] if logprobs else None
            return heard

    def audio(n: int, key: int, tentative: bool) -> UserAudio:
        return UserAudio(np.zeros(n, np.float32), 16_000, tentative=tentative, turn_key=key)

    async def run(frames: list[Frame], priority: int = 0, **hint: Any) -> list[str]:
        asr = ASR(Fake(), ASROptions(priority=priority, **hint))
        out = await Pipeline([asr]).run_all(frames)
        heard = [f.text for f in out if isinstance(f, Heard)]  # each told the client at once, as passed on
        assert heard == [f.text for f in out if isinstance(f, Transcript)]
        logprobs = [f.logprobs for f in out if isinstance(f, Heard)]
        assert logprobs == [[TokenLogprob(t, -0.5, list(t.encode()))] if hint.get("logprobs") else None for t in heard]
        return heard

    assert asyncio.run(run([audio(10, 1, True), audio(12, 1, False)])) == ["heard 10"] and calls == [10]
    calls.clear()
    assert asyncio.run(run([audio(10, 1, True), audio(30, 2, True), audio(40, 2, False)])) == ["heard 30"]
    calls.clear()
    assert asyncio.run(run([audio(10, 1, True), audio(50, 3, False)])) == ["heard 50"]
    assert set(priorities) == {0}
    # A live session's ASR (pipelines.realtime) asks for its encoder passes first: the early
    # transcription of a pause, then one of a turn that had none.
    calls.clear()
    priorities.clear()
    assert asyncio.run(run([audio(10, 1, True), audio(12, 1, False)], INTERACTIVE)) == ["heard 10"]
    assert asyncio.run(run([audio(60, 4, False)], INTERACTIVE)) == ["heard 60"]
    assert calls == [10, 60] and priorities == [INTERACTIVE, INTERACTIVE]
    # A session's transcription language and prompt reach both kinds of transcription.
    hints.clear()
    assert asyncio.run(run([audio(10, 5, True), audio(12, 5, False), audio(9, 6, False)], language="en", prompt="Oslo"))
    assert hints == [("en", "Oslo"), ("en", "Oslo")]
    # The transcript's logprobs, when asked for, reach the client's ``Heard``.
    calls.clear()
    assert asyncio.run(run([audio(10, 7, True), audio(12, 7, False)], logprobs=True)) == ["heard 10"]
    assert calls == [10]


def test_a_barge_in_cancels_the_replies_not_started_yet() -> None:
    """Speech that ended before the user spoke again gets no automatic reply: not the speech
    being transcribed, nor a transcript queued for the LLM; a queued response request is
    dropped. The transcripts still come (the conversation keeps them); later speech is answered."""
    from pipelines.frames import ResponseRequest
    from pipelines.services import Services
    from pipelines.speech import ASR

    class Fake(Services):
        async def transcribe(self, samples: np.ndarray, *_: object) -> AsrTranscript:
            await asyncio.sleep(0.2)
            return asr_said(f"said {samples.size}")

    class Busy(Processor):
        """A stage slow to take its frames (an LLM writing a reply), not interruptible."""

        async def process(self, frame: Frame) -> AsyncIterator[Frame]:
            await asyncio.sleep(0.4 if isinstance(frame, Transcript) else 0)
            yield frame

    def speech(n: int) -> UserAudio:
        return UserAudio(np.zeros(n, np.float32), 16_000, item_id=f"item_{n}")

    async def source() -> AsyncIterator[Frame]:
        # ASR: 1 (0-0.2 s), 2 (0.2-0.4), the request, 4 (0.4-0.6); Busy holds 1 till 0.6.
        for frame in (speech(1), speech(2), ResponseRequest(), speech(4)):
            yield frame
        await asyncio.sleep(0.5)  # 2 and the request queued at Busy, 4 being transcribed
        yield Interrupt()
        yield speech(5)

    async def run() -> list[Frame]:
        return [f async for f in Pipeline([ASR(Fake()), Busy()]).stream(source())]

    out = asyncio.run(run())
    said = [(f.item_id, f.respond) for f in out if isinstance(f, Transcript)]
    assert said == [("item_1", True), ("item_2", False), ("item_4", False), ("item_5", True)]
    assert not any(isinstance(f, ResponseRequest) for f in out)
    assert [f.text for f in out if isinstance(f, Heard)] == ["said 1", "said 2", "said 4", "said 5"]


def test_a_barge_in_is_counted_at_once_and_reaches_requests_before_its_stage() -> None:
    """A transcription that ends in the same step as a barge-in asks for no reply; a request
    for a reply queued before the stage that saw the speech, or made before the barge-in and
    passed on after it, is dropped, one made after it is not; a client's cancel (not a
    barge-in) leaves the user's speech its reply."""
    from pipelines.frames import AudioFrame, ResponseRequest
    from pipelines.services import Services
    from pipelines.speech import ASR

    events: list[asyncio.Event] = []

    class Waits(Services):
        async def transcribe(self, samples: np.ndarray, *_: object) -> AsrTranscript:
            await events[-1].wait()
            return asr_said("said")

    class Hears(Processor):
        """Speech starts in every audio frame (a VAD), slowly."""

        async def process(self, frame: Frame) -> AsyncIterator[Frame]:
            if isinstance(frame, AudioFrame):
                await asyncio.sleep(0.05)
                yield Interrupt()
            else:
                yield frame

    async def run(reason: str) -> list[Frame]:
        done = asyncio.Event()
        events.append(done)

        async def source() -> AsyncIterator[Frame]:
            early = ResponseRequest(metadata={"n": 1})
            yield UserAudio(np.zeros(3, np.float32), 16_000, item_id="item_a")
            await asyncio.sleep(0.02)
            done.set()
            yield Interrupt(reason)  # (from the source: in the step the transcription ends)
            yield AudioFrame(np.zeros(3, np.float32), 16_000)
            yield ResponseRequest(metadata={"n": 2})  # queued behind the audio at the VAD
            await asyncio.sleep(0.2)
            yield early  # made before the barge-in
            yield ResponseRequest(metadata={"n": 3})

        return [f async for f in Pipeline([Hears(), ASR(Waits())]).stream(source())]

    out = asyncio.run(run("speech_started"))
    assert [f.respond for f in out if isinstance(f, Transcript)] == [False]
    assert [f.metadata for f in out if isinstance(f, ResponseRequest)] == [{"n": 3}]
    out = asyncio.run(run("client_cancelled"))
    assert [f.respond for f in out if isinstance(f, Transcript)] == [True]


def test_a_barge_in_drops_the_requests_sent_before_the_speech_only() -> None:
    """Wire order: a ``response.create`` sent right after the audio in which the VAD hears speech
    start (queued behind it) stands; one sent before the audio, not yet taken, is dropped."""
    from pipelines.frames import AudioFrame, ResponseRequest
    from pipelines.speech import VAD
    from pipelines.vad import VADConfig

    audio = _spoken("Hello there, how are you today?")

    class Holds(Processor):
        """Requests wait here (a busy reply stage) until the speech has started."""

        def __init__(self) -> None:
            self.heard = asyncio.Event()

        async def process(self, frame: Frame) -> AsyncIterator[Frame]:
            if isinstance(frame, ResponseRequest):
                await self.heard.wait()
            yield frame

        async def on_interrupt(self, by: Interrupt) -> None:
            self.heard.set()

    async def run() -> list[Frame]:
        holds = Holds()

        async def source() -> AsyncIterator[Frame]:
            yield ResponseRequest(metadata={"n": 0})  # (taken by the stage: being worked on)
            yield ResponseRequest(metadata={"n": 1})  # sent before the speech: queued there
            yield AudioFrame(audio, 16_000)
            yield ResponseRequest(metadata={"n": 2})  # sent after it
            await holds.heard.wait()
            await asyncio.sleep(0.05)

        stages = [VAD(VADConfig(interrupt_response=True)), holds]
        return [f async for f in Pipeline(stages).stream(source())]

    out = asyncio.run(run())
    assert any(isinstance(f, Interrupt) for f in out)
    assert [f.metadata["n"] for f in out if isinstance(f, ResponseRequest)] == [0, 2]


def test_a_clients_cancel_stops_its_reply_only() -> None:
    """A client's cancel of the reply being spoken (``Interrupt`` with its ``response_id``)
    leaves the next reply, already being written behind it, to go on and be spoken."""
    from pipelines.conversation import Conversation
    from pipelines.frames import LLMStarted, ResponseRequest, TTSAudio, TTSDone
    from pipelines.reply import LLM
    from pipelines.services import Services
    from pipelines.speech import TTS, Sentences

    class Slow(Services):
        async def speak(self, text: str, *_: object, **__: object) -> AsyncIterator[np.ndarray]:
            for _ in range(4):
                await asyncio.sleep(0.1)  # (0.8 s a reply: the cancel at 0.25 s comes mid-speech)
                yield np.ones(10, np.float32)

    engine = _Replies(0.02)
    services = Slow(llm=engine, tts=object())
    pipe = Pipeline([LLM(services, Conversation("sys")), Sentences(), TTS(services)])

    async def source() -> AsyncIterator[Frame]:
        yield ResponseRequest()  # resp_000001: "You said sys. Fine." in two sentences
        yield Transcript("Next.", item_id="item_b")  # its reply is written while the first is spoken
        await asyncio.sleep(0.25)
        yield Interrupt("client_cancelled", "resp_000001")
        await asyncio.sleep(2.0)
        yield End()

    async def run() -> list[Frame]:
        return [f async for f in pipe.stream(source())]

    out = asyncio.run(run())
    started = [f.response_id for f in out if isinstance(f, LLMStarted)]
    assert len(started) == 2 and started[0] == "resp_000001"
    done = [f.response_id for f in out if isinstance(f, TTSDone)]
    assert done == [started[1]]  # the first was cut, the second spoken to its end
    cut = out.index(next(f for f in out if isinstance(f, Interrupt)))
    assert not any(isinstance(f, TTSAudio) and f.response_id == started[0] for f in out[cut:])
    assert sum(isinstance(f, TTSAudio) and f.response_id == started[1] for f in out) == 8  # 2 sentences


def test_a_reply_answers_the_conversation_as_it_was_when_asked_for() -> None:
    """An item the client adds after asking for a reply (a response.create, or the end of a
    turn that gets one), before that reply starts, is not in its prompt, and the reply's item
    goes before it; the next reply has it."""
    from pipelines.conversation import Conversation
    from pipelines.frames import LLMStarted, ResponseRequest
    from pipelines.reply import LLM
    from pipelines.services import Services

    engine = _Replies(0.0)
    conv = Conversation("sys")
    llm = LLM(Services(llm=engine), conv)
    conv.add("user", "Hi.", client=True)
    asked = ResponseRequest(asked=conv.clock)  # (a response.create)
    conv.add("user", "Later.", "late", client=True)
    out = asyncio.run(Pipeline([llm]).run_all([asked]))
    assert engine.requests[-1][1] == str(["sys", "Hi."])
    reply = next(f for f in out if isinstance(f, LLMStarted)).item_id
    assert [i.id for i in conv.items][1:] == [reply, "late"]
    # A turn's automatic reply was asked for when its speech was committed.
    conv.add("user", "", "speech", audio=True, pending=True)
    conv.add("user", "Not yet.", "late2", client=True)
    asyncio.run(Pipeline([llm]).run_all([Transcript("Bye.", item_id="speech")]))
    assert engine.requests[-1][1] == str(["sys", "Hi.", "You said Hi.. Fine.", "Later.", "Bye."])
    assert [(i.id, i.role) for i in conv.items][3::2] == [("speech", "user"), ("late2", "user")]
    assert conv.items[4].role == "assistant" and conv.items[4].text == "You said Bye.. Fine."
    asyncio.run(Pipeline([llm]).run_all([ResponseRequest(asked=conv.clock)]))
    assert eval(engine.requests[-1][1])[-1] == "Not yet."  # noqa: S307 - the fake's repr of a list of str
    # The output of a call made before is not late: a call's output must follow it.
    conv.add("assistant", "{}", kind="function_call", call_id="call_1", name="f")
    asked_at = conv.clock
    conv.add("tool", "21", kind="function_call_output", call_id="call_1", client=True)
    conv.add("user", "And?", client=True)
    assert [i.text for i in conv.later(asked_at)] == ["And?"]


def test_a_reply_keeps_the_items_the_client_deleted_after_asking_for_it() -> None:
    """A delete that comes after a reply was asked for, before it starts, leaves that reply's
    prompt as it was (the item where it was, among those left out if it was); the next reply
    has it no more, nor has a reply asked for after a delete; the session's own removals (a
    cancelled reply's items) are not put back."""
    from pipelines.conversation import Conversation
    from pipelines.frames import ResponseRequest
    from pipelines.reply import LLM
    from pipelines.services import Services

    engine = _Replies(0.0)
    conv = Conversation("sys")
    llm = LLM(Services(llm=engine), conv)
    for k, text in enumerate(("One.", "Two.", "Three.")):
        conv.add("user", text, f"u{k}", client=True)
    conv.remove("u0", client=True)  # (before the request: gone for it)
    asked = ResponseRequest(asked=conv.clock)
    conv.add("user", "Gone.", "mine")  # the session's own item ...
    conv.remove("mine")  # ... removed (not a delete of the client's)
    conv.remove("u2", client=True)
    conv.remove("u1", client=True)  # (u2's neighbour when u2 went: both come back, in order)
    asyncio.run(Pipeline([llm]).run_all([asked]))
    assert engine.requests[-1][1] == str(["sys", "Two.", "Three."])
    assert [i.text for i in conv.items] == ["You said Three.. Fine."]  # (live: deleted)
    asyncio.run(Pipeline([llm]).run_all([ResponseRequest(asked=conv.clock)]))
    assert engine.requests[-1][1] == str(["sys", "You said Three.. Fine."])
    # An item among those left out to fit comes back left out.
    conv.add("user", "Four.", "u4", client=True)
    conv._first = 2  # (the two replies no longer fit)
    asked_at = conv.clock
    conv.remove(conv.items[1].id, client=True)
    assert conv._first == 1
    view = conv.as_asked(asked_at, [])
    assert view._first == 2 and [i.text for i in view.items[view._first :]] == ["Four."]
    # An item added after the ask and deleted stays out; one whose neighbour then came after the
    # ask goes back after the neighbour before that.
    conv = Conversation("sys")
    conv.add("user", "A", "a", client=True)
    conv.add("user", "B", "b", client=True)
    asked_at = conv.clock
    conv.add("user", "X", "x", client=True)
    conv.remove("x", client=True)
    conv.add("user", "Y", "y", after="a", client=True)  # [a, y, b]
    conv.remove("b", client=True)
    view = conv.as_asked(asked_at, conv.later(asked_at))
    assert [i.id for i in view.items] == ["a", "b"]


def test_chain_stages_skip_done_and_cancelled_work() -> None:
    from pipelines.chain import run_local, run_stage
    from pipelines.services import Services
    from pipelines.stage_store import ChainOptions, StageStore

    store = StageStore(None)  # the in-process store (local dispatch without Redis)
    store.create("c", _spoken("Good morning."), ChainOptions(respond=False))
    asyncio.run(run_stage(store, "c", "vad", Services()))
    first = store.output("c", "vad")
    assert first and isinstance(first[0], UserAudio) and store.attempts("c", "vad") == 1
    asyncio.run(run_stage(store, "c", "vad", Services()))  # already done: not run again
    assert store.attempts("c", "vad") == 1

    def stop() -> None:
        raise RuntimeError("cancelled by the client")

    with pytest.raises(RuntimeError):
        asyncio.run(run_local(store, "c", Services(), stop))
    assert store.attempts("c", "asr") == 0
    store.set_status("c", "cancelled")
    asyncio.run(run_stage(store, "c", "asr", Services()))  # a cancelled chain's stages are no-ops
    assert store.output("c", "asr") is None and store.status("c")["status"] == "cancelled"


def test_a_chain_stage_refused_for_its_input_is_not_retried() -> None:
    """An LLM stage the engine refuses for its prompt (too long) fails the chain at its first
    attempt, with the route's message (it was tried ``max_attempts`` times); a failure that is
    no refusal is still retried."""
    from engine.errors import PromptTooLongError
    from pipelines.chain import run_local
    from pipelines.services import Services
    from pipelines.stage_store import ChainOptions, StageStore

    class Engine:
        tokenizer = type("Tok", (), {"apply_chat_template": lambda self, m, **_: [1, 2, 3]})()
        max_model_len = 4096

        def __init__(self, error: Exception) -> None:
            self.error = error

        async def generate(self, *_: object, **__: object) -> AsyncIterator[object]:
            raise self.error
            yield  # an async generator, like AsyncEngine.generate

    for error, attempts in ((PromptTooLongError(5000, 64, 4096), 1), (RuntimeError("the engine broke"), 3)):
        store = StageStore(None)
        store.create("c", np.zeros(1600, np.float32), ChainOptions(speak=False, max_attempts=3))
        store.finish("c", "vad", [UserAudio(np.zeros(1600, np.float32), 16_000, 0, 100, item_id="u")], 0.0)
        store.finish("c", "asr", [Transcript("Tell me everything.", item_id="u")], 0.0)
        with pytest.raises(Exception) as failed:
            asyncio.run(run_local(store, "c", Services(llm=Engine(error))))
        assert store.attempts("c", "llm") == attempts, (error, store.attempts("c", "llm"))
        assert str(error) in str(failed.value) and store.status("c")["status"] == "failed"


class BusyLLM:
    """An LLM engine whose queue is full for its first ``refusals`` requests (``QueueFullError``:
    the routes' 429 with Retry-After), then replies ``reply``."""

    modality = "llm"
    max_model_len = 4096
    tokenizer = type("Tok", (), {"apply_chat_template": lambda _, m, **__: [1, 2, 3]})()

    def __init__(self, refusals: int, reply: str = "Paris.") -> None:
        self.refusals, self.reply = refusals, reply

    async def generate(self, *args: object, **kw: object) -> AsyncIterator[object]:
        from types import SimpleNamespace

        from engine.errors import QueueFullError

        if self.refusals > 0:
            self.refusals -= 1
            raise QueueFullError(9)
        out = SimpleNamespace(delta_text=self.reply, token_ids=[1], finish_reason="stop")
        yield SimpleNamespace(outputs=[out], finished=True, num_cached_tokens=0)


def chain_at_llm(store: Any, chain_id: str, **opts: Any) -> None:
    """A chain (no TTS) in ``store`` whose VAD and ASR stages are done: its LLM stage is next."""
    from pipelines.stage_store import ChainOptions

    store.create(chain_id, np.zeros(1600, np.float32), ChainOptions(speak=False, **opts))
    store.finish(chain_id, "vad", [UserAudio(np.zeros(1600, np.float32), 16_000, 0, 100, item_id="u")], 0.0)
    store.finish(chain_id, "asr", [Transcript("What is the capital of France?", item_id="u")], 0.0)


def test_a_chain_stage_a_busy_engine_refuses_waits_for_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """(Local dispatch.) An LLM stage refused by a full engine queue (the route's 429) waits and
    is tried again without using up an attempt: refused more times than ``max_attempts``, it
    succeeds at its first counted attempt, and progress shows ``waiting_for_capacity`` meanwhile.
    Refused for longer than the chain's ``max_wait_s``, it fails the chain with the route's 429."""
    import pipelines.chain as chain
    from gateway.errors import APIError
    from pipelines.services import Services
    from pipelines.stage_store import StageStore

    monkeypatch.setattr(chain, "MAX_WAIT_S", 0.02)  # (the engine asks for 1 s: the cap shortens it)
    store = StageStore(None)
    chain_at_llm(store, "c", max_attempts=2)
    details: list[dict[str, Any]] = []
    out = asyncio.run(
        chain.run_local(store, "c", Services(llm=BusyLLM(5)), progress=lambda *_, detail: details.append(detail))
    )
    assert out["reply"] == "Paris." and store.status("c")["status"] == "succeeded"
    llm = store.status("c")["stages"]["llm"]
    assert llm["attempts"] == 1 and 0.05 < llm["waited_s"] < 0.2, llm
    waits = [d for d in details if d.get("waiting_for_capacity")]
    assert len(waits) == 5 and all(d["waiting_for_capacity"] == "llm" and d["stage"] == "llm" for d in waits)
    assert "waiting_for_capacity" not in details[-1]

    store = StageStore(None)
    chain_at_llm(store, "d", max_attempts=2, max_wait_s=0.1)
    with pytest.raises(APIError) as failed:
        asyncio.run(chain.run_local(store, "d", Services(llm=BusyLLM(1000))))
    assert failed.value.status_code == 429 and "waited 0.1 s for capacity" in failed.value.message
    assert store.status("d")["status"] == "failed" and store.status("d")["stages"]["llm"]["attempts"] == 1
    assert store.failure("d")["type"] == "rate_limit_error" and store.failure("d")["code"] == "rate_limit_exceeded"


def test_a_running_stage_stops_once_its_chain_ends_or_is_sent_again() -> None:
    """``while_live``: a stage's work runs to its result while its chain wants it; once the chain
    is cancelled (its job was) or sent again under another dispatch, the work is cancelled within
    a check (not left to run an LLM decode to its end on the worker) and nothing is returned."""
    from pipelines.chain import LIVE_CHECK_S, while_live
    from pipelines.stage_store import ChainOptions, StageStore

    store = StageStore(None)
    store.create("c", np.zeros(1600, np.float32), ChainOptions())
    stopped: list[float] = []

    async def forever() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            stopped.append(time.monotonic())
            raise
        return "never"

    async def answer() -> str:
        await asyncio.sleep(2 * LIVE_CHECK_S)  # (past a check or two)
        return "done"

    async def go(end: Callable[[], None]) -> float:
        async def later() -> None:
            await asyncio.sleep(0.3)
            end()

        asyncio.get_running_loop().create_task(later())
        assert await asyncio.wait_for(while_live(store, "c", 0, forever()), 30) is None  # (not forever)
        return time.monotonic()

    assert asyncio.run(while_live(store, "c", 0, answer())) == "done"
    returned = asyncio.run(go(lambda: store.r.hset(store.meta_key("c"), mapping={"dispatch": 1})))  # sent again
    assert stopped and stopped[-1] <= returned
    returned = asyncio.run(go(lambda: store.set_status("c", "cancelled")))
    assert len(stopped) == 2 and stopped[-1] <= returned


def test_a_chain_that_ended_is_not_shown_running_or_waiting_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """``begin``, ``wait`` and ``finish`` write only while the chain is live for their dispatch,
    in one transaction with that check: on a cancelled chain (and one sent again) they write
    nothing, so it is not shown running or waiting again and its next stage does not run. On
    the real Redis (db 14) a cancel landing between the check and the write (another client,
    in the transaction's window) makes it look again. (A check then a write showed a chain
    cancelled in between as ``waiting:llm``, and the delayed retry ran its LLM and TTS.)"""
    import uuid

    import numpy as np
    import redis as redis_lib

    from pipelines.stage_store import ChainOptions, StageStore

    stores = [StageStore(None)]
    try:
        redis_lib.Redis.from_url("redis://127.0.0.1:6379/14", socket_connect_timeout=1).ping()
        stores.append(StageStore("redis://127.0.0.1:6379/14", f"t-live-{uuid.uuid4().hex[:8]}", ttl_s=60))
    except redis_lib.exceptions.RedisError:
        pass
    for store in stores:
        store.create("c", np.zeros(160, np.float32), ChainOptions())
        assert store.begin("c", "vad", "w1", 0) == 1 and store.wait("c", "vad", 1.0, 0)
        assert store.meta("c")[b"status"] == b"waiting:vad"
        assert store.begin("c", "vad", "w1", 1) == 0  # (a stale dispatch)
        store.set_status("c", "cancelled")
        assert store.begin("c", "vad", "w1", 0) == 0 and not store.wait("c", "vad", 1.0, 0)
        assert not store.finish("c", "vad", [], 0.1, 0)
        meta = store.meta("c")
        assert meta[b"status"] == b"cancelled" and meta[b"vad.attempts"] == b"0" and b"vad.finished" not in meta
    if len(stores) == 2:  # a cancel inside the transaction's window: its write does not land
        store = stores[1]
        store.create("d", np.zeros(160, np.float32), ChainOptions())
        other = redis_lib.Redis.from_url("redis://127.0.0.1:6379/14")
        watch = redis_lib.client.Pipeline.watch
        cancelled: list[bool] = []

        def watch_then_cancel(self: Any, *keys: str) -> Any:
            out = watch(self, *keys)
            if not cancelled:  # (once: the transaction then looks again, and finds it cancelled)
                cancelled.append(other.hget(keys[0], "status") == b"queued")
                other.hset(keys[0], "status", "cancelled")
            return out

        monkeypatch.setattr(redis_lib.client.Pipeline, "watch", watch_then_cancel)
        assert not store.wait("d", "vad", 1.0, 0)
        assert cancelled == [True] and store.meta("d")[b"status"] == b"cancelled"


def test_vad_segmenter_reports_speech_resuming_after_a_pause() -> None:
    from pipelines.vad import VADConfig, VADSegmenter

    a, b = _spoken("Hello there."), _spoken("How are you today?")
    audio = np.concatenate([a[: -16000 + 3200], b[8000:]])  # 0.2 s of silence between the phrases (and Piper's)
    seg = VADSegmenter(VADConfig(silence_duration_ms=600, eager_ms=150))
    kinds = [ev.kind for i in range(0, audio.size, 320) for ev in seg.feed(audio[i : i + 320])]
    assert kinds == ["start", "pause", "resume", "pause", "stop"]


def test_vad_segmenter_pauses_again_after_a_blip_too_short_to_resume_the_turn() -> None:
    """A blip of speech after a pause (shorter than ``min_speech_ms``) moves the turn's end: the
    pause is withdrawn (resume) and a new one comes after the blip, with the key of the stop."""
    from pipelines.vad import VADConfig, VADSegmenter

    a = _spoken("Hello there, how are you today?")
    end = int(np.flatnonzero(np.abs(a) > 0.02)[-1])
    blip = a[end - 1600 : end]  # the utterance's last 100 ms again, 300 ms after it
    audio = np.concatenate([a[: end + 4800], blip, np.zeros(16000, np.float32)])
    seg = VADSegmenter(VADConfig(silence_duration_ms=600, eager_ms=150, min_speech_ms=150))
    events = [ev for i in range(0, audio.size, 320) for ev in seg.feed(audio[i : i + 320])]
    kinds = [e.kind for e in events]
    assert kinds[-3:] == ["resume", "pause", "stop"], kinds
    assert events[-2].key == events[-1].key  # the last pause's transcript is the turn's
    assert events[-1].samples[: events[-2].samples.size].tolist() == events[-2].samples.tolist()


def test_vad_segmenter_takes_a_whole_utterance_in_one_chunk() -> None:
    """A client may append a recording at once: the utterance is cut from the right samples."""
    from pipelines.vad import VADConfig, VADSegmenter

    audio = _spoken("Hello there, how are you today?")
    one = VADSegmenter(VADConfig(silence_duration_ms=500)).feed(audio)
    seg = VADSegmenter(VADConfig(silence_duration_ms=500))
    chunked = [ev for i in range(0, audio.size, 640) for ev in seg.feed(audio[i : i + 640])]
    chunked = [e for e in chunked if e.kind in ("start", "stop")]  # and pauses, by 40 ms chunks
    assert [e.kind for e in one] == [e.kind for e in chunked] == ["start", "stop"]
    assert one[1].key == chunked[-1].key and one[1].samples.size > 16000
    assert one[1].samples.tolist() == chunked[-1].samples.tolist()


class _Replies:
    """A streaming LLM engine: answers "You said <the last user message>. Fine." word by word,
    recording requests and the ones aborted before they finished."""

    max_model_len = 4096

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.requests: list[tuple[str, str]] = []
        self.priorities: list[int] = []
        self.aborted: list[str] = []
        self.tokenizer = type(
            "Tok", (), {"apply_chat_template": lambda _, m, **__: [ord(c) for c in str([x["content"] for x in m])]}
        )()

    async def generate(
        self, request_id: str, ids: list[int], params: object, priority: int = 0
    ) -> AsyncIterator[object]:
        from types import SimpleNamespace

        prompt = "".join(map(chr, ids))
        self.requests.append((request_id, prompt))
        self.priorities.append(priority)
        words = f"You said {eval(prompt)[-1]}. Fine.".split(" ")  # noqa: S307 - our own repr of a list of str
        done = False
        try:
            for i, w in enumerate(words):
                await asyncio.sleep(self.delay)
                done = i == len(words) - 1
                out = SimpleNamespace(delta_text=(" " if i else "") + w, token_ids=list(range(i + 1)))
                yield SimpleNamespace(outputs=[out], finished=done, num_cached_tokens=0)
        finally:
            if not done:
                self.aborted.append(request_id)


class _Speech:
    """Fake ASR ("heard <n samples>") and TTS (three chunks per text) counting open streams."""

    def __init__(self) -> None:
        self.transcribed: list[int] = []
        self.spoken: list[str] = []
        self.open = 0
        self.committed = asyncio.Event()
        self.before_commit: list[str] = []  # texts whose synthesis began before the commit

    async def transcribe(
        self,
        samples: np.ndarray,
        priority: int = 0,
        language: str | None = None,
        prompt: str | None = None,
        logprobs: bool = False,
        vad: bool | None = False,
    ) -> AsrTranscript:
        self.transcribed.append(samples.size)
        await asyncio.sleep(0.02)
        return asr_said(f"heard {samples.size}")

    async def speak(
        self, text: str, voice: str | None, rate: int, priority: int = 0, speed: float = 1.0
    ) -> AsyncIterator[np.ndarray]:
        self.spoken.append(text)
        if not self.committed.is_set():
            self.before_commit.append(text)
        self.open += 1
        try:
            for _ in range(3):
                await asyncio.sleep(0.01)
                yield np.ones(10, np.float32)
        finally:
            self.open -= 1


def _speculating(llm_delay: float, frames: list[tuple[float, Frame]]) -> tuple[list[Frame], _Replies, _Speech, object]:
    """Run ASR → LLM → Sentences → TTS over ``frames`` (each after its delay) and End; every
    output frame must come after the last frame was sent (the commit): nothing leaks earlier."""
    from pipelines.conversation import Conversation
    from pipelines.reply import LLM
    from pipelines.services import Services
    from pipelines.speculation import SpeechPrefetch
    from pipelines.speech import ASR, TTS, Sentences, TTSOptions

    engine, speech = _Replies(llm_delay), _Speech()
    services = Services(llm=engine, tts=object())
    services.transcribe = speech.transcribe  # type: ignore[method-assign]
    services.speak = speech.speak  # type: ignore[method-assign]
    conv, options = Conversation("sys"), TTSOptions()
    prefetch = SpeechPrefetch(services, options)
    pipe = Pipeline(
        [ASR(services), LLM(services, conv, prefetch=prefetch), Sentences(), TTS(services, options, prefetch)]
    )
    committed = speech.committed

    async def source() -> AsyncIterator[Frame]:
        for i, (delay, frame) in enumerate(frames):
            await asyncio.sleep(delay)
            if i == len(frames) - 1:
                committed.set()
            yield frame
        await asyncio.sleep(0.5)  # the reply runs to its end
        yield End()

    async def go() -> list[Frame]:
        out = []
        async for f in pipe.stream(source()):
            assert committed.is_set(), f"{f} reached the client before the turn was committed"
            out.append(f)
        return out

    return asyncio.run(go()), engine, speech, conv


def _utterance(n: int, key: int, tentative: bool) -> UserAudio:
    return UserAudio(np.zeros(n, np.float32), 16_000, item_id="item_in_1", tentative=tentative, turn_key=key)


def test_speculative_reply_is_reused_when_the_turn_commits() -> None:
    from pipelines.frames import LLMStarted, TTSAudio, TTSDone

    frames = [(0.0, _utterance(100, 7, True)), (0.3, _utterance(120, 7, False))]  # only silence after the pause
    out, engine, speech, conv = _speculating(0.01, frames)
    assert speech.transcribed == [100]  # the pause's transcript
    assert [rid.split("-")[0] for rid, _ in engine.requests] == ["spec"] and engine.aborted == []
    assert speech.spoken == ["You said heard 100.", "Fine."] and speech.open == 0
    assert speech.before_commit == ["You said heard 100."]  # the first sentence was prefetched
    kinds = [type(f).__name__ for f in out if not isinstance(f, End)]
    assert kinds[:3] == ["Heard", "Transcript", "LLMStarted"] and kinds[-2:] == ["LLMDone", "TTSDone"]
    transcript = next(f for f in out if isinstance(f, Transcript))
    assert transcript.text == "heard 100" and not transcript.tentative
    reply = "".join(f.text for f in out if isinstance(f, TextDelta))
    assert reply == "You said heard 100. Fine."
    started = next(f for f in out if isinstance(f, LLMStarted))
    assert {f.response_id for f in out if isinstance(f, TTSAudio | TTSDone | LLMDone)} == {started.response_id}
    assert sum(isinstance(f, TTSAudio) for f in out) == 6  # both sentences spoken
    assert [(i.role, i.text) for i in conv.items] == [("user", "heard 100"), ("assistant", reply)]  # type: ignore[attr-defined]


def test_speculation_is_aborted_when_speech_resumes() -> None:
    from pipelines.frames import SpeechResumed

    frames = [
        (0.0, _utterance(100, 7, True)),
        (0.1, SpeechResumed()),  # the speculative reply is being generated
        (0.1, _utterance(200, 9, False)),  # the whole utterance
    ]
    out, engine, speech, conv = _speculating(0.03, frames)
    assert speech.transcribed == [100, 200]
    (spec_id, _), (reply_id, prompt) = engine.requests
    assert spec_id.startswith("spec-") and engine.aborted == [spec_id]  # aborted inside the engine
    assert reply_id.startswith("resp_") and "heard 200" in prompt and "heard 100" not in prompt
    assert "".join(f.text for f in out if isinstance(f, TextDelta)) == "You said heard 200. Fine."
    assert [f.text for f in out if isinstance(f, Transcript)] == ["heard 200"]
    assert speech.open == 0 and "You said heard 100." not in speech.spoken
    assert [i.text for i in conv.items][0] == "heard 200"  # type: ignore[attr-defined]


def test_speculation_is_redone_when_more_speech_was_committed() -> None:
    """A committed turn with speech after the pause (another ``turn_key``) and no resume event."""
    frames = [(0.0, _utterance(100, 7, True)), (0.3, _utterance(150, 8, False))]
    out, engine, speech, _ = _speculating(0.01, frames)
    assert speech.transcribed == [100, 150]
    assert [rid.split("-")[0] for rid, _ in engine.requests] == ["spec", "resp_000001"]
    assert "".join(f.text for f in out if isinstance(f, TextDelta)) == "You said heard 150. Fine."
    assert speech.spoken == ["You said heard 100.", "You said heard 150.", "Fine."] and speech.open == 0


def test_a_realtime_session_asks_for_interactive_priority() -> None:
    """A live voice turn's encoder passes go ahead of bulk transcriptions, and its LLM requests
    ahead of chat requests under the engine's priority policy."""
    from types import SimpleNamespace

    from engine.foreground import INTERACTIVE
    from pipelines.realtime import RealtimeSession
    from pipelines.reply import LLM
    from pipelines.services import Services
    from pipelines.speech import ASR

    ws = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace()))  # nothing is sent or received
    session = RealtimeSession(ws, Services(), "m")  # type: ignore[arg-type]
    assert [s.options.priority for s in session.pipeline.stages if isinstance(s, ASR)] == [INTERACTIVE]
    assert [s.options for s in session.pipeline.stages if isinstance(s, ASR)][0] is session.asr_options  # live
    assert [s.options.priority for s in session.pipeline.stages if isinstance(s, LLM)] == [INTERACTIVE]


def test_a_pauses_transcript_is_kept_only_while_the_language_and_prompt_stand() -> None:
    """The session's transcription options reach the ASR; a transcript begun at a pause is taken by
    its commit only if a session.update has not changed them meanwhile."""
    from pipelines.frames import Transcript
    from pipelines.services import Services
    from pipelines.speech import ASR, ASROptions

    heard: list[tuple[str | None, str | None]] = []

    async def transcribe(
        samples: np.ndarray,
        priority: int = 0,
        language: str | None = None,
        prompt: str | None = None,
        logprobs: bool = False,
        vad: bool | None = False,
    ) -> AsrTranscript:
        heard.append((language, prompt))
        return asr_said(f"heard in {language}")

    services = Services()
    services.transcribe = transcribe  # type: ignore[method-assign]

    async def turn(change: bool) -> list[str]:
        options = ASROptions(language="en", prompt="Oslo")
        asr = ASR(services, options)
        assert [f async for f in asr.process(_utterance(100, 7, True))] == []  # runs in the background
        await asyncio.sleep(0.01)
        if change:
            options.language = "de"  # a session.update between the pause and the commit
        return [f.text for f in [f async for f in asr.process(_utterance(120, 7, False))] if isinstance(f, Transcript)]

    assert asyncio.run(turn(False)) == ["heard in en"] and heard == [("en", "Oslo")]
    heard.clear()
    assert asyncio.run(turn(True)) == ["heard in de"] and heard == [("en", "Oslo"), ("de", "Oslo")]


def test_the_llm_stage_asks_the_engine_for_its_priority() -> None:
    from engine.foreground import INTERACTIVE
    from pipelines.conversation import Conversation
    from pipelines.frames import ResponseRequest
    from pipelines.reply import LLM, LLMOptions
    from pipelines.services import Services

    for options, priority in ((None, 0), (LLMOptions(priority=INTERACTIVE), INTERACTIVE)):
        engine = _Replies(0.0)
        asyncio.run(Pipeline([LLM(Services(llm=engine), Conversation("sys"), options)]).run_all([ResponseRequest()]))
        assert engine.priorities == [priority]


class _Scripted:
    """A streaming LLM engine that writes the given pieces."""

    max_model_len = 4096
    tokenizer = type("Tok", (), {"apply_chat_template": lambda _, m, **__: [1, 2, 3]})()

    def __init__(self, pieces: list[str], finish: str = "stop") -> None:
        self.pieces = pieces
        self.finish = finish

    async def generate(
        self, request_id: str, ids: list[int], params: object, priority: int = 0
    ) -> AsyncIterator[object]:
        from types import SimpleNamespace

        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            out = SimpleNamespace(
                delta_text=piece, token_ids=list(range(i + 1)), finish_reason=self.finish if last else None
            )
            yield SimpleNamespace(outputs=[out], finished=last, num_cached_tokens=0)


def test_a_reply_is_charged_to_its_budget_and_settled_to_what_it_used() -> None:
    """``LLMOptions.budget`` (a realtime session's tenant) pays a reply's prompt + ``max_tokens``
    before the engine starts it (``LLMReserved`` says how many), settled to what it used: its
    prompt and what it wrote; a reply the engine refused, nothing. A budget that refuses fails
    the reply with its error before any engine request."""
    from engine.errors import QueueFullError
    from gateway.errors import APIError
    from gateway.ratelimit import Charge, MemoryRateLimiter
    from pipelines.conversation import Conversation
    from pipelines.frames import LLMDone, LLMReserved, LLMStarted, ResponseRequest, TextDelta
    from pipelines.reply import LLM, LLMOptions
    from pipelines.services import Services

    limiter, key, limit = MemoryRateLimiter(), "acme:llm_tokens", 600.0  # (refills 10/s)

    async def budget(tokens: int) -> Charge:
        if await limiter.take(key, tokens, limit):
            raise APIError(429, "Rate limit reached for tenant 'acme'", code="rate_limit_exceeded")
        return Charge(limiter, key, tokens, limit)

    class Refusing(_Scripted):
        async def generate(self, *_: object, **__: object) -> AsyncIterator[object]:
            raise QueueFullError(1, 1)
            yield  # an async generator, like AsyncEngine.generate

    async def reply(engine: object, max_tokens: int = 64) -> list[Frame]:
        llm = LLM(Services(llm=engine), Conversation("sys"), LLMOptions(max_tokens=max_tokens, budget=budget))
        return await Pipeline([llm]).run_all([ResponseRequest()])

    async def go() -> None:
        out = await reply(_Scripted(["Paris", " is", " there."]))  # a prompt of 3 tokens, 3 written
        assert [type(f) for f in out[:3]] == [LLMStarted, LLMReserved, TextDelta]
        assert out[1].tokens == 3 + 64 and out[1].settle is not None
        assert isinstance(out[-1], LLMDone) and out[-1].error is None
        assert 600 - 6 <= await limiter.level(key, limit) < 600 - 6 + 1  # settled: 6 of 67
        await out[1].settle(67)  # (the session's settle after the reply's own: the first one counts)
        assert 600 - 6 <= await limiter.level(key, limit) < 600 - 6 + 1
        refused = await reply(Refusing([]))
        assert refused[-1].error_code == "rate_limit_exceeded"  # (the engine's full queue)
        assert 600 - 6 <= await limiter.level(key, limit) < 600 - 6 + 1  # refunded
        out = await reply(_Scripted(["Never."]), max_tokens=596)  # 599 > the 594 left: refused
        assert [type(f) for f in out] == [LLMStarted, LLMDone]
        assert (out[-1].error_type, out[-1].error_code) == ("rate_limit_error", "rate_limit_exceeded")
        assert "acme" in (out[-1].error or "") and out[-1].completion_tokens == 0

    asyncio.run(go())


def test_a_cut_replys_charge_counts_what_it_wrote_and_a_charge_cut_while_taken_is_given_back() -> None:
    """A reply cut after writing 12 tokens, whose session has played only the first (its audio
    behind the text) and settles first at ``response.done``, is charged the 12; a reply cancelled
    while its budget is being taken (a barge-in during the Redis round trip) gets it back."""
    from gateway.ratelimit import Charge, MemoryRateLimiter
    from pipelines.conversation import Conversation
    from pipelines.frames import LLMReserved, ResponseRequest, TextDelta
    from pipelines.reply import LLM, LLMOptions
    from pipelines.services import Services

    limiter, limit = MemoryRateLimiter(), 600.0  # (refills 10 a second)
    taking = asyncio.Event()

    def llm(key: str, pause_s: float = 0.0) -> LLM:
        async def budget(tokens: int) -> Charge:
            await limiter.take(key, tokens, limit)
            taking.set()
            await asyncio.sleep(pause_s)  # (the rest of the round trip)
            return Charge(limiter, key, tokens, limit)

        engine = _Scripted([f" w{i}" for i in range(20)])
        return LLM(Services(llm=engine), Conversation("sys"), LLMOptions(max_tokens=64, budget=budget))

    async def go() -> None:
        frames = llm("cut").process(ResponseRequest())
        reserved = None
        async for f in frames:
            if isinstance(f, LLMReserved):
                reserved = f
            elif isinstance(f, TextDelta) and f.completion_tokens == 12:
                break
        assert reserved is not None and reserved.settle is not None
        await reserved.settle(3 + 1)  # (the session: the prompt and the one token it played)
        await frames.aclose()  # (the reply is cut)
        assert 600 - 15 <= await limiter.level("cut", limit) < 600 - 15 + 3  # the prompt and the 12 written
        taking.clear()
        cut = asyncio.ensure_future(Pipeline([llm("taking", 0.2)]).run_all([ResponseRequest()]))
        await taking.wait()
        assert await limiter.level("taking", limit) < 600 - 60  # (taken: 3 + 64)
        cut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut
        await asyncio.sleep(0.4)
        assert await limiter.level("taking", limit) == 600  # given back

    asyncio.run(go())


def test_a_replys_calls_stream_one_after_the_other_and_end_its_message() -> None:
    from pipelines.conversation import Conversation
    from pipelines.frames import LLMDone, ResponseRequest, TextDelta, ToolCall, ToolCallArguments, ToolCallStarted
    from pipelines.reply import LLM, LLMOptions
    from pipelines.services import Services

    pieces = ["Sure.", " <tool_call>", '{"name": "f", "arguments": {"a"', ": 1}}</tool_call>\n<tool_call>"]
    pieces += ['{"name": "g", "arguments": {}}</tool_call> Done, I', " said it."]  # (text after a call: unsaid)
    conv = Conversation("sys")
    llm = LLM(Services(llm=_Scripted(pieces)), conv, LLMOptions(tool_calls=frozenset({"f", "g"})))
    frames = asyncio.run(Pipeline([llm]).run_all([ResponseRequest()]))
    kinds = [(type(f).__name__, getattr(f, "text", getattr(f, "delta", getattr(f, "name", "")))) for f in frames]
    assert kinds[1:] == [
        ("LLMReserved", ""),
        ("TextDelta", "Sure."),
        ("ToolCallStarted", "f"),
        ("ToolCallArguments", '{"a"'),
        ("ToolCallArguments", ": 1}"),
        ("ToolCall", "f"),  # whole once its block closes, before the next call starts
        ("ToolCallStarted", "g"),
        ("ToolCallArguments", "{}"),
        ("ToolCall", "g"),
        ("LLMDone", "Sure."),
    ]
    calls = [f for f in frames if isinstance(f, ToolCall)]
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", "{}")]
    assert [f.item_id for f in frames if isinstance(f, ToolCallStarted | ToolCallArguments)] == [
        calls[0].item_id
    ] * 3 + [calls[1].item_id] * 2
    assert [(i.kind, i.text, i.status) for i in conv.items] == [
        ("message", "Sure.", "completed"),
        ("function_call", '{"a": 1}', "completed"),
        ("function_call", "{}", "completed"),
    ]
    assert not any(isinstance(f, TextDelta) and "Done" in f.text for f in frames)
    assert isinstance(frames[-1], LLMDone) and not frames[-1].cut
    # cut at max_tokens while a call is written: that call never becomes whole; the reply is cut
    llm = LLM(Services(llm=_Scripted(pieces[:3], "length")), Conversation("sys"), LLMOptions(tool_calls=frozenset("f")))
    frames = asyncio.run(Pipeline([llm]).run_all([ResponseRequest()]))
    assert [type(f).__name__ for f in frames[3:]] == ["ToolCallStarted", "ToolCallArguments", "LLMDone"]
    assert frames[-1].cut


def test_realtime_ga_session_patch_and_event_translation() -> None:
    from pipelines.realtime_config import SessionConfig
    from pipelines.realtime_events import EventError
    from pipelines.realtime_ga import ga_error, ga_param, is_ga, session_object, session_patch, translate

    assert is_ga({"type": "realtime"}) and not is_ga({"modalities": ["text"]})
    with pytest.raises(EventError):
        is_ga({"type": "transcription"})
    td = {"type": "server_vad", "silence_duration_ms": 300}
    ga = {"type": "realtime", "output_modalities": ["audio"], "max_output_tokens": 9, "instructions": "Be brief."}
    ga["audio"] = {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": td}}
    assert session_patch(ga) == {
        "instructions": "Be brief.",
        "modalities": ["text", "audio"],
        "max_response_output_tokens": 9,
        "turn_detection": td,
        "input_audio_format": "pcm16",
    }
    phone = {"input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcma", "rate": 8000}}}
    assert session_patch({"type": "realtime", "audio": phone}) == {
        "input_audio_format": "g711_ulaw",
        "output_audio_format": "g711_alaw",
    }
    lax = ({}, {"rate": 24000}, {"type": "audio/pcmu", "rate": None})  # a type or rate left out
    lax_patch = {"audio": {"input": {"format": lax[0]}, "output": {"format": lax[1]}}}
    assert session_patch({"type": "realtime", **lax_patch}) == {
        "input_audio_format": "pcm16",
        "output_audio_format": "pcm16",
    }
    assert session_patch({"type": "realtime", "audio": {"input": {"format": lax[2]}}}) == {
        "input_audio_format": "g711_ulaw"
    }
    bad_formats = ({"rate": 16000}, {"type": "audio/pcmu", "rate": 24000}, {"type": "audio/pcm", "bits": 8})
    for bad in ({"output_modalities": ["text", "audio"]}, *({"audio": {"input": {"format": f}}} for f in bad_formats)):
        with pytest.raises(EventError):
            session_patch({"type": "realtime", **bad})
    # A field audio.input or audio.output does not have (include is the session's) is refused.
    for side, field in (("input", "include"), ("output", "sped"), ("input", "voice")):
        with pytest.raises(EventError) as misplaced:
            session_patch({"type": "realtime", "audio": {side: {field: 1}}})
        assert misplaced.value.param == f"session.audio.{side}.{field}"
        assert str(ga_error(misplaced.value)) == f"Unknown parameter: 'session.audio.{side}.{field}'."
        assert misplaced.value.code == "unknown_parameter"
    with pytest.raises(EventError) as misplaced:
        session_patch({"type": "realtime", "audio": {"voice": "alloy"}})
    assert misplaced.value.param == "session.audio.voice"
    # The GA session object a client got back is a valid update.
    echoed = session_object(SessionConfig("smollm2").to_dict("sess_1"))
    assert session_patch(echoed)["input_audio_format"] == "pcm16"
    item = {"id": "i1", "role": "assistant", "status": "completed", "content": [{"type": "audio", "transcript": "Hi"}]}
    added, done = translate({"type": "conversation.item.created", "item": item})
    assert added["type"] == "conversation.item.added" and done["type"] == "conversation.item.done"
    assert done["item"]["content"] == [{"type": "output_audio", "transcript": "Hi"}]
    assert translate({"type": "response.audio.delta", "delta": "AA"}) == [
        {"type": "response.output_audio.delta", "delta": "AA"}
    ]
    assert ga_param("session.turn_detection.threshold") == "session.audio.input.turn_detection.threshold"
    assert ga_param("session.output_modalities") == "session.output_modalities"
    # an error's message names the fields as the GA client sent them, not inside other names
    beta = EventError("turn_detection.threshold must be in [0, 1]; modalities", param="session.turn_detection")
    err = ga_error(beta)
    assert str(err) == "audio.input.turn_detection.threshold must be in [0, 1]; output_modalities"
    assert err.param == "session.audio.input.turn_detection" and err.code == beta.code
    assert (
        str(ga_error(EventError("output_modalities and audio.output.voice")))
        == "output_modalities and audio.output.voice"
    )


def test_tts_stage_leaves_a_text_only_reply_unspoken() -> None:
    from pipelines.frames import LLMDone, LLMStarted, Sentence, TTSAudio, TTSDone
    from pipelines.services import Services
    from pipelines.speech import TTS

    spoken: list[str] = []

    class Voice(Services):
        async def speak(self, text: str, *_: object, **__: object) -> AsyncIterator[np.ndarray]:
            spoken.append(text)
            yield np.ones(240, np.float32)

    def reply(rid: str, audio: bool | None) -> list[Frame]:
        return [LLMStarted(rid, audio=audio), Sentence(rid, f"{rid} said.", 0), LLMDone(rid, f"{rid} said.")]

    out = asyncio.run(Pipeline([TTS(Voice(tts=object()))]).run_all([*reply("a", False), *reply("b", None)]))
    assert spoken == ["b said."]
    assert [f.response_id for f in out if isinstance(f, TTSAudio)] == ["b"]
    assert [f.response_id for f in out if isinstance(f, TTSDone)] == ["a", "b"]


def test_a_replys_speech_keeps_the_rate_it_started_with() -> None:
    """A reply is spoken at its own rate (its ``LLMStarted``'s) or at the session's as it
    starts: a session change mid-reply does not relabel the rest of its audio."""
    from pipelines.frames import LLMDone, LLMStarted, Sentence, TTSAudio
    from pipelines.services import Services
    from pipelines.speech import TTS, TTSOptions

    asked: list[int] = []

    class Voice(Services):
        async def speak(self, text: str, voice: object, rate: int, *_: object) -> AsyncIterator[np.ndarray]:
            asked.append(rate)
            yield np.ones(rate // 100, np.float32)

    options = TTSOptions(sample_rate=24_000)
    stage = TTS(Voice(tts=object()), options)

    async def go() -> list[Frame]:
        out: list[Frame] = []
        for frame in (LLMStarted("a"), Sentence("a", "One.", 0)):
            out += [f async for f in stage.process(frame)]
        options.sample_rate = 8000  # a session.update mid-reply
        for frame in (Sentence("a", "Two.", 1), LLMDone("a", "One. Two.")):
            out += [f async for f in stage.process(frame)]
        for frame in (LLMStarted("b", sample_rate=16_000), Sentence("b", "Three.", 0), LLMStarted("c")):
            out += [f async for f in stage.process(frame)]
        out += [f async for f in stage.process(Sentence("c", "Four.", 0))]
        return out

    out = asyncio.run(go())
    assert asked == [24_000, 24_000, 16_000, 8000]
    assert [(f.response_id, f.sample_rate, f.samples.size) for f in out if isinstance(f, TTSAudio)] == [
        ("a", 24_000, 240),
        ("a", 24_000, 240),
        ("b", 16_000, 160),
        ("c", 8000, 80),
    ]


def test_a_conversations_recent_items() -> None:
    from pipelines.conversation import Conversation

    conv = Conversation("sys")
    for k in range(5):
        conv.add("user", f"u{k}")
    assert conv.recent(3) is conv
    recent = conv.recent(2)
    assert [i.text for i in recent.items] == ["u2", "u3", "u4"] and recent.instructions == "sys"
    conv.add("user", "u5")
    assert [i.text for i in conv.recent(2).items] == ["u4", "u5"]
    conv.add("user", "u6")  # (the same first item: the renders share their prefix)
    assert [i.text for i in conv.recent(2).items] == ["u4", "u5", "u6"] and len(conv.items) == 7
    conv._first = 5  # (the replies' prompts leave items out: nothing more to cut)
    assert conv.recent(2) is conv


def test_conversation_remove_keeps_the_items_left_out() -> None:
    from pipelines.conversation import Conversation

    conv = Conversation("sys")
    ids = [conv.add("user" if k % 2 == 0 else "assistant", f"m{k}").id for k in range(4)]
    conv._first = 2  # m0 and m1 no longer fit
    assert conv.remove(ids[0]) and not conv.remove(ids[0])
    assert [m["content"] for m in conv.messages(conv._first)] == ["sys", "m2", "m3"]
    assert conv.remove(ids[3])
    assert [m["content"] for m in conv.messages(conv._first)] == ["sys", "m2"]


@pytest.mark.parametrize("tools", [False, True])
def test_a_rendered_chat_text_tokenizes_to_the_rendered_ids(smollm2_tokenizer: Any, tools: bool) -> None:
    """A long chat's prompt is rendered once as text (for its length check) and that text is
    tokenized, not rendered again: the same ids, special tokens in the content included."""
    from modalities.llm.chat import render_chat, render_chat_text, tokenize_chat_text
    from modalities.llm.tools import CHATML_TOOLS

    tok = smollm2_tokenizer
    kwargs: dict[str, Any] = {}
    if tools:
        tok = type(tok).from_pretrained(tok.name_or_path)
        tok.chat_template = CHATML_TOOLS.read_text()
        kwargs["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Say <|im_start|> and \u00e9t\u00e9 " * 50},
        {"role": "assistant", "content": "Ok."},
    ]
    text = render_chat_text(tok, messages, **kwargs)
    assert tokenize_chat_text(tok, text) == render_chat(tok, messages, **kwargs)
