"""Autoregressive TTS on the shared engine: "an LLM wearing a hat".

A Llama-family model whose vocabulary carries audio-codec tokens (layout in ``mmserve_tts.json``,
see ``modalities.tts.tiny``) runs on ``engine.async_engine.AsyncEngine`` like any LLM request:
paged KV, continuous batching with other requests, preemption by recompute, abort on cancel.
Sampling is constrained to the codec tokens and ``<|audio_end|>`` (``allowed_token_ids``); a
piece stops at ``<|audio_end|>`` or ``max_frames``. Codec tokens are turned into waveform by the
model's transformers codec (DAC) as they arrive (``modalities.tts.codec_stream``): a window every
``decode_every`` frames (the first after ``first_every``) with the decoder's receptive field as
context, so the streamed audio equals one decode of all frames; the windows of all concurrent
requests are decoded in batches between engine steps. The engine reports a request's progress
only at the frame counts where a window may come due (``stream_interval``), not per token.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.admission import Admission
from modalities.stream_resample import Resampler
from modalities.tts.base import ReportsUsage, check_request
from modalities.tts.codec_stream import CodecBatcher, StreamingCodecDecoder
from modalities.tts.protocol import DEFAULT_MAX_REQUESTS, TTSRequest, TTSUsage
from modalities.tts.tempo import TimeStretch
from modalities.tts.text import split_text
from modalities.tts.tiny import TTS_CONFIG


@dataclass(frozen=True)
class ARTTSLayout:
    """Where the special and codec tokens sit in the model's vocabulary."""

    audio_start_id: int
    audio_end_id: int
    voices: dict[str, int]
    codec_offset: int
    codebook_size: int
    num_codebooks: int
    codec_dir: str = "codec"
    context_frames: int = 16
    temperature: float = 0.0

    @classmethod
    def load(cls, model_dir: Path) -> ARTTSLayout:
        path = model_dir / TTS_CONFIG
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} is not an AR TTS model (no {TTS_CONFIG})")
        raw = json.loads(path.read_text())
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})

    @property
    def codec_token_ids(self) -> list[int]:
        return list(range(self.codec_offset, self.codec_offset + self.num_codebooks * self.codebook_size))

    def codes(self, token_ids: list[int]) -> np.ndarray:
        """Complete frames of ``token_ids`` as ``[num_codebooks, frames]`` codes. A token is read
        as the code of the codebook its position in the frame calls for (a token from another
        codebook's range maps onto this one modulo ``codebook_size``)."""
        q = self.num_codebooks
        n = len(token_ids) // q * q
        arr = np.asarray(token_ids[:n], dtype=np.int64) - self.codec_offset
        return (arr % self.codebook_size).reshape(-1, q).T


