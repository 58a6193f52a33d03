"""Autoregressive TTS on the shared engine, with the tiny random ``tts-ar`` model: exact greedy
codec tokens against transformers ``generate()``, continuous batches shared with text requests
under a KV budget that forces preemption, frame-by-frame streaming equal to one full codec
decode, cancellation, and ``/v1/audio/speech`` routing by voice to this backend."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from modalities.audio import decode_audio
from modalities.tts.ar_engine import ARTTSEngine
from modalities.tts.codec_stream import CodecBatcher, CodecWindow, StreamingCodecDecoder, decode_windows
from modalities.tts.protocol import TTSRequest, TTSUsage
from modalities.tts.tiny import tiny_tts_ar_dir
from tests.helpers import serve_app

FRAMES = 24
TEXTS = [("Hello there.", "tiny-a"), ("The quick brown fox.", "tiny-b"), ("Speech, please!", "tiny-a")]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_tts_ar_dir(seed=0)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, list[list[int]]]:
    return reference_tokens(model_dir)


def reference_tokens(model_dir: Path, device: str = "cpu") -> dict[str, list[list[int]]]:
    """transformers ``generate()`` (greedy, same codec-only constraint) on the same directory."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    ar = ARTTSEngine.from_dir(model_dir, num_kv_blocks=64)
    allowed = torch.tensor(ar.sampling_params().allowed_token_ids, device=device)

    class OnlyAllowed(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            out = torch.full_like(scores, float("-inf"))
            out[:, allowed] = scores[:, allowed]
            return out

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    tts = []
    for text, voice in TEXTS:
        ids = torch.tensor([ar.prompt_ids(text, voice)], device=device)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=FRAMES * ar.layout.num_codebooks,
            do_sample=False,
            eos_token_id=ar.layout.audio_end_id,
            logits_processor=LogitsProcessorList([OnlyAllowed()]),
        )
        tts.append(gen[0, ids.shape[1] :].tolist())
    text_ids = ar.tokenizer("Once upon a time", add_special_tokens=False).input_ids
    ids = torch.tensor([text_ids], device=device)
    llm = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    return {"tts": tts, "llm": [llm[0, ids.shape[1] :].tolist()], "llm_prompt": [text_ids]}


def test_greedy_codec_tokens_equal_transformers_generate(model_dir: Path, reference: dict) -> None:
    ar = ARTTSEngine.from_dir(model_dir, num_kv_blocks=256)
    prompts = [ar.prompt_ids(t, v) for t, v in TEXTS]
    outs = ar.engine.engine.generate(prompts, ar.sampling_params(FRAMES))  # the sync engine, one batch
    got = [o.outputs[0].token_ids for o in outs]
    assert got == reference["tts"]
    codec_ids = set(ar.layout.codec_token_ids) | {ar.layout.audio_end_id}
    assert all(set(t) <= codec_ids for t in got)


def test_continuous_batch_with_text_requests_survives_preemption(model_dir: Path, reference: dict) -> None:
    # 12 blocks of 16 tokens cannot hold 4 TTS pieces (~60 tokens each) and a text request at once.
    ar = ARTTSEngine.from_dir(model_dir, num_kv_blocks=12, max_num_seqs=8)
    from engine.sampling_params import SamplingParams

    async def collect(prompt: list[int], params: SamplingParams) -> list[int]:
        tokens: list[int] = []
        async for out in ar.engine.generate(None, prompt, params):
            tokens = out.outputs[0].token_ids
        return tokens

    async def go() -> tuple[list[list[int]], list[int], int]:
        await ar.start()
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, int(ar.stats()["num_running"]))
                await asyncio.sleep(0.001)

        watcher = asyncio.ensure_future(watch())
        jobs = [collect(ar.prompt_ids(t, v), ar.sampling_params(FRAMES)) for t, v in TEXTS * 2]
        text = collect(reference["llm_prompt"][0], SamplingParams(temperature=0, max_tokens=40))
        *tts, llm = await asyncio.gather(*jobs, text)
        watcher.cancel()
        stats = ar.stats()
        await ar.shutdown()
        assert stats["num_preemptions"] > 0
        return tts, llm, peak

    tts, llm, peak = asyncio.run(go())
    assert tts == reference["tts"] * 2
    assert llm == reference["llm"][0]
    assert peak >= 2  # requests shared engine steps


