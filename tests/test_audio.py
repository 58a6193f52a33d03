"""Shared audio I/O: every supported container decodes to mono float32 at 16 kHz with the right
duration and content; garbage is an AudioDecodeError."""

from __future__ import annotations

import numpy as np
import pytest

from modalities.audio import ASR_RATE, AudioDecodeError, decode_audio, encode_audio, from_pcm16, resample, to_pcm16


def _tone(rate: int, seconds: float = 1.5, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _dominant_freq(x: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x))
    return float(np.fft.rfftfreq(len(x), 1 / rate)[spec.argmax()])


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg", "mp3", "opus"])
def test_roundtrip_formats(fmt: str) -> None:
    src = _tone(22050)
    audio = decode_audio(encode_audio(src, 22050, fmt))
    assert audio.rate == ASR_RATE and audio.samples.dtype == np.float32 and audio.samples.ndim == 1
    assert abs(audio.duration - 1.5) < 0.1  # lossy codecs pad a little
    assert abs(_dominant_freq(audio.samples, ASR_RATE) - 440) < 5
    assert 0.4 < np.abs(audio.samples).max() < 0.6


def test_stereo_int16_wav_downmixes() -> None:
    import io

    import soundfile as sf

    left = _tone(8000, 1.0, 300.0)
    buf = io.BytesIO()
    sf.write(buf, np.stack([left, left], axis=1), 8000, format="WAV", subtype="PCM_16")
    audio = decode_audio(buf.getvalue(), rate=None)
    assert audio.rate == 8000 and audio.samples.shape == (8000,)
    np.testing.assert_allclose(audio.samples, left, atol=1e-3)


def test_float_samples_past_full_scale_are_clipped() -> None:
    """A float WAV written at int16 scale decodes clipped to [-1, 1] (as ffmpeg gives it to
    openai-whisper), not as samples ~30000 times too loud."""
    import io

    import soundfile as sf

    loud = _tone(16000, 1.0) * 32768.0
    buf = io.BytesIO()
    sf.write(buf, loud, 16000, format="WAV", subtype="FLOAT")
    audio = decode_audio(buf.getvalue())
    np.testing.assert_array_equal(audio.samples, np.clip(loud, -1.0, 1.0))


def test_resample_and_pcm16() -> None:
    x = _tone(24000, 1.0)
    y = resample(x, 24000, 16000)
    assert y.shape == (16000,) and abs(_dominant_freq(y, 16000) - 440) < 2
    np.testing.assert_allclose(from_pcm16(to_pcm16(x)), x, atol=1e-4)


@pytest.mark.parametrize("data", [b"", b"not audio at all" * 64, b"RIFF\x00\x00\x00\x00WAVEfmt "])
def test_garbage_is_decode_error(data: bytes) -> None:
    with pytest.raises(AudioDecodeError):
        decode_audio(data)


def test_a_damaged_mp3_decodes_past_the_damage() -> None:
    """Random bytes over a stretch of an MP3 (a bad upload): the frames after the damage are
    decoded too, as ffmpeg's tools do (libsndfile stopped there: a third of the audio)."""
    mp3 = bytearray(encode_audio(_tone(22050, 4.5), 22050, "mp3"))
    at = len(mp3) // 3
    mp3[at : at + 3000] = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    audio = decode_audio(bytes(mp3))
    assert audio.duration > 3.0, audio.duration


def test_an_unreadable_file_is_named_so_without_ffmpegs_internals() -> None:
    with pytest.raises(AudioDecodeError) as err:
        decode_audio(b"not audio at all" * 64)
    assert "damaged or in no format this server reads" in str(err.value) and "Errno" not in str(err.value)


