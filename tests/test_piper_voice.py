"""The Piper voice cut at its decoder (``modalities.tts.piper_voice``) against Piper's own
synthesis with the uncut graph, on the packaged voice: streamed in chunks it equals the whole to
float rounding, decoded whole it is bit for bit the same, and a graph it can't cut runs uncut."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from modalities.tts.piper_engine import OUTPUT_GAIN, default_voice_path
from modalities.tts.piper_voice import PiperVoiceModel, cut_voice

TEXT = "Hello there, how are you? I hope the weather is fine."  # two sentences for the phonemiser


def _config(path: Path) -> dict:
    return json.loads(Path(f"{path}.json").read_text())


def _reference(path: Path, text: str) -> np.ndarray:
    """Piper's own synthesis with the uncut graph (seed 0), as the engine configured it before."""
    import onnxruntime as ort
    from piper import PiperConfig, PiperVoice, SynthesisConfig

    ort.set_seed(0)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    voice = PiperVoice(config=PiperConfig.from_dict(_config(path)), session=session)
    cfg = SynthesisConfig(length_scale=1.0, normalize_audio=False, volume=OUTPUT_GAIN)
    return np.concatenate([c.audio_float_array for c in voice.synthesize(text, syn_config=cfg)])


def _model(path: Path) -> PiperVoiceModel:
    return PiperVoiceModel(path, _config(path), threads=1, gain=OUTPUT_GAIN, seed=0)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return _reference(default_voice_path(), TEXT)


def test_a_piece_decoded_in_stretches_equals_the_uncut_voice(reference: np.ndarray) -> None:
    model = _model(default_voice_path())
    assert model.cut
    latents = model.latents(TEXT, 1.0)
    assert len(latents) == 2  # one per sentence
    first = latents[0].shape[2]
    stretches = [(0, 24), (24, 40), (40, 90), (90, first)]  # as a request's segments would be
    parts = [model.decode(latents[0], a, b) for a, b in stretches] + [model.decode(latents[1], 0, latents[1].shape[2])]
    assert [p.size for p in parts[:4]] == [(b - a) * 256 for a, b in stretches]
    audio = np.concatenate(parts)
    assert audio.shape == reference.shape and audio.dtype == np.float32
    assert np.abs(audio - reference).max() < 1e-5
    assert np.abs(reference).max() > 0.1  # real speech, not silence


def test_a_text_spoken_whole_is_bit_for_bit_the_uncut_voice(reference: np.ndarray) -> None:
    assert np.array_equal(_model(default_voice_path()).whole(TEXT, 1.0), reference)


def test_a_graph_without_the_decoder_node_runs_uncut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnx

    monkeypatch.setenv("MMSERVE_CACHE", str(tmp_path / "cache"))
    src = default_voice_path()
    model = onnx.load(str(src))
    for node in model.graph.node:
        if node.name == "/dec/conv_pre/Conv":
            node.name = "renamed"
    path = tmp_path / "voice.onnx"
    onnx.save(model, str(path))
    shutil.copy(f"{src}.json", f"{path}.json")
    assert not (cut_voice(path) / "decoder.onnx").exists()
    voice = _model(path)
    assert not voice.cut
    assert np.array_equal(voice.whole("Hello there.", 1.0), _reference(path, "Hello there."))