@pytest.mark.parametrize("first_every", [None, 2])
def test_streaming_decoder_equals_one_full_decode(model_dir: Path, first_every: int | None) -> None:
    ar = ARTTSEngine.from_dir(model_dir, num_kv_blocks=16)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, ar.layout.codebook_size, size=(ar.layout.num_codebooks, 50))
    with torch.no_grad():
        full = ar.codec.decode(audio_codes=torch.from_numpy(codes[None])).audio_values[0].numpy()
    dec = StreamingCodecDecoder(ar.codec, ar.layout.context_frames, decode_every=4, first_every=first_every)
    parts: list[tuple[int, np.ndarray]] = []
    for f in range(codes.shape[1]):
        out = dec.push(codes[:, f : f + 1])
        if out is not None:
            parts.append((f, out))
    parts.append((codes.shape[1], dec.finish()))
    # audio after first_every + context frames, not at the end
    assert parts[0][0] == (first_every or 4) + ar.layout.context_frames - 1
    assert len(parts) > 5
    np.testing.assert_allclose(np.concatenate([p for _, p in parts]), full, atol=1e-5)


def test_windows_of_many_streams_decode_as_one_padded_batch(model_dir: Path) -> None:
    """Windows of different lengths (first, middle, last) decoded in one call give each stream the
    samples it gets decoding alone: batch padding only reaches samples a window drops."""
    ar = ARTTSEngine.from_dir(model_dir, num_kv_blocks=16)
    rng = np.random.default_rng(1)
    ctx = ar.layout.context_frames
    windows: list[CodecWindow] = []
    for length, every in [(40, 3), (33, 5), (21, 8)]:
        codes = rng.integers(0, ar.layout.codebook_size, size=(ar.layout.num_codebooks, length))
        dec = StreamingCodecDecoder(ar.codec, ctx, decode_every=every, first_every=2)
        for f in range(length):
            w = dec.take(codes[:, f : f + 1])
            if w is not None:
                windows.append(w)
        windows.append(dec.take_last())
    assert len({w.codes.shape[1] for w in windows}) > 3 and any(w.hi is None for w in windows)
    batched = decode_windows(ar.codec, windows)
    for w, got in zip(windows, batched, strict=True):
        np.testing.assert_allclose(got, decode_windows(ar.codec, [w])[0], atol=1e-5)


def test_codec_batcher_takes_every_window_waiting_when_its_decode_starts(model_dir: Path) -> None:
    ar = ARTTSEngine.from_dir(model_dir, num_kv_blocks=16)
    rng = np.random.default_rng(2)
    windows = [
        CodecWindow(rng.integers(0, ar.layout.codebook_size, size=(ar.layout.num_codebooks, n)), 0, 4 * 320)
        for n in (14, 15, 18)
    ]
    runs: list[int] = []

    async def go() -> list[np.ndarray]:
        step_done = asyncio.Event()

        async def run(fn):  # stands in for AsyncEngine.call_between_steps: runs after the step
            runs.append(1)
            await step_done.wait()
            return fn()

        batcher.__init__(ar.codec, run)
        first = asyncio.ensure_future(batcher.decode(windows[0]))
        await asyncio.sleep(0.01)  # the other streams wake in later loop iterations
        rest = [asyncio.ensure_future(batcher.decode(w)) for w in windows[1:]]
        await asyncio.sleep(0.01)
        step_done.set()
        return list(await asyncio.gather(first, *rest))

    batcher = CodecBatcher.__new__(CodecBatcher)
    got = asyncio.run(go())
    assert runs == [1] and (batcher.batches, batcher.windows) == (1, 3)
    for w, audio in zip(windows, got, strict=True):
        np.testing.assert_allclose(audio, decode_windows(ar.codec, [w])[0], atol=1e-5)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[tuple[str, ARTTSEngine]]:
    from gateway.app import create_app
    from modalities.tts.api import router
    from modalities.tts.piper_engine import PiperEngine

    piper = PiperEngine(workers=1, threads=1)
    ar = ARTTSEngine.from_dir(model_dir, num_kv_blocks=64, max_frames=FRAMES, decode_every=4)
    app = create_app({piper.model_name: piper, ar.model_name: ar}, routers=[router])
    with serve_app(app) as url:
        yield url, ar


