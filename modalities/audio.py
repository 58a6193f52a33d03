"""Shared audio I/O for the speech modalities: decode any upload to mono float32 at a target rate,
resample, and encode PCM for responses.

Decoding tries ``soundfile`` first (wav, flac, ogg/vorbis, ogg/opus via libsndfile) and falls back
to PyAV (bundled ffmpeg: mp3, m4a, webm, ...). Resampling uses ``soxr`` (no torchaudio). Every
decoding failure is an ``AudioDecodeError`` so routes can answer 400.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

ASR_RATE = 16_000
MAX_AUDIO_S = 3600.0  # the longest upload transcribed (``--asr-max-audio-s``)


class AudioDecodeError(ValueError):
    """The bytes are not audio we can read (or contain no samples)."""


class AudioTooLong(AudioDecodeError):
    """The audio lasts longer than the caller takes (found from the header where it says, else
    while decoding: a small compressed file can hold hours of silence)."""

    def __init__(self, seconds: float, limit: float) -> None:
        super().__init__(f"the audio is {seconds:.0f} s long; the limit is {limit:g} s")
        self.seconds, self.limit = seconds, limit


BLOCK_FRAMES = 1 << 20  # decoded per read: a many-channel file is mixed down a block at a time


@dataclass
class Audio:
    """Mono float32 samples in [-1, 1] at ``rate`` Hz."""

    samples: np.ndarray
    rate: int

    @property
    def duration(self) -> float:
        return len(self.samples) / self.rate if self.rate else 0.0


def _to_mono_f32(data: np.ndarray) -> np.ndarray:
    data = np.asarray(data)
    if data.dtype.kind == "i":  # integer PCM -> [-1, 1]
        data = data.astype(np.float32) / float(np.iinfo(data.dtype).max + 1)
    elif data.dtype.kind == "u":
        info = np.iinfo(data.dtype)
        data = (data.astype(np.float32) - (info.max + 1) / 2) / ((info.max + 1) / 2)
    data = data.astype(np.float32, copy=False)
    if data.ndim == 2:
        data = data.mean(axis=1)
    return np.ascontiguousarray(data)


UNKNOWN_FRAMES = 1 << 62  # libsndfile reports SF_COUNT_MAX (2^63 - 1) frames for an unknown length


def _check_length(samples: int, rate: float, max_seconds: float | None) -> None:
    if max_seconds is not None and rate > 0 and samples / rate > max_seconds:
        raise AudioTooLong(samples / rate, max_seconds)


def _decode_soundfile(data: bytes, max_seconds: float | None) -> Audio | None:
    import soundfile as sf

    try:
        f = sf.SoundFile(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - libsndfile cannot read it: let PyAV try
        return None
    with f:
        rate = int(f.samplerate)
        if 0 < f.frames < UNKNOWN_FRAMES:  # libsndfile's count when the header has none (a streamed FLAC)
            _check_length(f.frames, rate, max_seconds)  # before decoding a sample
        blocks, total = [], 0
        try:
            while (block := f.read(BLOCK_FRAMES, dtype="float32", always_2d=True)).shape[0]:
                blocks.append(_to_mono_f32(block))
                total += block.shape[0]
                _check_length(total, rate, max_seconds)  # (a header may say less than there is)
        except AudioTooLong:
            raise
        except Exception:  # noqa: BLE001 - a body libsndfile can't read after all: let PyAV try
            return None
        if 0 < f.frames < UNKNOWN_FRAMES and total < f.frames * 0.99:
            return None  # libsndfile stopped at damage (an MP3's bad frame): PyAV skips it
    return Audio(np.concatenate(blocks) if blocks else np.zeros(0, np.float32), rate)


UNREADABLE = (
    "could not decode audio: it is damaged or in no format this server reads (wav, flac, mp3, ogg, opus, m4a, "
    "aac, webm, ...)"
)


def _decode_av(data: bytes, max_seconds: float | None) -> Audio:
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            streams = container.streams.audio
            if not streams:
                raise AudioDecodeError("the file has no audio stream")
            stream = streams[0]
            rate = stream.codec_context.sample_rate or stream.rate
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            chunks: list[np.ndarray] = []
            total, damaged = 0, 0
            for packet in container.demux(stream):
                try:
                    frames = packet.decode()
                except av.error.InvalidDataError:  # a damaged packet: skipped, as ffmpeg's tools do
                    damaged += 1
                    continue
                for frame in frames:
                    for out in resampler.resample(frame):
                        chunks.append(out.to_ndarray().reshape(-1))
                        total += chunks[-1].size
                    _check_length(total, rate or 0, max_seconds)
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
            if damaged and not total:
                raise AudioDecodeError(UNREADABLE)
    except AudioDecodeError:
        raise
    except av.error.InvalidDataError as exc:
        raise AudioDecodeError(UNREADABLE) from exc
    except av.error.FFmpegError as exc:  # (its text names ffmpeg's calls: the reason alone)
        raise AudioDecodeError(f"could not decode audio: {exc.strerror or type(exc).__name__}") from exc
    except Exception as exc:  # noqa: BLE001 - any ffmpeg failure means unreadable input
        raise AudioDecodeError(f"could not decode audio: {exc}") from exc
    if not rate:
        raise AudioDecodeError("could not determine the sample rate")
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    return Audio(samples, int(rate))


def resample(samples: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Mono float32 resampling with soxr (high quality); a no-op when the rates match."""
    samples = np.asarray(samples, dtype=np.float32)
    if src_rate == dst_rate or samples.size == 0:
        return samples
    import soxr

    return soxr.resample(samples, src_rate, dst_rate, quality="HQ").astype(np.float32, copy=False)