def test_too_long_audio_is_refused_before_it_is_all_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small compressed file can hold hours: the header's length is checked before any sample is
    decoded (flac), and a stream without one stops as soon as it passes the limit (aac, PyAV)."""
    import soundfile as sf

    from modalities import audio as audio_mod

    silence = np.zeros(8000 * 30, np.float32)  # 30 s at 8 kHz
    flac = encode_audio(silence, 8000, "flac")
    reads: list[int] = []
    real_read = sf.SoundFile.read
    monkeypatch.setattr(sf.SoundFile, "read", lambda self, *a, **k: reads.append(1) or real_read(self, *a, **k))
    with pytest.raises(audio_mod.AudioTooLong) as err:
        decode_audio(flac, max_seconds=10)
    assert err.value.seconds == pytest.approx(30) and reads == []
    assert decode_audio(flac, max_seconds=60).duration == pytest.approx(30)

    monkeypatch.setattr(audio_mod, "_check_length", _counting(audio_mod._check_length, calls := []))
    with pytest.raises(audio_mod.AudioTooLong):
        decode_audio(encode_audio(silence, 8000, "aac"), max_seconds=10)
    assert 10 <= calls[-1] < 12  # stopped within a frame or so of the limit, not after 30 s


def test_a_flac_of_unknown_length_decodes_and_stops_at_the_limit() -> None:
    """A streamed FLAC (ours, or ffmpeg's to a pipe) has no sample count in its header: libsndfile
    reports 2^63 - 1 frames. It decodes, and is held to the limit as it decodes."""
    import io

    import soundfile as sf

    from modalities import audio as audio_mod

    tone = (np.sin(np.arange(8000 * 30) / 5) * 0.3).astype(np.float32)  # 30 s at 8 kHz
    enc = audio_mod.StreamEncoder("flac", 8000)
    data = b"".join(enc.encode(tone[i : i + 4000]) for i in range(0, tone.size, 4000)) + enc.close()
    assert sf.info(io.BytesIO(data)).frames >= audio_mod.UNKNOWN_FRAMES  # the case at hand
    assert decode_audio(data, max_seconds=60).duration == pytest.approx(30)
    with pytest.raises(audio_mod.AudioTooLong):
        decode_audio(data, max_seconds=10)


def _counting(check, calls):  # type: ignore[no-untyped-def]
    def wrapped(samples: int, rate: float, max_seconds: float | None) -> None:
        calls.append(samples / rate if rate else 0.0)
        check(samples, rate, max_seconds)

    return wrapped


def test_headers_and_samples_that_resample_to_nothing_usable_are_decode_errors() -> None:
    import io
    import struct

    import soundfile as sf

    samples = (np.random.default_rng(0).standard_normal(20_000) * 3000).astype("<i2").tobytes()
    rate = 2**31 - 1  # a WAV header's rate: 20000 samples at ~2 GHz are none at 16 kHz
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, rate, (rate * 2) & 0xFFFFFFFF, 2, 16)
    body = b"WAVE" + fmt + b"data" + struct.pack("<I", len(samples)) + samples
    with pytest.raises(AudioDecodeError, match="no samples after resampling"):
        decode_audio(b"RIFF" + struct.pack("<I", len(body)) + body)
    buf = io.BytesIO()  # finite, but the resampler overflowed on them: clipped first now
    sf.write(buf, np.array([3.4e38, -3.4e38] * 2000, np.float32), 44100, format="WAV", subtype="FLOAT")
    audio = decode_audio(buf.getvalue())
    assert np.isfinite(audio.samples).all() and np.abs(audio.samples).max() < 1.5


@pytest.mark.parametrize("law", ["ulaw", "alaw"])
def test_g711_equals_the_reference_codec_on_every_value(law: str) -> None:
    """Every int16 encodes, and every byte decodes, as CPython's ``audioop`` (Sun's G.711 C
    code) does; a tone survives the round trip within the law's quantisation error."""
    import warnings

    from modalities import g711

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")  # gone in Python 3.13
    every = np.arange(-32768, 32768, dtype="<i2")
    assert g711.encode(every / 32767.0, law) == getattr(audioop, f"lin2{law}")(every.tobytes(), 2)
    codes = bytes(range(256))
    decoded = (g711.decode(codes, law) * 32768).astype("<i2")  # from_pcm16's scale
    assert decoded.tobytes() == getattr(audioop, f"{law}2lin")(codes, 2)
    x = _tone(8000, 0.5)
    y = g711.decode(g711.encode(x, law), law)
    assert y.shape == x.shape and np.abs(y - x).max() < 0.02 and abs(_dominant_freq(y, 8000) - 440) < 3