def test_engine_stream_yields_frames_as_they_decode_and_cancels(server: tuple[str, ARTTSEngine]) -> None:
    _, ar = server

    req = TTSRequest("Hello there.", voice="tiny-a")

    async def chunks() -> list[np.ndarray]:
        return [c async for c in ar.stream(req)]

    hop = int(ar.codec.config.hop_length)
    parts = asyncio.run(chunks())
    assert len(parts) >= 3
    assert sum(p.size for p in parts) == FRAMES * hop - 8  # DAC trims 8 samples at the end
    # What it used: its prompt's tokens, and the codec tokens of its frames (the random model
    # never says <|audio_end|>: it runs to the frame cap).
    prompt = len(ar.prompt_ids("Hello there.", "tiny-a"))
    assert req.usage == TTSUsage(prompt, FRAMES * ar.layout.num_codebooks)

    async def cancel() -> tuple[float, float]:
        ar.max_frames = 1000
        try:
            gen = ar.stream(TTSRequest("A long one.", voice="tiny-b"))
            await gen.__anext__()
            await gen.aclose()
            for _ in range(200):
                if ar.stats()["num_running"] == 0:
                    break
                await asyncio.sleep(0.01)
            before = ar.stats()["generation_tokens_total"]
            await asyncio.sleep(0.2)
            return before, ar.stats()["generation_tokens_total"]
        finally:
            ar.max_frames = FRAMES

    before, after = asyncio.run(cancel())
    assert before == after and ar.stats()["num_running"] == 0


@pytest.mark.parametrize(("speed", "rate"), [(2.0, None), (0.5, 16_000)])
def test_engine_speed_stretches_the_same_tokens_in_time(
    server: tuple[str, ARTTSEngine], speed: float, rate: int | None
) -> None:
    """Greedy: both requests decode the same frames; ``speed`` scales the audio by 1 / speed."""
    _, ar = server

    async def chunks(speed: float, rate: int | None) -> list[np.ndarray]:
        return [c async for c in ar.stream(TTSRequest("Hello there.", voice="tiny-a", speed=speed, sample_rate=rate))]

    normal = np.concatenate(asyncio.run(chunks(1.0, rate)))
    parts = asyncio.run(chunks(speed, rate))
    assert len(parts) >= 3  # still streamed as frames decode, not held to the end
    got = sum(p.size for p in parts)
    assert got == pytest.approx(normal.size / speed, abs=2)  # resampler rounding at 16 kHz


