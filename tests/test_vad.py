"""VAD on real synthetic speech with known boundaries: both backends find each sentence (padded)
and nothing in the silences; the streaming state machine emits start/stop events in order at the
same times as the offline segments, whatever the chunk size."""

from __future__ import annotations

import numpy as np
import pytest

from modalities.asr.speech_corpus import long_recording
from modalities.vad import VadParams, VadStream, WebRtcClassifier, make_classifier, speech_segments

RATE = 16_000


@pytest.fixture(scope="module")
def recording() -> tuple[np.ndarray, list[tuple[float, float]]]:
    return long_recording("piper", gap_s=1.2, sentences=[0, 3, 8])


def _speech_bounds(audio: np.ndarray, start: float, end: float) -> tuple[float, float]:
    """First/last sample above -40 dBFS within a clip (the clip files carry a little silence)."""
    seg = np.abs(audio[int(start * RATE) : int(end * RATE)])
    loud = np.flatnonzero(seg > 0.01)
    return start + loud[0] / RATE, start + loud[-1] / RATE


@pytest.mark.parametrize("backend", ["webrtc", "silero"])
def test_offline_segments_match_sentences(
    recording: tuple[np.ndarray, list[tuple[float, float]]], backend: str
) -> None:
    audio, bounds = recording
    segs = speech_segments(audio, backend)
    assert len(segs) == len(bounds), segs
    for (s, e), (a, b) in zip(segs, bounds, strict=True):
        lo, hi = _speech_bounds(audio, a, b)
        assert s <= lo + 0.05 and e >= hi - 0.05  # covers the speech
        assert s >= lo - 0.5 and e <= hi + 0.6  # and not much more


def test_silence_and_noise_have_no_speech() -> None:
    rng = np.random.default_rng(0)
    assert speech_segments(np.zeros(RATE * 3, np.float32)) == []
    assert speech_segments((rng.standard_normal(RATE * 3) * 1e-4).astype(np.float32)) == []


@pytest.mark.parametrize("chunk", [160, 4800])
def test_stream_events_match_offline(recording: tuple[np.ndarray, list[tuple[float, float]]], chunk: int) -> None:
    audio, _ = recording
    stream = VadStream(WebRtcClassifier(), VadParams())
    events = []
    for i in range(0, len(audio), chunk):
        events += stream.push(audio[i : i + chunk])
    events += stream.flush()
    kinds = [e.kind for e in events]
    assert kinds == ["speech_started", "speech_stopped"] * 3
    offline = speech_segments(audio)
    starts = [e.time for e in events if e.kind == "speech_started"]
    stops = [e.time for e in events if e.kind == "speech_stopped"]
    assert np.allclose(starts, [s for s, _ in offline]) and np.allclose(stops, [e for _, e in offline], atol=0.2)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown VAD backend"):
        make_classifier("nope")


def _stops(audio: np.ndarray, floor: float | None) -> list[float]:
    stream = VadStream(WebRtcClassifier(), VadParams(min_silence_ms=150, pad_ms=0, floor_dbfs=floor))
    return [ev.time for ev in stream.push(audio) if ev.kind == "speech_stopped"]


def test_level_floor_cuts_the_hangover_on_clean_audio_only(
    recording: tuple[np.ndarray, list[tuple[float, float]]],
) -> None:
    """webrtcvad calls ~0.1 s of silence after speech "speech"; frames under the floor are not.
    Under noise louder than the floor, the floor changes nothing."""
    audio, bounds = recording
    plain, floored = _stops(audio, None), _stops(audio, -50.0)
    assert len(plain) == len(floored) == len(bounds)
    for p, f, (a, b) in zip(plain, floored, bounds, strict=True):
        end = _speech_bounds(audio, a, b)[1]
        assert end - 0.03 <= f <= p - 0.06, (end, f, p)  # still after the speech, sooner than without
    noise = np.random.default_rng(0).normal(0, 10 ** (-40 / 20), audio.size).astype(np.float32)  # -40 dBFS
    assert _stops(audio + noise, -50.0) == _stops(audio + noise, None)


def test_silero_classifiers_share_one_model_but_not_their_state(
    recording: tuple[np.ndarray, list[tuple[float, float]]],
) -> None:
    """Every Silero classifier runs on one onnxruntime session (building one per call cost ~70 ms),
    and each keeps its own recurrent state: interleaved streams score as they do alone."""
    audio, _ = recording
    n = make_classifier("silero").frame_samples
    frames = [audio[i : i + n] for i in range(0, 40 * n, n)]
    alone = make_classifier("silero")
    expected = [alone(f) for f in frames]
    a, b = make_classifier("silero"), make_classifier("silero")
    assert a._session is b._session is alone._session
    got = []
    for f in frames:
        got.append(a(f))
        b(np.flip(f).copy())  # another stream's audio between a's frames
    assert got == expected and max(expected) > 0.5  # (the stretch holds speech)
