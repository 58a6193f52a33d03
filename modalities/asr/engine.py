"""``AsrEngine``: Whisper on the shared engine.

Audio → (VAD + windows for long files) → log-mel features → encoder, batched across the windows
waiting at that moment (``modalities.asr.encoder``, on a worker thread) → one decoder request per window
on the shared engine (``LLMEngine`` with ``WhisperDecoderAdapter``: paged self-attention KV,
continuous batching of all clips' decodes) → texts stitched into one transcript.

Each window is checked as ``whisper.transcribe`` does (``modalities.asr.quality``): a repetitive
or unlikely decode is retried at higher temperatures (seeded from the request's ``seed``, so a
request is reproducible), and a window the model hears as silence yields no text. Word timestamps,
when asked for, come from one extra decoder pass per window over its kept tokens
(``modalities.asr.alignment``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import openmp
from engine.admission import Admission
from engine.foreground import default_wait_s
from modalities.asr.alignment import WordAligner, word_token_spans
from modalities.asr.assemble import Decoded, TranscriptSoFar
from modalities.asr.encoder import RATE, EncoderBatcher
from modalities.asr.longform import Window, plan_windows
from modalities.asr.model import WhisperModel, load_whisper, no_speech_token
from modalities.asr.quality import (
    WindowResult,
    avg_logprob,
    check_fallback_keep,
    compression_ratio,
    fallback_temperatures,
    kept,
    passes_so_far,
    words_heard,
)
from modalities.asr.types import Transcript, TranscriptDelta, TranscriptionRequest, Word
from modalities.audio import MAX_AUDIO_S

logger = logging.getLogger("mmserve.asr")

WINDOW_S = 30.0
# A window's decode with fewer words than this a second may have stopped early: its words are
# aligned, and if more than UNHEARD_S of the window follows its last one, the rest is decoded too.
MIN_WORDS_PER_S = 2.0
UNHEARD_S = 1.5
MIN_REST_WINDOW_S = 5.0  # (shorter windows are not checked unless their words are aligned anyway)
MIN_SPEECH_S = 0.3
DEFAULT_MAX_FILE_MB = 25.0  # OpenAI's upload limit
# Transcriptions held past which the routes' get 429 (``engine.admission``): a few minutes of work here.
DEFAULT_MAX_REQUESTS = min(32 * (os.cpu_count() or 1), 256)  # (a speech worker runs a thread per request)


@dataclass
class Heard:
    """A request's language, detected once for all its windows (``AsrEngine._with_language``)."""

    detection: asyncio.Future[int] | None = None


@dataclass
class AsrConfig:
    model: str | None = None  # see modalities.asr.model.resolve_asr_path
    max_num_seqs: int = 64
    max_encoder_batch: int = 8
    kv_cache_mb: int = 256
    max_new_tokens: int = 224  # Whisper's sample_len (half its 448-token context)
    vad_backend: str = "webrtc"
    num_threads: int | None = None
    attention_backend: str = "auto"
    max_file_mb: float = DEFAULT_MAX_FILE_MB  # the API's upload limit (413 above)
    # Decoded length limit (413 above): a small compressed file can hold hours of audio.
    max_audio_s: float = MAX_AUDIO_S
    # Encoder linears in oneDNN's prepacked layout (fp32 CPU): 1.5x faster encoder passes here,
    # same results up to fp32 summation order. The swap modifies the given model in place.
    prepack_encoder: bool = True
    # Bulk encoder passes (priority >= 0) wait up to this long while a foreground hold (a TTS
    # first piece) runs on the same CPU (engine.foreground); None: 0.25 s on a CPU, 0 on a GPU.
    # Decode steps do not wait: they hold voice turns' decodes too.
    foreground_wait_s: float | None = None
    # A window whose every fallback fails keeps its last (1.0) decode ("last", openai-whisper's and
    # transformers' rule) or its most likely one ("best", faster-whisper's): ``quality.kept``.
    fallback_keep: str = "last"
    # A multilingual model asked for no language detects it on a request's first window, for all
    # its windows (whisper.transcribe's rule), or on each window (code-switching audio).
    language_per_window: bool = False
    device: str = "cpu"  # where ``from_config`` loads Whisper ("cuda"); the engine runs where the model is
    max_requests: int | None = DEFAULT_MAX_REQUESTS