def test_concurrent_streams_share_codec_batches_and_equal_their_audio_alone(
    server: tuple[str, ARTTSEngine],
) -> None:
    _, ar = server
    reqs = [TTSRequest(t, voice=v) for t, v in TEXTS]

    async def one(req: TTSRequest) -> np.ndarray:
        return np.concatenate([c async for c in ar.stream(req)])

    async def alone() -> list[np.ndarray]:
        return [await one(r) for r in reqs]

    async def together() -> list[np.ndarray]:
        # Hold the engine thread until every request is queued, so they start in the same step.
        gate = threading.Event()
        hold = asyncio.ensure_future(ar.engine.call_between_steps(gate.wait))
        tasks = [asyncio.ensure_future(one(r)) for r in reqs]
        while ar.engine._commands.qsize() < len(reqs):
            await asyncio.sleep(0.001)
        gate.set()
        await hold
        return list(await asyncio.gather(*tasks))

    expected = asyncio.run(alone())
    before = (ar.codec_batcher.batches, ar.codec_batcher.windows)
    shapes: set[tuple[int, ...]] = set()
    decode = ar.codec.decode

    def recording(audio_codes: torch.Tensor):  # noqa: ANN202 - the codec's own output type
        shapes.add(tuple(audio_codes.shape))
        return decode(audio_codes=audio_codes)

    ar.codec.decode = recording
    try:
        got = asyncio.run(together())
    finally:
        del ar.codec.decode
    batches, windows = ar.codec_batcher.batches - before[0], ar.codec_batcher.windows - before[1]
    # Requests that start in one step come due in one step: their windows share every decode.
    assert windows == len(reqs) * batches and max(s[0] for s in shapes) == len(reqs)
    assert shapes <= set(ar.codec_shapes(len(reqs)))  # the shapes the engine sets up at start
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_speech_route_picks_the_ar_backend_by_voice(server: tuple[str, ARTTSEngine]) -> None:
    url, ar = server
    resp = httpx.post(
        f"{url}/v1/audio/speech", json={"input": "Hi. Bye.", "voice": "tiny-b", "response_format": "wav"}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-model"] == ar.model_name
    audio = decode_audio(resp.content, rate=None)
    assert audio.rate == 24000
    assert audio.duration == pytest.approx(2 * (FRAMES * 320 - 8) / 24000, abs=1e-3)
    default = httpx.post(f"{url}/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm"}, timeout=60)
    assert default.headers["x-model"].startswith("piper-")
    bad = httpx.post(f"{url}/v1/audio/speech", json={"input": "Hi.", "voice": "tiny-a", "speed": 4.5}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speed"
    wrong = httpx.post(
        f"{url}/v1/audio/speech", json={"input": "Hi.", "model": ar.model_name, "voice": "joe"}, timeout=60
    )
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "voice"


def test_past_its_bound_the_ar_voice_refuses_the_route_and_serves_a_job(server: tuple[str, ARTTSEngine]) -> None:
    """At ``max_requests`` held (here 0) the speech route gets a 429 with ``Retry-After`` before
    any work; a request that is not ``refusable`` (a job's, a live turn's) is served, and the
    engine's own queue, under that bound, refuses none of a job's pieces."""
    url, ar = server
    tokens = ar.stats()["generation_tokens_total"]
    ar._admission.limit = 0
    try:
        refused = httpx.post(f"{url}/v1/audio/speech", json={"input": "Hi.", "voice": "tiny-a"}, timeout=60)
        assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert ar.stats()["generation_tokens_total"] == tokens and ar.stats()["requests_active"] == 0

        async def job() -> int:
            return sum([c.size async for c in ar.stream(TTSRequest("Hi.", voice="tiny-a"))])

        assert asyncio.run(job()) == FRAMES * 320 - 8
    finally:
        ar._admission.limit = None
    assert ar.engine.engine.config.max_waiting > 1 << 30


def test_the_ar_voice_holds_at_least_its_batch(model_dir: Path) -> None:
    """``--tts-max-requests`` bounds both voices, the AR one at no fewer than its batch
    (``--tts-ar-max-num-seqs``: a lower bound would keep the batch from filling); 0: no bound."""
    from gateway.cli import build_parser
    from modalities.tts.plugin import ar_max_requests, build

    flags = ["--tts-ar", str(model_dir), "--tts-max-requests", "4", "--tts-ar-max-num-seqs", "8"]
    args = build_parser().parse_args(["serve", "--only", "tts", *flags])
    assert [e._admission.limit for e in build(args).engines.values()] == [4, 8]
    assert ar_max_requests(12, 8) == 12
    assert ar_max_requests(None, 8) is None  # (``--tts-max-requests 0``)
