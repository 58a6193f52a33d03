"""A Piper voice cut in two for streaming within a piece of text.

Piper's ONNX graph maps a sentence's phoneme ids to its audio in one run; about two thirds of
that run is the HiFi-GAN decoder, whose cost grows with the audio's length. Cut at the
decoder's input, the graph becomes two (``front``: phoneme ids → latent frames, ``decoder``:
latent frames → audio, 256 samples a frame), made once under ``$MMSERVE_CACHE/piper``. Then a
piece's first fraction of a second of audio needs only its first frames decoded. The decoder is
convolutional: frames decoded with ``CONTEXT_FRAMES`` of latent on each side equal the whole
decode's to float rounding (at most 2e-6 apart on the packaged voice; 8 frames of context left
1e-3), and front → decoder over all frames equals the uncut graph bit for bit. A voice whose
graph has no ``dec.conv_pre`` node (not a VITS export of Piper's) runs uncut, one chunk a piece.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from engine.cachedir import build_once
from engine.model_loader import cache_root

CONTEXT_FRAMES = 12  # latent frames decoded on each side of a chunk (the decoder's reach, measured)
_DECODER_START = "/dec/conv_pre/Conv"  # the decoder's first node in Piper's exports


def cut_voice(path: Path) -> Path:
    """The cache directory of ``path``'s two graphs (``front.onnx``, ``decoder.onnx``), made once;
    it holds neither where the graph can't be cut."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return build_once(cache_root() / "piper" / f"{path.stem}-{key}", "done", lambda tmp: _cut(path, tmp))


def _cut(path: Path, out: Path) -> None:
    import onnx
    from onnx.utils import Extractor

    model = onnx.load(str(path))
    graph = model.graph
    start = next((n for n in graph.node if n.name == _DECODER_START), None)
    if start is not None:
        inputs = [i.name for i in graph.input]
        latent = start.input[0]
        extractor = Extractor(model)
        onnx.save(extractor.extract_model(inputs, [latent]), str(out / "front.onnx"))
        speaker = [name for name in inputs if name == "sid"]  # a multi-speaker decoder is conditioned on it
        onnx.save(extractor.extract_model([latent, *speaker], [graph.output[0].name]), str(out / "decoder.onnx"))
    (out / "done").touch()


class PiperVoiceModel:
    """One voice's ONNX sessions and phonemiser. A cut voice gives a text's ``latents`` and
    ``decode``s any stretch of them; ``whole`` speaks a text in one go. Audio is float32 in
    [-1, 1], scaled by ``gain``."""

    def __init__(self, path: Path, config: dict[str, Any], threads: int, gain: float, seed: int | None) -> None:
        import onnxruntime as ort
        from piper import PiperConfig, PiperVoice

        if seed is not None:
            ort.set_seed(seed)  # read when the session's random kernels are built (process-wide)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle workers free the CPU

        def session(file: Path) -> Any:
            return ort.InferenceSession(str(file), sess_options=opts, providers=["CPUExecutionProvider"])

        cut = cut_voice(path)
        split = (cut / "decoder.onnx").is_file()
        self.front = session(cut / "front.onnx" if split else path)
        self.decoder = session(cut / "decoder.onnx") if split else None
        self.piper = PiperVoice(config=PiperConfig.from_dict(config), session=self.front)  # phonemiser
        self.gain = gain
        self.hop = self.piper.config.hop_length

    @property
    def cut(self) -> bool:
        return self.decoder is not None

    def latents(self, text: str, length_scale: float) -> list[np.ndarray]:
        """``text``'s latent frames, ``[1, C, T]`` for each sentence the phonemiser finds."""
        assert self.cut
        return [self._front(ids, length_scale) for ids in self._phoneme_ids(text)]

    def whole(self, text: str, length_scale: float) -> np.ndarray:
        """``text``'s audio in one go (how an uncut voice speaks)."""
        if self.cut:
            parts = [self.decode(z, 0, z.shape[2]) for z in self.latents(text, length_scale)]
        else:
            parts = [self._scale(self._front(ids, length_scale).reshape(-1)) for ids in self._phoneme_ids(text)]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def decode(self, z: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Audio of frames ``[start, stop)`` of ``z``, decoded with ``CONTEXT_FRAMES`` on each side."""
        assert self.decoder is not None
        lo, hi = max(0, start - CONTEXT_FRAMES), min(z.shape[2], stop + CONTEXT_FRAMES)
        feed = self._feed(self.decoder, **{self.decoder.get_inputs()[0].name: np.ascontiguousarray(z[:, :, lo:hi])})
        audio = self.decoder.run(None, feed)[0].reshape(-1)
        return self._scale(audio[(start - lo) * self.hop : (stop - lo) * self.hop])

    def _phoneme_ids(self, text: str) -> list[list[int]]:
        return [self.piper.phonemes_to_ids(p) for p in self.piper.phonemize(text) if p]

    def _feed(self, session: Any, **values: np.ndarray) -> dict[str, np.ndarray]:
        cfg = self.piper.config
        if cfg.num_speakers > 1:
            values["sid"] = np.array([cfg.default_speaker_id or 0], dtype=np.int64)
        return {i.name: values[i.name] for i in session.get_inputs()}

    def _front(self, ids: list[int], length_scale: float) -> np.ndarray:
        cfg = self.piper.config
        scales = np.array([cfg.noise_scale, length_scale, cfg.noise_w_scale], dtype=np.float32)
        feed = self._feed(
            self.front,
            input=np.array([ids], dtype=np.int64),
            input_lengths=np.array([len(ids)], dtype=np.int64),
            scales=scales,
        )
        return self.front.run(None, feed)[0]

    def _scale(self, audio: np.ndarray) -> np.ndarray:
        # Piper's own post-processing with a fixed volume, not its per-sentence peak normalisation:
        # loudness must not jump between pieces (a short first piece would be scaled up to twice
        # the next), and stretches must scale exactly as the whole would.
        return np.clip(audio * self.gain, -1.0, 1.0).astype(np.float32)
