"""The Piper voice cut at its flow and its decoder (``modalities.tts.piper_voice``) against Piper's
own synthesis with the uncut graph, on the packaged voice: streamed in chunks it equals the whole
to float rounding, decoded whole it is bit for bit the same, a first chunk through the flow on its
first frames alone is bit for bit what the whole flow gives, and graphs it can't cut run with
fewer cuts."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from modalities.tts import piper_voice
from modalities.tts.piper_engine import OUTPUT_GAIN, default_voice_path
from modalities.tts.piper_voice import FLOW_CONTEXT, PiperVoiceModel, cut_voice

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
    model = _model(default_voice_path())
    audio, tokens = model.whole(TEXT, 1.0)
    assert np.array_equal(audio, reference) and tokens == sum(map(len, model._phoneme_ids(TEXT))) > len(TEXT)


def test_a_first_chunk_through_the_flow_on_its_first_frames_is_bit_for_bit_the_whole_flows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model(default_voice_path())
    assert model.flow is not None
    head = model.latents("The train to the airport leaves every fifteen minutes.", 1.0, first=True)[0]
    frames = head.shape[2]
    assert frames >= 2 * (24 + 12 + FLOW_CONTEXT)  # long enough for the flow to run on a part
    assert head._z is None  # a first audio's flow runs at its decode
    whole = piper_voice.Latent(head.prior)
    z = whole.upto(frames, model._run_flow)
    assert z.shape[2] == frames
    chunk = model.decode(head, 0, 24)  # the flow runs on its first 24 + 12 + FLOW_CONTEXT frames
    assert head._z is not None and head._z.shape[2] == 24 + 12 + FLOW_CONTEXT
    assert np.array_equal(chunk, model.decode(whole, 0, 24))
    assert np.array_equal(model.decode(head, 24, 60), model.decode(whole, 24, 60))  # now over all frames
    assert head._z.shape[2] == frames
    # Everything else runs the flow over all frames, once: the fronts of later audio at once, a
    # first piece's later sentences and short first sentences at their first decode.
    assert all(lat._final == lat.shape[2] for lat in model.latents(TEXT, 1.0))
    later = model.latents(TEXT, 1.0, first=True)[1]
    model.decode(later, 0, 8)
    short = model.latents("Hello there.", 1.0, first=True)[0]  # a part would be over half of it
    model.decode(short, 0, 24)
    for lat in (later, short):
        assert lat._z is not None and lat._z.shape[2] == lat.shape[2]
    # The flow's reach is real: with less context its first frames differ.
    monkeypatch.setattr(piper_voice, "FLOW_CONTEXT", 8)
    less = piper_voice.Latent(head.prior, partial=True)
    assert np.abs(less.upto(36, model._run_flow)[:, :, :36] - z[:, :, :36]).max() > 1e-3


def test_the_flow_runs_on_the_decoding_workers_session() -> None:
    """A sentence fronted on one session (say the wide one of a live turn's first chunk) and
    decoded on another runs its flow on the decoder's: each worker keeps to its own cores."""
    fronting, decoding = _model(default_voice_path()), _model(default_voice_path())
    calls: list[str] = []
    for name, model in (("fronting", fronting), ("decoding", decoding)):
        run = model._run_flow
        model._run_flow = lambda prior, name=name, run=run: calls.append(name) or run(prior)  # type: ignore[method-assign]
    latent = fronting.latents(TEXT, 1.0, first=True)[0]
    decoding.decode(latent, 0, 24)
    assert calls == ["decoding"]


def test_the_flow_cut_skips_constants_inside_the_flow() -> None:
    """The flow's input is the first tensor it reads from outside itself, whatever node comes
    first; no decoder-side mask, no cut."""
    from onnx import helper

    nodes = [
        helper.make_node("Constant", [], ["c"], name="/flow/flows.7/Constant", value_float=1.0),
        helper.make_node("Mul", ["z_p", "c"], ["f"], name="/flow/flows.6/Mul"),
        helper.make_node("Mul", ["f", "mask"], ["z"], name="/Mul_7"),
        helper.make_node("Cast", ["lengths"], ["mask"], name="/Cast_2", to=1),
    ]
    graph = helper.make_graph(nodes, "g", [], [])
    assert piper_voice._flow_cut(graph, "z") == ("z_p", "mask")
    assert piper_voice._flow_cut(graph, "f") is None  # made by the flow itself: not the decoder's input


def _renamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rename: Callable[[str], str]) -> Path:
    """A copy of the packaged voice with its nodes renamed (and an empty cache)."""
    import onnx

    monkeypatch.setenv("MMSERVE_CACHE", str(tmp_path / "cache"))
    src = default_voice_path()
    model = onnx.load(str(src))
    for node in model.graph.node:
        node.name = rename(node.name)
    path = tmp_path / "voice.onnx"
    onnx.save(model, str(path))
    shutil.copy(f"{src}.json", f"{path}.json")
    return path


def test_a_graph_without_the_flow_names_runs_its_flow_in_the_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: np.ndarray
) -> None:
    path = _renamed(tmp_path, monkeypatch, lambda name: name.replace("/flow/", "/other/"))
    assert (cut_voice(path) / "decoder.onnx").exists() and not (cut_voice(path) / "flow.onnx").exists()
    voice = _model(path)
    assert voice.cut and voice.flow is None
    assert np.array_equal(voice.whole(TEXT, 1.0)[0], reference)
    fresh = _model(path)  # its noise starts from the seed again
    assert np.abs(fresh.decode(fresh.latents(TEXT, 1.0)[0], 0, 24) - reference[: 24 * 256]).max() < 1e-5


def test_a_graph_without_the_decoder_node_runs_uncut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _renamed(tmp_path, monkeypatch, lambda name: "renamed" if name == "/dec/conv_pre/Conv" else name)
    assert not (cut_voice(path) / "decoder.onnx").exists()
    voice = _model(path)
    assert not voice.cut
    assert np.array_equal(voice.whole("Hello there.", 1.0)[0], _reference(path, "Hello there."))
