"""The CTranslate2 → transformers Whisper converter and the long-form helpers (pure logic).

The converter is checked on the packaged tiny.en: every CT2 variable is read (fp16 → fp32 exact),
the fused projections come back split in the right order, and split ``model.bin.partN`` files give
the same model as the whole file. Window planning and overlap stitching are unit-tested."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from modalities.asr.convert import convert_whisper_ct2, read_ct2_model
from modalities.asr.longform import Window, plan_windows, stitched_texts
from modalities.asr.model import _packaged_sources, load_whisper


@pytest.fixture(scope="module")
def ct2() -> tuple[Path, dict[str, np.ndarray]]:
    src, _ = _packaged_sources("tiny.en")
    spec, variables = read_ct2_model(src / "model.bin")
    assert spec == "WhisperSpec"
    return src, variables


def test_converted_weights_are_the_ct2_weights(ct2: tuple[Path, dict[str, np.ndarray]]) -> None:
    _, v = ct2
    model = load_whisper("tiny.en").model
    sd = model.state_dict()
    d = model.config.d_model
    fused = v["decoder/layer_1/self_attention/linear_0/weight"].astype(np.float32)
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        assert np.array_equal(sd[f"model.decoder.layers.1.self_attn.{name}.weight"].numpy(), fused[i * d : (i + 1) * d])
    kv = v["decoder/layer_3/attention/linear_1/weight"].astype(np.float32)
    assert np.array_equal(sd["model.decoder.layers.3.encoder_attn.v_proj.weight"].numpy(), kv[d:])
    assert np.array_equal(sd["model.encoder.conv1.weight"].numpy(), v["encoder/conv1/weight"].astype(np.float32))
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()  # tied
    gen = model.generation_config
    assert gen.no_timestamps_token_id == 50362 and gen.begin_suppress_tokens == [220, 50256]
    assert model.config.vocab_size == 51864 and not gen.is_multilingual


def test_split_parts_convert_like_the_whole_file(ct2: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    src, _ = ct2
    data = (src / "model.bin").read_bytes()
    parts = tmp_path / "parts"
    parts.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (parts / name).write_bytes((src / name).read_bytes())
    (parts / "model.bin.part1").write_bytes(data[: len(data) // 3])
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "model.bin.part2").write_bytes(data[len(data) // 3 :])  # as in a second package
    out = convert_whisper_ct2(parts, tmp_path / "out", [other / "model.bin.part2"])
    from transformers import WhisperForConditionalGeneration

    a = WhisperForConditionalGeneration.from_pretrained(out).state_dict()
    b = load_whisper("tiny.en").model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "out" / "model.bin.joined").exists()


def test_plan_windows_packs_and_splits() -> None:
    audio = np.zeros(16_000 * 120, np.float32)
    spans = [(1.0, 5.0), (6.0, 20.0), (22.0, 33.0), (40.0, 110.0)]
    windows = plan_windows(audio, spans, max_s=30.0, overlap_s=2.0)
    assert windows[0] == Window(1.0, 20.0) and windows[1] == Window(22.0, 33.0)
    long = windows[2:]
    assert long[0].start == 40.0 and long[-1].end == 110.0 and all(w.overlaps_prev for w in long[1:])
    assert all(w.duration <= 30.0 for w in windows)
    for a, b in zip(long, long[1:], strict=False):
        assert b.start == pytest.approx(a.end - 2.0)


def test_stitch_removes_the_overlap_once() -> None:
    def stitch(prev: str, nxt: str) -> list[str]:  # two windows, the second starting inside the first
        return stitched_texts([Window(0.0, 30.0), Window(28.0, 40.0, overlaps_prev=True)], [prev, nxt])

    prev = "the children played in the park until it got da"
    nxt = "until it got dark. Can you tell me"
    assert stitch(prev, nxt) == ["the children played in the park", "until it got dark. Can you tell me"]
    assert stitch("hello there", "general kenobi") == ["hello there", "general kenobi"]  # nothing shared
    assert stitch("", "words") == ["", "words"]
    # A phrase said twice is no overlap: 2 s hold about 5 words, and this match ("and then") spans
    # 12 with what the windows say around it (two renderings of one number, then "Before noon ...",
    # said after the cut): cutting there would lose "please call me at 555-1234. Before noon on
    # Tuesday" (tiny.en's windows of a 75 s recording with no pause, from a black-box sweep).
    prev = "The company shipped 3,200 units to Paris and then please call me at 555-1234."
    nxt = "5-5-1234. Before noon on Tuesday, and then she and learning models can transcribe speech"
    assert stitch(prev, nxt) == [prev, nxt]