def decode_audio(data: bytes, rate: int | None = ASR_RATE, max_seconds: float | None = None) -> Audio:
    """Decode an audio file's bytes to mono float32 in [-1, 1], resampled to ``rate`` (``None``:
    native rate). Raises ``AudioDecodeError`` for unreadable or empty input, ``AudioTooLong`` past
    ``max_seconds`` (before decoding all of it)."""
    if not data:
        raise AudioDecodeError("the audio file is empty")
    audio = _decode_soundfile(data, max_seconds) or _decode_av(data, max_seconds)
    _check_samples(audio, "")
    # Float samples past full scale are clipped, as ffmpeg's conversion to 16-bit clips them for
    # openai-whisper (a float WAV written at int16 scale was heard as noise).
    audio = Audio(np.clip(audio.samples, -1.0, 1.0), audio.rate)
    if rate is not None and audio.rate != rate:
        # Again after: a header's rate of 2**31 Hz leaves no sample at 16 kHz.
        audio = Audio(resample(audio.samples, audio.rate, rate), rate)
        _check_samples(audio, f" after resampling to {rate} Hz")
    return audio


def _check_samples(audio: Audio, where: str) -> None:
    if audio.samples.size == 0:
        raise AudioDecodeError(f"the audio file contains no samples{where}")
    if not np.isfinite(audio.samples).all():
        raise AudioDecodeError(f"the audio contains non-finite samples{where}")


# -- encoders -----------------------------------------------------------------------------------
def to_pcm16(samples: np.ndarray) -> bytes:
    """Little-endian signed 16-bit PCM (clipped)."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def from_pcm16(data: bytes) -> np.ndarray:
    """Inverse of ``to_pcm16`` (float32 in [-1, 1))."""
    return np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2").astype(np.float32) / 32768.0


def encode_audio(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """Whole-file encoding: ``wav`` (PCM16), ``flac``, ``ogg`` (vorbis) via soundfile; ``pcm``
    (raw PCM16); ``mp3``/``opus``/``aac`` via PyAV."""
    samples = np.asarray(samples, dtype=np.float32)
    if fmt == "pcm":
        return to_pcm16(samples)
    if fmt in ("wav", "flac", "ogg"):
        import soundfile as sf

        buf = io.BytesIO()
        subtype = {"wav": "PCM_16", "flac": "PCM_16", "ogg": "VORBIS"}[fmt]
        sf.write(buf, np.clip(samples, -1, 1), rate, format=fmt.upper(), subtype=subtype)
        return buf.getvalue()
    if fmt in ("mp3", "opus", "aac"):
        return _encode_av(samples, rate, fmt)
    raise ValueError(f"unsupported audio format {fmt!r}")


def _encode_av(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    import av

    codec, container_fmt = {"mp3": ("libmp3lame", "mp3"), "opus": ("libopus", "ogg"), "aac": ("aac", "adts")}[fmt]
    out_rate = 48_000 if fmt == "opus" else rate  # opus only runs at 8/12/16/24/48 kHz
    data = np.clip(resample(samples, rate, out_rate), -1, 1)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container_fmt) as container:
        stream = container.add_stream(codec, rate=out_rate)
        stream.layout = "mono"
        # The encoder's own sample format and frame size; the resampler re-frames for us.
        resampler = av.AudioResampler(
            format=stream.codec_context.format.name, layout="mono", rate=out_rate, frame_size=stream.frame_size or None
        )
        frame = av.AudioFrame.from_ndarray(data[None, :], format="flt", layout="mono")
        frame.sample_rate = out_rate
        for chunk in [*resampler.resample(frame), *resampler.resample(None)]:
            for packet in stream.encode(chunk):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


# -- streaming encoders (TTS responses) ----------------------------------------------------------
STREAM_FORMATS = ("wav", "pcm", "flac", "mp3", "opus", "aac")
MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "ogg": "audio/ogg",
}


def wav_stream_header(rate: int) -> bytes:
    """A PCM16 mono WAV header for a stream of unknown length (sizes 0xFFFFFFFF, as OpenAI and
    ffmpeg write for pipes; decoders read to the end of the data)."""
    import struct

    unknown = 0xFFFFFFFF
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, rate, rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", unknown) + b"WAVE" + fmt + b"data" + struct.pack("<I", unknown)


class _Sink:
    """Write-only file object: ffmpeg muxers see a non-seekable pipe and write streamable output."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def write(self, data: bytes) -> int:
        self.buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


