"""``AsrEngine``: Whisper on the shared engine.

Audio → (VAD + windows for long files) → log-mel features → encoder, batched across every window
waiting at that moment (one forward per batch, on a worker thread) → one decoder request per window
on the shared engine (``LLMEngine`` with ``WhisperDecoderAdapter``: paged self-attention KV,
continuous batching of all clips' decodes) → texts stitched into one transcript.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from modalities.asr.longform import Window, plan_windows, stitch
from modalities.asr.model import WhisperModel, load_whisper

logger = logging.getLogger("mmserve.asr")

RATE = 16_000
WINDOW_S = 30.0
DEFAULT_MAX_FILE_MB = 25.0  # OpenAI's upload limit


@dataclass
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)
    avg_logprob: float = 0.0


@dataclass
class Transcript:
    text: str
    segments: list[Segment]
    language: str
    duration: float


@dataclass
class TranscriptionRequest:
    """What ``run``/``stream`` take (picklable): 16 kHz mono float32 audio plus options.
    ``vad``: None = only for audio longer than one window."""

    audio: np.ndarray
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    vad: bool | None = None


@dataclass
class TranscriptDelta:
    """A streamed piece: ``text`` to append; the last one has ``transcript`` set."""

    text: str
    transcript: Transcript | None = None


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
    max_audio_s: float = 3600.0
    # Encoder linears in oneDNN's prepacked layout (fp32 CPU): 1.5x faster encoder passes here,
    # same results up to fp32 summation order. The swap modifies the given model in place.
    prepack_encoder: bool = True


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
        self.whisper = whisper
        self.model_name = whisper.name
        self.max_file_mb = self.config.max_file_mb
        self.max_audio_s = self.config.max_audio_s
        model = whisper.model
        if self.config.prepack_encoder and _cpu_fp32(model):
            from engine.cpu_linear import onednn_available, use_prepacked_linears

            if onednn_available():
                use_prepacked_linears(model.model.encoder)
        self.adapter = WhisperDecoderAdapter(model)
        max_len = model.config.max_target_positions
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
        )
        loaded = LoadedModel(model, whisper.tokenizer, whisper.path, whisper.name, max_len)
        self.engine = AsyncEngine(LLMEngine(ecfg, loaded, adapter=self.adapter))
        gen = model.generation_config
        self._tok = {
            t: whisper.tokenizer.convert_tokens_to_ids(t) for t in ("<|startoftranscript|>", "<|startofprev|>")
        }
        self._no_ts = gen.no_timestamps_token_id
        self._begin_suppress = list(getattr(gen, "begin_suppress_tokens", None) or [])
        self._enc_queue: asyncio.Queue[tuple[np.ndarray, asyncio.Future[Any]]] | None = None
        self._enc_task: asyncio.Task[None] | None = None
        self.audio_seconds = 0.0
        self.num_windows = 0
        self.num_encoder_batches = 0

    @classmethod
    def from_config(cls, config: AsrConfig) -> AsrEngine:
        return cls(load_whisper(config.model), config)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.engine.start()
        self._ensure_encoder_loop()

    def _ensure_encoder_loop(self) -> None:
        """The encoder batcher runs on the caller's event loop; a caller on a new loop (a test,
        a worker running each call under ``asyncio.run``) gets a fresh one."""
        loop = asyncio.get_running_loop()
        if self._enc_task is None or self._enc_task.done() or self._enc_task.get_loop() is not loop:
            self._enc_queue = asyncio.Queue()
            self._enc_task = loop.create_task(self._encoder_loop())

    async def shutdown(self) -> None:
        if self._enc_task is not None:
            if not self._enc_task.get_loop().is_closed():
                self._enc_task.cancel()
            self._enc_task = None
        await self.engine.shutdown()

    def stats(self) -> dict[str, float]:
        s = {f"decoder_{k}": v for k, v in self.engine.stats().items()}
        s.update(
            audio_seconds_total=self.audio_seconds,
            windows_total=self.num_windows,
            encoder_batches_total=self.num_encoder_batches,
            cross_kv_cached=self.adapter.num_cached_cross,
        )
        return s

    # -- encoder batching ----------------------------------------------------------------------
    async def _encode(self, audio: np.ndarray) -> Any:
        """Encoder output [frames, d_model] of one ≤30 s window (batched with concurrent calls)."""
        await self.start()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        assert self._enc_queue is not None
        await self._enc_queue.put((audio, fut))
        return await fut

    async def _encoder_loop(self) -> None:
        assert self._enc_queue is not None
        while True:
            batch = [await self._enc_queue.get()]
            while len(batch) < self.config.max_encoder_batch and not self._enc_queue.empty():
                batch.append(self._enc_queue.get_nowait())
            await self._encode_batch(batch)
            # Hold no encoder output past its request: its cross K/V are freed with it.
            del batch

    async def _encode_batch(self, batch: list[tuple[np.ndarray, asyncio.Future[Any]]]) -> None:
        live = [(a, f) for a, f in batch if not f.done()]
        if not live:
            return
        try:
            outs = await asyncio.to_thread(self._run_encoder, [a for a, _ in live])
        except Exception as exc:  # noqa: BLE001 - fail the waiters, keep the loop alive
            for _, f in live:
                if not f.done():
                    f.set_exception(exc)
            return
        for (_, f), out in zip(live, outs, strict=True):
            if not f.done():
                f.set_result(out)

    def _run_encoder(self, audios: list[np.ndarray]) -> list[Any]:
        import torch

        feats = self.whisper.feature_extractor(audios, sampling_rate=RATE, return_tensors="pt").input_features
        with torch.inference_mode():
            hidden = self.whisper.model.model.encoder(
                input_features=feats.to(self.whisper.model.dtype)
            ).last_hidden_state
            outs = [hidden[i].clone() for i in range(hidden.shape[0])]
            for out in outs:  # cross-attention K/V here, off the decode loop
                self.adapter.cross_kv(out)
        self.num_encoder_batches += 1
        return outs

    # -- prompts -------------------------------------------------------------------------------
    def prompt_ids(self, language: str | None = None, prompt: str | None = None) -> list[int]:
        """Decoder prompt: [<|startofprev|> prompt...] <|startoftranscript|> [lang task] <|notimestamps|>."""
        tok = self.whisper.tokenizer
        ids: list[int] = []
        if prompt:
            text_ids = tok(" " + prompt.strip(), add_special_tokens=False).input_ids
            ids += [self._tok["<|startofprev|>"], *text_ids[-(self.config.max_new_tokens - 1) :]]
        ids.append(self._tok["<|startoftranscript|>"])
        if self.whisper.multilingual:
            gen = self.whisper.model.generation_config
            lang = f"<|{(language or 'en').lower()}|>"
            if lang not in gen.lang_to_id:
                raise ValueError(f"unsupported language {language!r}")
            ids += [gen.lang_to_id[lang], gen.task_to_id["transcribe"]]
        elif language and language.lower() not in ("en", "english"):
            raise ValueError(f"model {self.model_name} is English-only; language {language!r} is not supported")
        ids.append(self._no_ts)
        return ids

    # -- decoding ------------------------------------------------------------------------------
    async def _decode_window(
        self, audio: np.ndarray, prompt_ids: list[int], temperature: float, seed: int | None = None
    ) -> AsyncIterator[tuple[str, list[int], bool, float]]:
        """Stream (delta text, token ids so far, finished, mean token logprob) for one ≤30 s window."""
        from engine.sampling_params import SamplingParams
        from engine.sequence import PromptInputs

        enc = await self._encode(audio)
        params = SamplingParams(
            temperature=temperature,
            max_tokens=min(self.config.max_new_tokens, self.engine.max_model_len - len(prompt_ids)),
            begin_suppress_token_ids=self._begin_suppress,
            seed=seed,
            logprobs=0,
        )
        request_id = f"asr-{next(self._ids)}"
        async for out in self.engine.generate(request_id, PromptInputs(prompt_ids, encoder_output=enc), params):
            o = out.outputs[0]
            lps = [lp.logprob for lp in o.logprobs or []]
            yield o.delta_text, o.token_ids, out.finished, sum(lps) / len(lps) if lps else 0.0

    async def decode_tokens(self, audio: np.ndarray, prompt_ids: list[int], temperature: float = 0.0) -> list[int]:
        """Generated token ids (eos excluded) of one ≤30 s clip: the unit the correctness test
        compares with ``generate()``."""
        tokens: list[int] = []
        async for _, ids, _, _ in self._decode_window(audio, prompt_ids, temperature):
            tokens = ids
        eos = self.whisper.model.generation_config.eos_token_id
        return [t for t in tokens if t != eos]

    def _windows(self, audio: np.ndarray, vad: bool | None) -> list[Window]:
        duration = len(audio) / RATE
        if vad is False or (vad is None and duration <= WINDOW_S):
            return [Window(0.0, duration)] if duration <= WINDOW_S else plan_windows(audio, [(0.0, duration)])
        from modalities.vad import speech_segments

        return plan_windows(audio, speech_segments(audio, self.config.vad_backend))

    async def stream(self, req: TranscriptionRequest) -> AsyncIterator[TranscriptDelta]:
        """Text as it decodes, in order; the last item carries the full ``Transcript``.

        Every window decodes at once (they batch on the engine); a window's live text is passed
        on when all earlier windows are done and it overlaps no neighbour (overlapping windows
        are released once stitched)."""
        audio = np.asarray(req.audio, dtype=np.float32)
        prompt_ids = self.prompt_ids(req.language, req.prompt)
        windows = self._windows(audio, req.vad)
        self.audio_seconds += len(audio) / RATE
        self.num_windows += len(windows)
        queue: asyncio.Queue[tuple[int, str, list[int], bool, float] | BaseException] = asyncio.Queue()

        async def run(i: int, w: Window) -> None:
            try:
                clip = audio[int(w.start * RATE) : int(w.end * RATE)]
                text = ""
                async for delta, tokens, done, lp in self._decode_window(clip, prompt_ids, req.temperature):
                    text += delta
                    await queue.put((i, text, tokens, done, lp))
            except BaseException as exc:  # noqa: BLE001 - surface in the consumer
                await queue.put(exc)
                raise

        tasks = [asyncio.create_task(run(i, w)) for i, w in enumerate(windows)]
        texts = [""] * len(windows)
        tokens = [[] for _ in windows]
        done = [False] * len(windows)
        logprobs = [0.0] * len(windows)
        emitted = ""
        try:
            pending = len(windows)
            while pending:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                i, texts[i], tokens[i], finished, logprobs[i] = item
                if finished:
                    done[i] = True
                    pending -= 1
                stable = _stable_text(windows, texts, done)
                if stable.startswith(emitted) and len(stable) > len(emitted):
                    yield TranscriptDelta(stable[len(emitted) :])
                    emitted = stable
        finally:
            for t in tasks:
                t.cancel()
        segments = _segments(windows, texts, tokens, logprobs)
        text = " ".join(s.text for s in segments)
        if text.startswith(emitted) and len(text) > len(emitted):
            yield TranscriptDelta(text[len(emitted) :])
        yield TranscriptDelta("", Transcript(text, segments, req.language or "en", len(audio) / RATE))

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


def _stitched(windows: list[Window], texts: list[str]) -> list[str]:
    """Per-window texts with the overlap between consecutive split windows removed."""
    out = [t.strip() for t in texts]
    for i in range(1, len(windows)):
        if windows[i].overlaps_prev:
            out[i - 1], out[i] = stitch(out[i - 1], out[i])
    return out


def _stable_text(windows: list[Window], texts: list[str], done: list[bool]) -> str:
    """The transcript prefix that can no longer change: finished windows in order, then the live
    text of the first unfinished one if no overlap stitch can touch it."""
    n = 0
    while n < len(windows) and done[n]:
        n += 1
    # A finished window followed by an overlapping one may still lose its tail to the stitch.
    k = n
    while k > 0 and k < len(windows) and windows[k].overlaps_prev:
        k -= 1
    parts = [t for t in _stitched(windows[:k], texts[:k]) if t]
    if (
        k == n < len(windows)
        and not windows[n].overlaps_prev
        and not (n + 1 < len(windows) and windows[n + 1].overlaps_prev)
    ):
        live = texts[n].strip()
        if live:
            parts.append(live)
    return " ".join(parts)


def _segments(windows: list[Window], texts: list[str], tokens: list[list[int]], lps: list[float]) -> list[Segment]:
    segments = []
    for i, (w, text) in enumerate(zip(windows, _stitched(windows, texts), strict=True)):
        if text:
            segments.append(Segment(len(segments), round(w.start, 3), round(w.end, 3), text, tokens[i], lps[i]))
    return segments


def _cpu_fp32(model: Any) -> bool:
    p = next(model.parameters())
    return p.device.type == "cpu" and str(p.dtype) == "torch.float32"
