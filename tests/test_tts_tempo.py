"""WSOLA time-stretch (``modalities.tts.tempo``): duration scales by 1 / speed, pitch stays, the
streamed output equals the one-shot output for any chunking, and speed 1.0 is a pass-through."""

from __future__ import annotations

import numpy as np
import pytest

from modalities.tts.tempo import TimeStretch, time_stretch

RATE = 24_000
SPEEDS = [0.25, 0.5, 1.5, 2.0, 4.0]


def sine(freq: float = 220.0, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def voiced(seconds: float = 1.5) -> np.ndarray:
    """Speech-like: harmonics of a pitch gliding 100 -> 180 Hz under a syllable envelope, plus
    noise, with a silent gap (the search must cope with all of them)."""
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * RATE)) / RATE
    phase = 2 * np.pi * np.cumsum(100 + 80 * t / seconds) / RATE
    x = sum(np.sin(h * phase) / h for h in range(1, 8)) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    x = x + 0.05 * rng.standard_normal(t.size)
    x[int(0.6 * RATE) : int(0.7 * RATE)] = 0.0
    return (0.3 * x).astype(np.float32)


def dominant_hz(y: np.ndarray) -> tuple[float, float]:
    """Peak frequency and the share of energy within 15 Hz of it."""
    spec = np.abs(np.fft.rfft(y * np.hanning(y.size))) ** 2
    freqs = np.fft.rfftfreq(y.size, 1 / RATE)
    peak = freqs[int(np.argmax(spec))]
    return float(peak), float(spec[np.abs(freqs - peak) < 15].sum() / spec.sum())


def stream(x: np.ndarray, speed: float, sizes: list[int]) -> tuple[np.ndarray, list[int]]:
    """Feed ``x`` in chunks of ``sizes`` (cycled); the output and the output count after each."""
    st = TimeStretch(speed, RATE)
    parts, counts, i, j = [], [], 0, 0
    while i < x.size:
        n = sizes[j % len(sizes)]
        parts.append(st(x[i : i + n]))
        counts.append(sum(p.size for p in parts))
        i, j = i + n, j + 1
    parts.append(st.flush())
    return np.concatenate(parts), counts


