"""``LogMel`` (the encoder's features, without transforming a short window's zero padding) gives
the same bits as transformers' ``WhisperFeatureExtractor`` on the padded 30 s window."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from modalities.asr.features import LogMel

RATE = 16_000


def _reference(fe: WhisperFeatureExtractor, audios: list[np.ndarray]) -> torch.Tensor:
    return fe(audios, sampling_rate=RATE, return_tensors="pt").input_features


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_equals_the_extractor_bit_for_bit(n_mels: int) -> None:
    fe = WhisperFeatureExtractor(feature_size=n_mels)
    log_mel = LogMel(fe)
    rng = np.random.default_rng(n_mels)
    # From a tenth of a second to past 30 s (cut to 30 s by both), speech-like levels and a tone.
    lengths = [1_600, 16_000, 32_123, 160_000, 479_000, 480_000, 500_000, *rng.integers(1_000, 480_000, 8)]
    for n in lengths:
        clip = (rng.standard_normal(int(n)) * rng.uniform(0.005, 0.5)).astype(np.float32)
        got, want = log_mel([clip]), _reference(fe, [clip])
        assert got.dtype == want.dtype and torch.equal(got, want), n
    tone = (0.3 * np.sin(np.arange(40_000) * 0.05)).astype(np.float32)
    assert torch.equal(log_mel([tone]), _reference(fe, [tone]))
    silence = np.zeros(8_000, np.float32)
    assert torch.equal(log_mel([silence]), _reference(fe, [silence]))
    # A batch of different lengths: each window's own max sets its clamp.
    batch = [(rng.standard_normal(n) * s).astype(np.float32) for n, s in ((4_000, 0.01), (90_000, 0.4), (20_000, 0.1))]
    assert torch.equal(log_mel(batch), _reference(fe, batch))


def test_a_dithering_extractor_is_called_itself() -> None:
    fe = WhisperFeatureExtractor(dither=1e-4)
    clip = np.zeros(16_000, np.float32)
    torch.manual_seed(0)
    got = LogMel(fe)([clip])
    torch.manual_seed(0)
    assert torch.equal(got, _reference(fe, [clip]))