class AsrEngine:
    """Engine contract: ``start``/``shutdown``/``stats``/``model_name``; ``run(req) -> Transcript``
    and ``stream(req) -> AsyncIterator[TranscriptDelta]`` take picklable requests (remote
    dispatch); ``transcribe``/``transcribe_stream`` are the in-process conveniences."""

    _ids = itertools.count()
    modality = "asr"

    def __init__(self, whisper: WhisperModel, config: AsrConfig | None = None) -> None:
        from engine.async_engine import AsyncEngine
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        from engine.model_loader import LoadedModel
        from modalities.asr.decoder import WhisperDecoderAdapter

        self.config = config or AsrConfig()
        check_fallback_keep(self.config.fallback_keep)
        self.whisper = whisper
        self.model_name = whisper.name
        self.max_file_mb = self.config.max_file_mb
        self.max_audio_s = self.config.max_audio_s
        model = whisper.model
        if self.config.prepack_encoder:
            from engine.cpu_linear import use_prepacked_linears

            use_prepacked_linears(model.model.encoder)  # the fp32 CPU linears, where oneDNN is present
        self.adapter = WhisperDecoderAdapter(model)
        max_len = model.config.max_target_positions
        wait_s = self.config.foreground_wait_s
        if wait_s is None:
            wait_s = default_wait_s(str(model.device))
        ecfg = EngineConfig(
            model=str(whisper.path),
            max_model_len=max_len,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=max(2048, max_len),
            kv_cache_memory_bytes=self.config.kv_cache_mb << 20,
            # Decoder KV depends on the audio, not only on the tokens: never share it.
            enable_prefix_caching=False,
            attention_backend=self.config.attention_backend,
            num_threads=self.config.num_threads,
            device=str(model.device),
            # Live voice turns' decodes (priority < 0) are admitted before queued uploads' ones
            # and preempted last; equal priorities go by arrival, as under fcfs.
            scheduling_policy="priority",
            # Every window of an admitted request waits here at once (an hour is ~120): requests
            # are bounded above (``max_requests``), so a full decoder queue must not refuse a
            # window halfway through a request, a job's or a live turn's.
            max_waiting=sys.maxsize,
        )
        loaded = LoadedModel(model, whisper.tokenizer, whisper.path, whisper.name, max_len)
        self.engine = AsyncEngine(LLMEngine(ecfg, loaded, adapter=self.adapter))
        gen = model.generation_config
        self._tok = {
            t: whisper.tokenizer.convert_tokens_to_ids(t) for t in ("<|startoftranscript|>", "<|startofprev|>")
        }
        self._no_ts = gen.no_timestamps_token_id
        langs = (getattr(gen, "lang_to_id", None) or {}) if whisper.multilingual else {}
        self._lang_ids = sorted(langs.values())  # detected from where a request names no language
        self._lang_set = set(self._lang_ids)
        self._lang_codes = {i: t.strip("<|>") for t, i in langs.items()}
        self._eos = gen.eos_token_id
        self._begin_suppress = list(getattr(gen, "begin_suppress_tokens", None) or [])
        no_speech = no_speech_token(whisper.tokenizer, self._no_ts)
        self.encoder = EncoderBatcher(whisper, self.adapter, no_speech, self.config.max_encoder_batch, wait_s)
        self._aligner: WordAligner | None = None  # built on the first request for word timestamps
        self.audio_seconds = 0.0
        self.num_windows = 0
        self.num_fallback_decodes = 0
        self.num_rest_decodes = 0  # windows whose text stopped early, decoded on (``_with_rest``)
        self._admission = Admission(self.config.max_requests)

    @property
    def multilingual(self) -> bool:
        """Whether the model knows other languages than English (and can translate)."""
        return self.whisper.multilingual

    @classmethod
    def from_config(cls, config: AsrConfig) -> AsrEngine:
        return cls(load_whisper(config.model, device=config.device), config)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.engine.start()
        self.encoder.ensure_loop()  # on the caller's event loop

    async def shutdown(self) -> None:
        self.encoder.close()
        await self.engine.shutdown()

    def stats(self) -> dict[str, float]:
        s = {f"decoder_{k}": v for k, v in self.engine.stats().items()}
        s.update(
            num_waiting=s.get("decoder_num_waiting", 0),  # (the gateway's queue_depth: windows to decode)
            num_running=s.get("decoder_num_running", 0),
            requests_active=self._admission.active,
            audio_seconds_total=self.audio_seconds,
            windows_total=self.num_windows,
            encoder_batches_total=self.encoder.num_batches,
            fallback_decodes_total=self.num_fallback_decodes,
            rest_decodes_total=self.num_rest_decodes,
            encoder_batches_abandoned_total=self.encoder.num_abandoned,
            cross_kv_cached=self.adapter.num_cached_cross,
        )
        return s

    async def _encode(self, audio: np.ndarray, prompt_ids: list[int], priority: int = 0) -> tuple[Any, float]:
        """(encoder output [frames, d_model], no-speech probability under ``prompt_ids``) of one
        ≤30 s window, batched with concurrent calls (``EncoderBatcher``)."""
        await self.start()
        return await self.encoder.encode(audio, prompt_ids, priority)

    # -- prompts -------------------------------------------------------------------------------
    def prompt_ids(self, language: str | None = None, prompt: str | None = None, task: str = "transcribe") -> list[int]:
        """Decoder prompt: [<|startofprev|> prompt...] <|startoftranscript|> [lang task]
        <|notimestamps|>. A multilingual model asked for no language gets none here: the language
        heard is put in once the audio is encoded (``_with_language``). ``ValueError`` for what the model can't do."""
        tok = self.whisper.tokenizer
        ids: list[int] = []
        if prompt:
            # Special-token text in a prompt is text: "<|ja|>" must not become a language token.
            text_ids = tok(" " + prompt.strip(), add_special_tokens=False, split_special_tokens=True).input_ids
            ids += [self._tok["<|startofprev|>"], *text_ids[-(self.config.max_new_tokens - 1) :]]
        ids.append(self._tok["<|startoftranscript|>"])
        if self.whisper.multilingual:
            gen = self.whisper.model.generation_config
            if language:
                lang = f"<|{language.lower()}|>"
                if lang not in gen.lang_to_id:
                    raise ValueError(f"unsupported language {language!r}")
                ids.append(gen.lang_to_id[lang])
            if task not in gen.task_to_id:
                raise ValueError(f"unsupported task {task!r}")
            ids.append(gen.task_to_id[task])
        elif task != "transcribe":
            raise ValueError(
                f"model {self.model_name} is English-only: it cannot {task}; serve a multilingual Whisper (--asr base)"
            )
        elif language and language.lower() not in ("en", "english"):
            raise ValueError(f"model {self.model_name} is English-only; language {language!r} is not supported")
        ids.append(self._no_ts)
        return ids

    async def _with_language(
        self, enc: Any, prompt_ids: list[int], heard: Heard | None = None
    ) -> tuple[list[int], str | None]:
        """``prompt_ids`` with the language heard in ``enc`` after <|startoftranscript|> where it
        names none (a multilingual model), and that language's code (None: the prompt's own).
        With ``heard``, the request's first window to get here detects it for all its windows,
        as ``whisper.transcribe`` detects once, on the first 30 s."""
        at = prompt_ids.index(self._tok["<|startoftranscript|>"]) + 1
        if not self._lang_ids or any(t in self._lang_set for t in prompt_ids[at:]):
            return prompt_ids, None
        if heard is None:
            lang = await self.encoder.detect_language(enc, self._lang_ids)
        else:
            if heard.detection is None:  # a task of its own: the window that started it may be dropped
                heard.detection = asyncio.ensure_future(self.encoder.detect_language(enc, self._lang_ids))
            lang = await asyncio.shield(heard.detection)
        return [*prompt_ids[:at], lang, *prompt_ids[at:]], self._lang_codes[lang]

    # -- decoding ------------------------------------------------------------------------------
    async def _generate(
        self, enc: Any, prompt_ids: list[int], temperature: float, seed: int | None = None, priority: int = 0
    ) -> AsyncIterator[tuple[str, list[int], bool, list[float]]]:
        """Stream (delta text, token ids so far, finished, chosen-token logprobs so far) of one
        decode of one encoded window."""
        from engine.sampling_params import SamplingParams
        from engine.sequence import PromptInputs

        params = SamplingParams(
            temperature=temperature,
            max_tokens=min(self.config.max_new_tokens, self.engine.max_model_len - len(prompt_ids)),
            begin_suppress_token_ids=self._begin_suppress,
            seed=seed,
            logprobs=0,
        )
        request_id = f"asr-{next(self._ids)}"
        prompt = PromptInputs(prompt_ids, encoder_output=enc)
        async for out in self.engine.generate(request_id, prompt, params, priority=priority):
            o = out.outputs[0]
            yield o.delta_text, o.token_ids, out.finished, [lp.logprob for lp in o.logprobs or []]

    async def decode_tokens(self, audio: np.ndarray, prompt_ids: list[int], temperature: float = 0.0) -> list[int]:
        """Generated token ids (eos excluded) of one ≤30 s clip, one decode at ``temperature``
        (no fallback): the unit the correctness test compares with ``generate()``."""
        enc, _ = await self._encode(audio, prompt_ids)
        prompt_ids, _ = await self._with_language(enc, prompt_ids)
        tokens: list[int] = []
        async for _, ids, _, _ in self._generate(enc, prompt_ids, temperature):
            tokens = ids
        return [t for t in tokens if t != self._eos]

    async def decode_window(
        self,
        audio: np.ndarray,
        prompt_ids: list[int],
        temperature: float = 0.0,
        seed: int = 0,
        words: bool = False,
        priority: int = 0,
        heard: Heard | None = None,
    ) -> AsyncIterator[tuple[str, WindowResult | None, Decoded]]:
        """Decode one ≤30 s window with Whisper's temperature fallback: yields ``(live text,
        None, its tokens and their logprobs)`` while a decode's running figures pass the checks,
        then ``(text, result, ...)`` with the kept decode (text "" for a silent window). Sampled
        decodes use ``seed + attempt``.
        ``words``: the result also carries the kept decode's words, aligned (on a worker thread).
        ``priority``: of the window's encoder pass and decodes (``TranscriptionRequest.priority``).
        ``heard``: the request's language, shared by its windows (``_with_language``)."""
        enc, no_speech = await self._encode(audio, prompt_ids, priority)
        prompt_ids, language = await self._with_language(enc, prompt_ids, heard)
        temps, attempts = fallback_temperatures(temperature), []
        for attempt, t in enumerate(temps):
            text, ids, lps = "", [], []
            async for delta, ids_so_far, finished, lps in self._generate(
                enc, prompt_ids, t, seed + attempt if t > 0 else None, priority
            ):
                text += delta
                ids = ids_so_far
                if delta and not finished and passes_so_far(text, lps, no_speech):
                    yield text, None, (ids, lps)  # (each output's token_ids is a list of its own)
            tokens = [x for x in ids if x != self._eos]
            text = text.strip()
            res = WindowResult(text, tokens, t, avg_logprob(lps, len(tokens)), compression_ratio(text), no_speech)
            res.language = language
            res.token_logprobs = [lp for x, lp in zip(ids, lps, strict=True) if x != self._eos]
            attempts.append(res)
            if not res.needs_fallback or attempt == len(temps) - 1:
                break
            self.num_fallback_decodes += 1
        res = kept(attempts, self.config.fallback_keep)
        duration = len(audio) / RATE
        # (a cheap check first; a short clip, e.g. a voice turn, loses little and pays the most)
        may_stop_short = duration >= MIN_REST_WINDOW_S and words_heard(res.text) < MIN_WORDS_PER_S * duration
        if not res.silent and (words or may_stop_short):
            res.words = await openmp.to_thread(self._align, enc, prompt_ids, res.tokens, len(audio))
            last = res.words[-1] if res.words else None
            # Words were heard before the last one (so the rest is a shorter window), and after it
            # more than UNHEARD_S of the window, with speech in it (Whisper makes words of silence).
            if last is not None and last.start >= UNHEARD_S and duration - last.end > UNHEARD_S:
                if await asyncio.to_thread(self._speech_in, audio[int(last.end * RATE) :]):
                    rest = audio[int(last.start * RATE) :]
                    res = await self._with_rest(
                        res, rest, last.start, prompt_ids, temperature, seed + 100, priority, heard
                    )
        yield ("" if res.silent else res.text), res, (res.tokens, res.token_logprobs)

    def _speech_in(self, audio: np.ndarray) -> bool:
        """Whether the VAD hears at least ``MIN_SPEECH_S`` of speech in ``audio``."""
        from modalities.vad import speech_segments

        return sum(b - a for a, b in speech_segments(audio, self.config.vad_backend)) >= MIN_SPEECH_S

    async def _with_rest(
        self,
        res: WindowResult,
        rest: np.ndarray,
        offset: float,
        prompt_ids: list[int],
        temperature: float,
        seed: int,
        priority: int,
        heard: Heard | None,
    ) -> WindowResult:
        """``res`` (aligned), whose text ended long before its window did (Whisper may end a
        window's text early, e.g. at audio cut mid-sentence, and so lose its last words), joined
        with the decode of ``rest``, the window's audio from ``offset`` s (its last word, which
        may be cut: heard again) on. Its figures stay ``res``'s."""
        decodes = self.decode_window(rest, prompt_ids, temperature, seed, True, priority, heard)
        tail = [r async for _, r, _ in decodes if r is not None][-1]
        if tail.silent or not tail.text or tail.words is None or res.words is None:
            return res
        assert self._aligner is not None  # (``res`` was aligned)
        spans = word_token_spans(self.whisper.tokenizer, res.tokens, self._aligner.first_special)
        self.num_rest_decodes += 1
        moved = [Word(w.word, w.start + offset, w.end + offset) for w in tail.words]
        return dataclasses.replace(
            res,
            text=" ".join([*res.text.split()[:-1], tail.text]),
            tokens=[*res.tokens[: spans[-1][1]], *tail.tokens],
            token_logprobs=[*res.token_logprobs[: spans[-1][1]], *tail.token_logprobs],
            words=[*res.words[:-1], *moved],
        )

    def _align(self, enc: Any, prompt_ids: list[int], tokens: list[int], num_samples: int) -> list[Word]:
        if self._aligner is None:
            self._aligner = WordAligner(self.whisper.model, self.whisper.tokenizer)
        return self._aligner.words(enc, prompt_ids, tokens, num_samples)

    def _windows(self, audio: np.ndarray, vad: bool | None) -> list[Window]:
        """The windows to decode. ``vad`` None: a clip of one window is decoded whole (as
        ``generate()`` would) unless the VAD hears no speech in it at all: then nothing is, for
        Whisper makes words of silence ("you"); a longer one is cut into windows of speech."""
        duration = len(audio) / RATE
        if vad is False:
            return [Window(0.0, duration)] if duration <= WINDOW_S else plan_windows(audio, [(0.0, duration)])
        from modalities.vad import speech_segments

        speech = speech_segments(audio, self.config.vad_backend)
        if vad is None and duration <= WINDOW_S:
            return [Window(0.0, duration)] if speech else []
        return plan_windows(audio, speech)

    def reserve(self) -> AbstractContextManager[None]:
        """A place for a route's request while it decodes the upload (0.1-0.2 s of a core):
        ``HeldBoundError`` now when ``stream`` would refuse it (``Admission.reserve``)."""
        return self._admission.reserve(True)

    def stream(self, req: TranscriptionRequest) -> AsyncIterator[TranscriptDelta]:
        """Text as it decodes, in order; the last item carries the full ``Transcript``.

        Every window decodes at once (they batch on the engine); a window's live text is passed
        on when all earlier windows are done and it overlaps no neighbour (overlapping windows
        are released once stitched). ``HeldBoundError`` first for a ``refusable`` request while
        ``max_requests`` are held."""
        return self._admission.held(req.refusable, self._stream(req))

    async def _stream(self, req: TranscriptionRequest) -> AsyncIterator[TranscriptDelta]:
        audio = np.asarray(req.audio, dtype=np.float32)
        prompt_ids = self.prompt_ids(req.language, req.prompt, req.task)
        windows = await asyncio.to_thread(self._windows, audio, req.vad)  # the VAD: ~0.4 ms per second of audio
        self.audio_seconds += len(audio) / RATE
        self.num_windows += len(windows)
        queue: asyncio.Queue[tuple[int, str, WindowResult | None, Decoded] | BaseException] = asyncio.Queue()
        seed = req.seed or 0

        shared = None if self.config.language_per_window else Heard()  # the request's language
        aligned = req.word_timestamps or req.sentence_segments

        async def run(i: int, w: Window) -> None:
            try:
                clip = audio[int(w.start * RATE) : int(w.end * RATE)]
                # Each window its own seeds, reproducible whatever else is decoding.
                async for text, res, decoded in self.decode_window(
                    clip, prompt_ids, req.temperature, seed + 1000 * i, aligned, req.priority, shared
                ):
                    await queue.put((i, text, res, decoded))
            except BaseException as exc:  # noqa: BLE001 - surface in the consumer
                await queue.put(exc)
                raise

        tasks = [asyncio.create_task(run(i, w)) for i, w in enumerate(windows)]
        so_far = TranscriptSoFar(req, windows, self.whisper.tokenizer, self._eos)
        try:
            while not so_far.complete:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if (delta := so_far.update(*item)) is not None:
                    yield delta
        finally:
            for t in tasks:
                t.cancel()
        for delta in so_far.finish():
            yield delta

    async def run(self, req: TranscriptionRequest) -> Transcript:
        final: Transcript | None = None
        async for delta in self.stream(req):
            final = delta.transcript or final
        assert final is not None
        return final

    async def transcribe(
        self, audio: np.ndarray, language: str | None = None, prompt: str | None = None, temperature: float = 0.0
    ) -> Transcript:
        """Transcribe 16 kHz mono float32 audio of any length."""
        return await self.run(TranscriptionRequest(audio, language, prompt, temperature))

    async def transcribe_stream(
        self, audio: np.ndarray, language: str | None = None, prompt: str | None = None, temperature: float = 0.0
    ) -> AsyncIterator[TranscriptDelta]:
        async for delta in self.stream(TranscriptionRequest(audio, language, prompt, temperature)):
            yield delta
