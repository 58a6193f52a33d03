"""Voice activity detection, shared by ASR (long-file chunking) and the speech pipelines.

Two frame classifiers behind one interface: ``webrtcvad`` (default; 30 ms frames, binary) and
Silero VAD (its ONNX file from the ``silero-vad`` package, run with onnxruntime; 32 ms frames,
probabilities). One hysteresis state machine turns frame scores into speech segments, both
offline (``speech_segments``) and incrementally (``VadStream.push`` → start/stop events).
Audio is mono float32 at 16 kHz.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RATE = 16_000


class WebRtcClassifier:
    """webrtcvad: 1.0 for speech frames, 0.0 otherwise; ``aggressiveness`` 0 (lenient) .. 3."""

    frame_samples = 480  # 30 ms

    def __init__(self, aggressiveness: int = 2) -> None:
        import webrtcvad

        self._vad = webrtcvad.Vad(aggressiveness)

    def __call__(self, frame: np.ndarray) -> float:
        pcm = (np.clip(frame, -1, 1) * 32767).astype("<i2").tobytes()
        return 1.0 if self._vad.is_speech(pcm, RATE) else 0.0

    def reset(self) -> None:
        """Stateless per frame: nothing to reset."""


class SileroClassifier:
    """Silero VAD v5 (ONNX): speech probability per 512-sample frame, with recurrent state."""

    frame_samples = 512  # 32 ms
    _context_samples = 64

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            from importlib.resources import files

            path = str(files("silero_vad") / "data" / "silero_vad.onnx")
        self._session = _onnx_session(path)  # shared: the recurrent state lives here, not in it
        self._sr = np.array(RATE, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros((1, self._context_samples), dtype=np.float32)

    def __call__(self, frame: np.ndarray) -> float:
        x = np.concatenate([self._context, frame.astype(np.float32)[None, :]], axis=1)
        out, self._state = self._session.run(None, {"input": x, "state": self._state, "sr": self._sr})
        self._context = x[:, -self._context_samples :]
        return float(out[0, 0])


@functools.cache
def _onnx_session(path: str) -> Any:
    """One onnxruntime session per model file and process (building one takes ~70 ms; ``run``
    is safe to call from several threads at once)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    return ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


def make_classifier(backend: str = "webrtc") -> WebRtcClassifier | SileroClassifier:
    if backend == "webrtc":
        return WebRtcClassifier()
    if backend == "silero":
        return SileroClassifier()
    raise ValueError(f"unknown VAD backend {backend!r}: choose webrtc or silero")


# Session ``noise_reduction`` types (OpenAI's) -> WebRTC noise suppression levels (0 off .. 3).
# ``mmserve bench noise``: in white noise 10 dB below 12 Piper clips, the VAD ended 1 of them as
# one turn without suppression, 12 with either level. A far-field microphone picks up more of the
# room: the stronger level.
NOISE_SUPPRESSION = {"near_field": 2, "far_field": 3}


class NoiseSuppressor:
    """Streaming WebRTC noise suppression (``webrtc-noise-gain``) of 16 kHz float32 audio, for
    turn detection: ``__call__`` returns the suppressed audio of the whole 10 ms frames received
    so far (the rest waits for the next chunk; the output lags the input by ~6 ms). The ASR
    hears the original audio: tiny.en's word error rate was no better on suppressed audio
    (``mmserve bench noise``)."""

    frame_samples = 160  # 10 ms

    def __init__(self, level: int) -> None:
        from webrtc_noise_gain import AudioProcessor

        self.level = level
        self._proc = AudioProcessor(0, level)  # (no automatic gain: it would move the level floor)
        self.rest = np.zeros(0, np.float32)  # the part frame held back

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        x = np.concatenate([self.rest, np.asarray(samples, np.float32)])
        n = len(x) // self.frame_samples * self.frame_samples
        self.rest = x[n:]
        pcm = (np.clip(x[:n], -1, 1) * 32767).astype("<i2")
        out = b"".join(
            self._proc.Process10ms(pcm[i : i + self.frame_samples].tobytes()).audio
            for i in range(0, n, self.frame_samples)
        )
        return np.frombuffer(out, "<i2").astype(np.float32) / 32768

    def drop_rest(self) -> None:
        """Forget the part frame held back (a new detector's stream starts after it)."""
        self.rest = np.zeros(0, np.float32)


