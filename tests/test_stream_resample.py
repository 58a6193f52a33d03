"""The streaming resampler: any chunking gives the whole signal's output, it holds back only
its filter's half-width, tones in the passband keep their level and tones past the lower
rate's Nyquist frequency do not alias; odd rates fall back to soxr's stream."""

from __future__ import annotations

import numpy as np
import pytest

from modalities.stream_resample import Resampler

PAIRS = [(22050, 24000), (22050, 8000), (24000, 16000), (8000, 16000), (24000, 8000)]


def _all(r: Resampler, x: np.ndarray, sizes: list[int]) -> np.ndarray:
    out, i = [], 0
    for k in sizes:
        out.append(r(x[i : i + k]))
        i += k
    return np.concatenate([*out, r(x[i:]), r.flush()])


@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_any_chunking_equals_the_whole_and_holds_back_only_the_filter(src: int, dst: int) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(src) * 0.1).astype(np.float32)
    whole = _all(Resampler(src, dst), x, [])
    assert len(whole) == dst
    for _ in range(3):
        sizes = [int(k) for k in rng.integers(0, 700, 40)]
        np.testing.assert_array_equal(_all(Resampler(src, dst), x, sizes), whole)
    r, got, lags = Resampler(src, dst), 0, []
    for i in range(0, src, src // 50):  # 20 ms chunks
        got += len(r(x[i : i + src // 50]))
        lags.append((i + src // 50) * dst / src - got)
    assert max(lags) / dst < 0.006  # soxr's HQ stream held back up to 78 ms here (8 kHz)


@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_passband_is_flat_and_the_stopband_does_not_alias(src: int, dst: int) -> None:
    nyquist = min(src, dst) / 2
    t = np.arange(src) / src

    def gain_db(freq: float) -> float:
        r = Resampler(src, dst)
        y = _all(r, np.sin(2 * np.pi * freq * t).astype(np.float32), [])[dst // 8 : -dst // 8]
        return 20 * np.log10(np.sqrt(2 * np.mean(y.astype(np.float64) ** 2)) + 1e-12)

    for f in (0.1, 0.5, 0.85):
        assert abs(gain_db(f * nyquist)) < 0.01
    if dst < src:  # what lies above the output's Nyquist frequency must be gone
        for f in (1.02, 1.2):
            assert gain_db(f * nyquist) < -75


def test_identity_and_odd_rates() -> None:
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    same = Resampler(16000, 16000)
    assert same(x) is not None and np.array_equal(same(x), x) and same.flush().size == 0
    odd = Resampler(22050, 44101)  # 44101 phases: soxr's stream
    y = _all(odd, np.zeros(22050, np.float32), [5000, 5000])
    assert abs(len(y) - 44101) <= 2 and not np.any(y)