class StreamEncoder:
    """Incremental encoder: ``encode(chunk)`` returns the bytes ready so far (possibly empty),
    ``close()`` the rest; their concatenation is one valid file. ``wav`` is a streaming WAV
    header then PCM16, ``pcm`` raw PCM16; ``flac``/``mp3``/``opus``/``aac`` go through PyAV, resampled
    to a rate the codec takes where ``rate`` is not one (opus: 48 kHz; mp3/aac: the nearest)."""

    def __init__(self, fmt: str, rate: int) -> None:
        if fmt not in STREAM_FORMATS:
            raise ValueError(f"unsupported audio format {fmt!r}; choose from {', '.join(STREAM_FORMATS)}")
        self.fmt, self.rate = fmt, rate
        self.out_rate = rate  # the rate of the audio it writes (a codec's may differ: ``_open_av``)
        self._header = wav_stream_header(rate) if fmt == "wav" else b""
        self._container = None
        if fmt in ("flac", "mp3", "opus", "aac"):
            self._open_av()

    def _open_av(self) -> None:
        import av

        codec, container_fmt = {
            "flac": ("flac", "flac"),
            "mp3": ("libmp3lame", "mp3"),
            "opus": ("libopus", "ogg"),
            "aac": ("aac", "adts"),
        }[self.fmt]
        rates = av.Codec(codec, "w").audio_rates  # None: any rate
        if self.fmt == "opus":
            self.out_rate = 48_000
        elif rates and self.rate not in rates:  # e.g. mp3 at 9 kHz: the nearest rate the codec takes
            self.out_rate = min(rates, key=lambda r: (abs(r - self.rate), -r))
        else:
            self.out_rate = self.rate
        self._sink = _Sink()
        options = {"page_duration": "20000"} if self.fmt == "opus" else {}  # short ogg pages: low latency
        self._container = av.open(self._sink, mode="w", format=container_fmt, options=options)
        self._stream = self._container.add_stream(codec, rate=self.out_rate)
        self._stream.layout = "mono"
        self._resampler = av.AudioResampler(
            format=self._stream.codec_context.format.name,
            layout="mono",
            rate=self.out_rate,
            frame_size=self._stream.frame_size or None,
        )
        if self.out_rate != self.rate:
            import soxr

            self._soxr = soxr.ResampleStream(self.rate, self.out_rate, 1, dtype="float32")

    def _mux(self, frames: list) -> None:
        for chunk in frames:
            for packet in self._stream.encode(chunk):
                self._container.mux(packet)

    def encode(self, samples: np.ndarray) -> bytes:
        samples = np.asarray(samples, dtype=np.float32)
        if self._container is None:
            head, self._header = self._header, b""
            return head + to_pcm16(samples)
        import av

        if self.out_rate != self.rate:
            samples = self._soxr.resample_chunk(samples)
        if samples.size:
            frame = av.AudioFrame.from_ndarray(np.clip(samples, -1, 1)[None, :], format="flt", layout="mono")
            frame.sample_rate = self.out_rate
            self._mux(self._resampler.resample(frame))
        return self._sink.take()

    def close(self) -> bytes:
        if self._container is None:
            head, self._header = self._header, b""
            return head
        import av

        if self.out_rate != self.rate:
            tail = self._soxr.resample_chunk(np.zeros(0, np.float32), last=True)
            if tail.size:
                frame = av.AudioFrame.from_ndarray(np.clip(tail, -1, 1)[None, :], format="flt", layout="mono")
                frame.sample_rate = self.out_rate
                self._mux(self._resampler.resample(frame))
        self._mux(self._resampler.resample(None))
        self._mux([None])
        self._container.close()
        self._container = None
        return self._sink.take()
