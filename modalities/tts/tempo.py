"""Pitch-preserving tempo change of a mono stream: WSOLA (waveform-similarity overlap-add).

Output frames of ``frame`` samples are Hann-windowed and overlap-added every ``hop = frame / 2``
samples (periodic Hann at 50 % overlap sums to exactly 1). Frame ``k`` is read from the input
near ``k * hop * speed``, shifted by up to ``tolerance`` samples to where the input looks most
like the natural continuation of frame ``k - 1`` (normalised cross-correlation over the overlap),
so the overlapping waveforms are in phase: the duration changes, the pitch does not.

``TimeStretch`` is the streaming form: it is fed chunks and returns the output that no later
input can change; ``flush()`` returns the rest. Every frame is computed from the same input
samples whatever the chunking, so the concatenated stream equals ``time_stretch`` of the whole
input, and the output has exactly ``round(len(input) / speed)`` samples.
"""

from __future__ import annotations

import numpy as np

FRAME_S = 0.024  # window: a few pitch periods of speech
TOLERANCE_S = 0.010  # search +-10 ms: spans a full period of voices down to 50 Hz


class TimeStretch:
    """Streaming WSOLA at ``rate`` Hz: output lasts ``1 / speed`` times the input (``speed`` > 1 is
    faster). ``speed == 1`` passes chunks through untouched. Before the first output sample it
    needs ``delay`` input samples (2 hops, the tolerance and one analysis hop); after that, the
    output trails the input by at most ``delay`` input samples."""

    def __init__(self, speed: float, rate: int, frame_s: float = FRAME_S, tolerance_s: float = TOLERANCE_S) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.speed = float(speed)
        self.hop = max(1, round(frame_s * rate / 2))
        self.frame = 2 * self.hop
        self.tol = max(1, round(tolerance_s * rate))
        self.delay = self.hop + self.tol + int(np.ceil(self.hop * self.speed)) + 1
        n = np.arange(self.frame)
        self._window = (0.5 - 0.5 * np.cos(2 * np.pi * n / self.frame)).astype(np.float32)
        # Input in "padded" coordinates: hop + tol zeros first, so frame 0 can be centred on
        # sample 0 and every candidate of frame 1 lies inside the buffer.
        self._pad = self.hop + self.tol
        self._buf = np.zeros(self._pad, np.float32)
        self._base = 0  # padded index of _buf[0] (the buffer is trimmed as frames are made)
        self._n_in = 0
        self._k = 0  # next frame
        self._prev = 0  # padded start of frame k - 1
        self._tail = np.zeros(self.hop, np.float32)  # second half of frame k - 1, windowed
        self._n_out = 0
        self._done = False

    def __call__(self, chunk: np.ndarray) -> np.ndarray:
        """Feed ``chunk``; returns the stretched samples now final (maybe none)."""
        chunk = np.asarray(chunk, dtype=np.float32)
        if self.speed == 1.0:
            return chunk
        if self._done:
            raise RuntimeError("TimeStretch was flushed")
        if chunk.size:
            self._buf = np.concatenate([self._buf, chunk.reshape(-1)])
            self._n_in += chunk.size
        return self._frames(self._pad + self._n_in, limit=None)

    def flush(self) -> np.ndarray:
        """The rest of the output (the input is taken to be followed by silence)."""
        if self.speed == 1.0 or self._done:
            return np.zeros(0, np.float32)
        self._done = True
        target = round(self._n_in / self.speed)
        last = -(-target // self.hop)  # frame whose first half ends at or after `target`
        end = self._start(last) + 2 * self.tol + self.frame
        self._buf = np.concatenate([self._buf, np.zeros(max(0, end - self._base - self._buf.size), np.float32)])
        return self._frames(end, limit=target)

    def _start(self, k: int) -> int:
        """Padded index where frame ``k``'s candidates begin (nominal start minus tolerance)."""
        return round(k * self.hop * self.speed)

    def _frames(self, available: int, limit: int | None) -> np.ndarray:
        """Make every frame whose input lies below padded index ``available``; returns the
        output they complete (cut at ``limit`` samples in all when given)."""
        out: list[np.ndarray] = []
        L = self.hop  # overlap of consecutive frames
        while self._start(self._k) + 2 * self.tol + self.frame <= available:
            lo = self._start(self._k)
            if self._k == 0:
                pos = lo + self.tol  # no previous frame to match
            else:
                b = self._base
                template = self._buf[self._prev + self.hop - b : self._prev + self.hop + L - b]
                region = self._buf[lo - b : lo + 2 * self.tol + L - b]
                pos = lo + self._best_shift(region, template)
            seg = self._buf[pos - self._base : pos - self._base + self.frame] * self._window
            if self._k > 0:
                out.append(self._tail + seg[: self.hop])
            self._tail = seg[self.hop :]
            self._prev = pos
            self._k += 1
            # Keep what the next frame reads: its candidates and this frame's continuation.
            keep = min(self._start(self._k), self._prev + self.hop)
            if keep > self._base:
                self._buf = self._buf[keep - self._base :]
                self._base = keep
        y = np.concatenate(out) if out else np.zeros(0, np.float32)
        if limit is not None:
            y = y[: max(0, limit - self._n_out)]
        self._n_out += y.size
        return y

    def _best_shift(self, region: np.ndarray, template: np.ndarray) -> int:
        """Offset into ``region`` where a ``len(template)`` slice correlates best with
        ``template``, normalised by the slice's energy; the centre (no shift) on silence."""
        corr = np.correlate(region, template, mode="valid").astype(np.float64)
        sq = np.concatenate([[0.0], np.cumsum(region.astype(np.float64) ** 2)])
        energy = sq[len(template) :] - sq[: -len(template)]
        score = corr / np.sqrt(np.maximum(energy, 1e-12))
        best = int(np.argmax(score))
        return best if score[best] > 0 else self.tol


def time_stretch(samples: np.ndarray, speed: float, rate: int) -> np.ndarray:
    """``samples`` at ``speed`` (one shot): ``round(len / speed)`` samples, same pitch."""
    stretch = TimeStretch(speed, rate)
    head = stretch(samples)
    return head if speed == 1.0 else np.concatenate([head, stretch.flush()])