@dataclass
class VadParams:
    threshold: float = 0.5  # a frame is speech at or above this score
    min_speech_ms: int = 150  # shorter bursts are noise
    min_silence_ms: int = 400  # this much non-speech ends a segment
    pad_ms: int = 150  # context kept before/after each segment
    # Frames quieter than this (RMS, dB full scale) are never speech. webrtcvad keeps calling
    # ~130 ms of near-silence after speech "speech" (its hangover); on clean audio (a headset,
    # a browser's noise suppression) a floor ends the turn that much sooner. Where the noise is
    # louder than the floor, it changes nothing. None: the classifier alone.
    floor_dbfs: float | None = None


@dataclass
class VadEvent:
    kind: str  # "speech_started" | "speech_stopped"
    time: float  # seconds since the stream started (padded start / unpadded end + pad)


@dataclass
class VadStream:
    """Incremental VAD: ``push`` any number of samples, get the events they complete.

    ``speech_started`` fires once ``min_speech_ms`` of speech has accumulated (its time is the
    padded start of that speech); ``speech_stopped`` fires after ``min_silence_ms`` of silence
    (its time is the end of speech plus the pad)."""

    classifier: Callable[[np.ndarray], float] = field(default_factory=WebRtcClassifier)
    params: VadParams = field(default_factory=VadParams)
    _buf: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    _frames: int = 0
    _speaking: bool = False
    _run_start: int | None = None  # first frame of the current speech run
    _last_speech: int = -1  # last speech frame
    segments: list[tuple[float, float]] = field(default_factory=list)

    @property
    def _frame_s(self) -> float:
        return self.classifier.frame_samples / RATE  # type: ignore[attr-defined]

    @property
    def speaking(self) -> bool:
        return self._speaking

    @property
    def voiced(self) -> bool:
        """Speech is heard now: a turn, or a run of speech frames that may start one."""
        return self._speaking or self._run_start is not None

    @property
    def silence_ms(self) -> float:
        """While speaking: how long since the last speech frame."""
        return (self._frames - 1 - self._last_speech) * self._frame_s * 1000

    @property
    def end_time(self) -> float:
        """While speaking: the time ``speech_stopped`` would report if no speech followed."""
        return (self._last_speech + 1) * self._frame_s + self.params.pad_ms / 1000

    def push(self, samples: np.ndarray) -> list[VadEvent]:
        n = self.classifier.frame_samples  # type: ignore[attr-defined]
        self._buf = np.concatenate([self._buf, np.asarray(samples, dtype=np.float32)])
        events: list[VadEvent] = []
        floor = self.params.floor_dbfs
        while len(self._buf) >= n:
            frame, self._buf = self._buf[:n], self._buf[n:]
            speech = self.classifier(frame) >= self.params.threshold  # always run: Silero has state
            if speech and floor is not None:
                speech = 10 * math.log10(float(np.mean(frame * frame)) + 1e-20) >= floor
            self._step(speech, events)
        return events

    def _step(self, speech: bool, events: list[VadEvent]) -> None:
        p, fs, i = self.params, self._frame_s, self._frames
        self._frames += 1
        if speech:
            if self._run_start is None:
                self._run_start = i
            self._last_speech = i
            if not self._speaking and (i - self._run_start + 1) * fs * 1000 >= p.min_speech_ms:
                self._speaking = True
                events.append(VadEvent("speech_started", max(0.0, self._run_start * fs - p.pad_ms / 1000)))
            return
        if self._run_start is None:
            return
        if (i - self._last_speech) * fs * 1000 >= p.min_silence_ms:
            if self._speaking:
                events.append(self._close())
            self._run_start = None

    def _close(self) -> VadEvent:
        fs, p = self._frame_s, self.params
        start = max(0.0, self._run_start * fs - p.pad_ms / 1000)  # type: ignore[operator]
        end = self.end_time
        self.segments.append((start, end))
        self._speaking = False
        return VadEvent("speech_stopped", end)

    def flush(self) -> list[VadEvent]:
        """End of input: close an open segment."""
        if self._speaking:
            self._run_start = self._run_start if self._run_start is not None else self._last_speech
            return [self._close()]
        return []


def speech_segments(
    audio: np.ndarray, backend: str = "webrtc", params: VadParams | None = None
) -> list[tuple[float, float]]:
    """Speech spans ``[(start_s, end_s)]`` of 16 kHz mono audio, padded, merged where padding
    overlaps, clipped to the audio."""
    stream = VadStream(make_classifier(backend), params or VadParams())
    stream.push(audio)
    stream.flush()
    duration = len(audio) / RATE
    merged: list[tuple[float, float]] = []
    for start, end in stream.segments:
        start, end = max(0.0, start), min(duration, end)
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        elif end > start:
            merged.append((start, end))
    return merged