@pytest.mark.parametrize("speed", SPEEDS)
def test_duration_scales_by_one_over_speed_and_pitch_stays(speed: float) -> None:
    x = sine(220.0)
    y = time_stretch(x, speed, RATE)
    assert y.dtype == np.float32
    assert y.size == round(x.size / speed)
    assert y.size == pytest.approx(x.size / speed, rel=0.03)
    peak, share = dominant_hz(y)
    assert abs(peak - 220.0) < 3.0
    assert share > 0.99  # frames join in phase: no clicks spreading energy over the spectrum
    mid = y[y.size // 4 : 3 * y.size // 4]
    assert np.sqrt(np.mean(mid**2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.05)  # no amplitude dips


@pytest.mark.parametrize("speed", SPEEDS)
def test_streamed_output_equals_one_shot(speed: float) -> None:
    x = voiced()
    whole = time_stretch(x, speed, RATE)
    assert whole.size == round(x.size / speed)
    sizes = [int(n) for n in np.random.default_rng(1).integers(0, 3000, size=40)] + [1, 1, 7]
    got, _ = stream(x, speed, sizes)
    np.testing.assert_allclose(got, whole, atol=1e-6)
    frames, _ = stream(x, speed, [320 * 4])  # codec-like windows
    np.testing.assert_allclose(frames, whole, atol=1e-6)


@pytest.mark.parametrize("speed", [0.25, 2.0, 4.0])
def test_output_streams_with_bounded_delay(speed: float) -> None:
    x = voiced()
    st = TimeStretch(speed, RATE)
    assert st.delay < 0.08 * RATE  # under 80 ms of input even at 4x
    _, counts = stream(x, speed, [1280])
    for fed, out in zip(range(1280, x.size + 1, 1280), counts, strict=False):
        assert out >= (fed - st.delay) / speed
        assert out <= fed / speed
    assert TimeStretch(speed, RATE)(x[: st.delay]).size > 0  # first output once `delay` samples are in


def test_speed_one_is_a_pass_through() -> None:
    x = voiced()
    st = TimeStretch(1.0, RATE)
    assert st(x) is x  # float32 in: the very same array, untouched
    assert np.array_equal(np.concatenate([st(x[:100]), st(x[100:]), st.flush()]), x)
    assert np.array_equal(time_stretch(x, 1.0, RATE), x)


@pytest.mark.parametrize("speed", SPEEDS)
def test_empty_and_very_short_input(speed: float) -> None:
    assert time_stretch(np.zeros(0, np.float32), speed, RATE).size == 0
    assert TimeStretch(speed, RATE).flush().size == 0
    short = sine(220.0, seconds=0.01)  # 240 samples, less than one 576-sample window
    y = time_stretch(short, speed, RATE)
    assert y.size == round(short.size / speed)
    assert np.isfinite(y).all() and np.abs(y).max() > 0.1
    got, _ = stream(short, speed, [50])
    np.testing.assert_allclose(got, y, atol=1e-6)


def test_flushed_stretch_refuses_more_input() -> None:
    st = TimeStretch(2.0, RATE)
    st(sine())
    st.flush()
    assert st.flush().size == 0
    with pytest.raises(RuntimeError):
        st(sine())


def pitch_hz(x: np.ndarray, rate: int) -> np.ndarray:
    """F0 of each clearly voiced 50 ms frame (normalised autocorrelation over 70-250 Hz, the
    range of the Piper voice; frames whose best lag correlates < 0.6 are left out)."""
    frame, lo, hi = rate // 20, rate // 250, rate // 70
    out = []
    for i in range(0, x.size - frame, frame // 2):
        w = x[i : i + frame] - x[i : i + frame].mean()
        if np.sqrt((w**2).mean()) < 0.03:
            continue
        ac = np.array([np.dot(w[: frame - lag], w[lag:]) / (frame - lag) for lag in range(hi + 1)])
        lag = lo + int(np.argmax(ac[lo:hi]))
        if ac[lag] > 0.6 * ac[0]:
            out.append(rate / lag)
    return np.array(out)


@pytest.mark.parametrize("speed", [0.75, 1.5])
def test_stretched_real_speech_keeps_pitch_voice_and_words(speed: float) -> None:
    """Real speech (the Piper voice), slowed down or sped up: the median pitch stays within 5%
    (resampling would move it by ``speed``), frames stay as periodic and as loud (a plain
    overlap-add without the similarity search cancels phases: measured 0.86x the RMS and half
    the voiced frames), and Whisper tiny.en still hears every sentence."""
    import asyncio

    from modalities.asr.engine import AsrEngine, TranscriptionRequest
    from modalities.asr.model import load_whisper
    from modalities.asr.speech_corpus import RATE as ASR_RATE
    from modalities.asr.speech_corpus import SENTENCES, corpus, word_error_rate

    gap = np.zeros(ASR_RATE // 4, dtype=np.float32)
    audio = np.concatenate([x for clip in corpus("piper")[:4] for x in (clip, gap)])
    stretched = time_stretch(audio, speed, ASR_RATE)
    assert abs(stretched.size - audio.size / speed) <= 1
    f0_in, f0_out = pitch_hz(audio, ASR_RATE), pitch_hz(stretched, ASR_RATE)
    assert abs(np.median(f0_out) / np.median(f0_in) - 1) < 0.05
    voiced_in, voiced_out = f0_in.size / audio.size, f0_out.size / stretched.size
    assert voiced_out > 0.75 * voiced_in, (voiced_in, voiced_out)
    assert np.sqrt((stretched**2).mean()) > 0.95 * np.sqrt((audio**2).mean())

    async def transcribe() -> list[str]:
        engine = AsrEngine(load_whisper("tiny.en"))
        try:
            return [(await engine.run(TranscriptionRequest(a, vad=False))).text for a in (audio, stretched)]
        finally:
            await engine.shutdown()

    # Against tiny.en's own errors on the unstretched clips (2 of 35 words here): at most 3 more.
    base, wer = (word_error_rate([" ".join(SENTENCES[:4])], [t]) for t in asyncio.run(transcribe()))
    assert wer <= base + 0.1, (base, wer)