class ARTTSEngine(ReportsUsage):
    """AR TTS behind the TTS engine contract (``modalities.tts.base``). ``engine`` may be shared
    with text requests: ``engine.generate`` is the same call LLM routes make."""

    modality = "tts"
    supports_speed = True  # WSOLA time-stretch of the decoded audio

    def __init__(
        self,
        engine: Any,
        codec: Any,
        layout: ARTTSLayout,
        max_frames: int = 750,
        decode_every: int = 8,
        name: str | None = None,
        first_every: int | None = None,
        warm_up_batch: int = 8,
        max_requests: int | None = DEFAULT_MAX_REQUESTS,
    ) -> None:
        self.engine = engine
        self.codec = codec
        self.layout = layout
        self.max_frames = max_frames
        self.decode_every = decode_every
        # By default the first window is cut so that it, and so every later one, comes due at a
        # multiple of decode_every frames: the engine then reports progress once per window.
        ctx = layout.context_frames
        aligned = -ctx % decode_every
        self.first_every = first_every or (aligned if 2 * aligned >= decode_every else aligned + decode_every)
        self.stream_interval = layout.num_codebooks * math.gcd(ctx + self.first_every, decode_every)
        self.warm_up_batch = warm_up_batch  # codec shapes set up at start (see codec_shapes)
        self._warm = False
        # The codec decode runs between the engine's steps, batched across requests: on a few
        # cores, a decode running beside the step slowed both (two thread teams on the same cores).
        self.codec_batcher = CodecBatcher(codec, getattr(engine, "call_between_steps", None))
        self.model_name = name or engine.model_name
        self.voices = list(layout.voices)
        self.sample_rate = int(codec.config.sampling_rate)
        self.tokenizer = engine.tokenizer
        self._allowed = [*layout.codec_token_ids, layout.audio_end_id]
        self._admission = Admission(max_requests)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 32,
        device: str = "cpu",
        **kwargs: Any,
    ) -> ARTTSEngine:
        """Load the LM with the engine's model loader and the codec from ``DIR/codec``, both on
        ``device``. The engine is this voice's own: its queue takes every piece (the requests are
        bounded above it, by ``max_requests``), so a job's or a live turn's is never refused."""
        from transformers import AutoModel

        from engine.async_engine import AsyncEngine
        from engine.config import EngineConfig

        path = Path(model_dir).expanduser()
        layout = ARTTSLayout.load(path)
        config = EngineConfig(
            model=str(path),
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            device=device,
            max_waiting=sys.maxsize,
        )
        codec = AutoModel.from_pretrained(path / layout.codec_dir, local_files_only=True).to(device).eval()
        return cls(AsyncEngine.from_config(config), codec, layout, **kwargs)

    async def start(self) -> None:
        await self.engine.start()
        if self.warm_up_batch and not self._warm:
            self._warm = True
            await self.codec_batcher.warm_up(self.codec_shapes(self.warm_up_batch))

    def codec_shapes(self, max_batch: int) -> list[tuple[int, int, int]]:
        """The codec input shapes streaming produces up to ``max_batch`` concurrent windows: every
        bounded window width (batched, padded to the widest), read off a ``StreamingCodecDecoder``
        fed blank frames, and every width a piece's last window (decoded alone) can have."""
        q = self.layout.num_codebooks
        decoder = StreamingCodecDecoder(self.codec, self.layout.context_frames, self.decode_every, self.first_every)
        frame = np.zeros((q, 1), dtype=np.int64)
        widths: list[int] = []
        while True:  # windows until one starts past frame 0: every later one has its width
            window = decoder.take(frame)
            if window is not None:
                widths.append(window.codes.shape[1])
                if widths[-1] < decoder.frames.shape[1]:
                    break
        batched = [(b, q, w) for b in range(2, max_batch + 1) for w in widths]
        return [(1, q, w) for w in range(1, max(widths) + 1)] + batched

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), "requests_active": self._admission.active}

    # -- requests ------------------------------------------------------------------------------
    def prompt_ids(self, text: str, voice: str) -> list[int]:
        """``<|voice:V|> text <|audio_start|>``."""
        text_ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return [self.layout.voices[voice], *text_ids, self.layout.audio_start_id]

    def sampling_params(self, max_frames: int | None = None) -> Any:
        """Codec tokens only, stop at ``<|audio_end|>`` or after ``max_frames`` frames."""
        from engine.sampling_params import SamplingParams

        frames = max_frames or self.max_frames
        return SamplingParams(
            temperature=self.layout.temperature,
            max_tokens=frames * self.layout.num_codebooks,
            allowed_token_ids=self._allowed,
            stop_token_ids=[self.layout.audio_end_id],
            ignore_eos=True,  # the text EOS is not a codec token; only <|audio_end|> ends audio
            detokenize=False,  # codec tokens have no text: skip the per-token decode
            stream_interval=self.stream_interval,  # woken when a window may be due, not per token
        )

    async def _piece(self, text: str, voice: str, usage: TTSUsage) -> AsyncIterator[np.ndarray]:
        """Waveform of one text piece at the codec's rate, as frames arrive (its tokens counted in ``usage``)."""
        decoder = StreamingCodecDecoder(self.codec, self.layout.context_frames, self.decode_every, self.first_every)
        q = self.layout.num_codebooks
        tokens: list[int] = []
        used = 0
        prompt = self.prompt_ids(text, voice)
        usage.input_tokens += len(prompt)
        gen = self.engine.generate(None, prompt, self.sampling_params())
        async with aclosing(gen):  # closing the stream aborts the engine request now, not at GC
            async for out in gen:
                usage.output_tokens += len(out.outputs[0].delta_token_ids)
                tokens.extend(t for t in out.outputs[0].delta_token_ids if t != self.layout.audio_end_id)
                complete = len(tokens) // q * q
                if complete > used:
                    window = decoder.take(self.layout.codes(tokens[used:complete]))
                    used = complete
                    if window is not None:
                        audio = await self.codec_batcher.decode(window)
                        if audio.size:
                            yield audio
        window = decoder.take_last()
        if window is not None:
            tail = await self.codec_batcher.decode(window)
            if tail.size:
                yield tail

    def stream(self, req: TTSRequest) -> AsyncIterator[np.ndarray]:
        """Float32 chunks every ``decode_every`` frames, at ``req.sample_rate or sample_rate``;
        ``req.speed`` is a pitch-preserving time-stretch of the codec's audio (``tempo``).
        ``HeldBoundError`` first for a ``refusable`` request while ``max_requests`` are held."""
        return self._admission.held(req.refusable, self._stream(req))

    async def _stream(self, req: TTSRequest) -> AsyncIterator[np.ndarray]:
        voice = check_request(self, req)
        stretch = TimeStretch(req.speed, self.sample_rate)
        resample = Resampler(self.sample_rate, req.sample_rate or self.sample_rate)
        for piece in split_text(req.text):
            async with aclosing(self._piece(piece, voice, req.usage)) as audio_chunks:
                async for audio in audio_chunks:
                    out = resample(stretch(audio))
                    if out.size:
                        yield out
        tail = np.concatenate([resample(stretch.flush()), resample.flush()])
        if tail.size:
            yield tail
