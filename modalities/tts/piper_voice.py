"""A Piper voice cut in three for streaming within a piece of text.

Piper's ONNX graph maps a sentence's phoneme ids to its audio in one run; about two thirds of
that run is the HiFi-GAN decoder, whose cost grows with the audio's length, and most of the rest
is the flow, which also runs over every frame. Cut at the flow's and the decoder's inputs, the
graph becomes three, made once under ``$MMSERVE_CACHE/piper``: ``front`` (phoneme ids → the
prior's latent frames, with the voice's noise), ``flow`` (prior → latent frames) and ``decoder``
(latent frames → audio, 256 samples a frame). Then a piece's first fraction of a second of audio
needs only its first frames through the flow and the decoder. Both are convolutional: the flow
run on a piece's first frames plus ``FLOW_CONTEXT`` equals the whole flow's on them bit for bit,
and frames decoded with ``CONTEXT_FRAMES`` of latent on each side equal the whole decode's to
float rounding (at most 2e-6 apart on the packaged voice; 8 frames of context left 1e-3). Run
over all frames, the three equal the uncut graph bit for bit. A graph with no separable flow runs
its prior and flow as one ``front``; one with no ``dec.conv_pre`` node (not a VITS export of
Piper's) runs uncut, one chunk a piece.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.cachedir import build_once
from engine.model_loader import cache_root
from modalities.tts.phonemizer import Phonemizer

CONTEXT_FRAMES = 12  # latent frames decoded on each side of a chunk (the decoder's reach, measured)
# The flow's reach: 4 couplings of 4 width-5 convolutions, 2 frames each side a convolution
# (measured: 24 frames left 2e-5, 32 none).
FLOW_CONTEXT = 32
_DECODER_START = "/dec/conv_pre/Conv"  # the decoder's first node in Piper's exports
_FLOW = "/flow/"  # the flow's node names in Piper's exports
_CUT_VERSION = 2  # of the cache layout (1: front and decoder only)


def cut_voice(path: Path) -> Path:
    """The cache directory of ``path``'s graphs (``front.onnx``, ``flow.onnx``, ``decoder.onnx``),
    made once; it holds no flow where the flow can't be cut off, and nothing where the decoder can't.
    ``ValueError`` for a file that is no ONNX model (nothing is cached for it)."""
    st = path.stat()
    ident = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{_CUT_VERSION}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:12]
    return build_once(cache_root() / "piper" / f"{path.stem}-{key}", "done", lambda tmp: _cut(path, tmp))


def _cut(path: Path, out: Path) -> None:
    import onnx
    from google.protobuf.message import DecodeError
    from onnx.utils import Extractor

    try:
        model = onnx.load(str(path))
    except DecodeError as exc:
        raise ValueError(f"{path} is not an ONNX model ({exc})") from None
    graph = model.graph
    if not graph.node:  # (an empty file parses as an empty model)
        raise ValueError(f"{path} holds no ONNX graph")
    start = next((n for n in graph.node if n.name == _DECODER_START), None)
    if start is not None:
        inputs = [i.name for i in graph.input]
        speaker = [name for name in inputs if name == "sid"]  # a multi-speaker flow and decoder use it
        latent = start.input[0]
        extractor = Extractor(model)
        flow = _flow_cut(graph, latent)
        if flow is not None:
            prior, mask = flow
            try:
                sub = extractor.extract_model([prior, mask, *speaker], [latent])
            except Exception:  # noqa: BLE001 - an odd graph keeps its flow in the front
                sub = None
            if sub is not None and _closed(sub.graph):
                onnx.save(sub, str(out / "flow.onnx"))
                latent = prior
        onnx.save(extractor.extract_model(inputs, [latent]), str(out / "front.onnx"))
        onnx.save(
            extractor.extract_model([start.input[0], *speaker], [graph.output[0].name]), str(out / "decoder.onnx")
        )
    (out / "done").touch()


def _flow_cut(graph: Any, latent: str) -> tuple[str, str] | None:
    """The flow's input (the prior's frames) and its frame mask, in a graph whose decoder reads
    ``latent`` = flow output x mask; ``None`` when the graph isn't laid out so."""
    producer = {o: n for n in graph.node for o in n.output}
    flow = [n for n in graph.node if n.name.startswith(_FLOW)]
    inside = {o for n in flow for o in n.output}
    fixed = {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    entering = [i for n in flow for i in n.input if i and i not in inside and i not in fixed]
    masking = producer.get(latent)
    if not entering or masking is None or masking.op_type != "Mul":
        return None
    mask = [i for i in masking.input if i in producer and not producer[i].name.startswith(_FLOW)]
    return (entering[0], mask[0]) if len(mask) == 1 else None


def _closed(graph: Any) -> bool:
    """Every tensor the graph's nodes read is made inside it (the cut's inputs reach all)."""
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    for node in graph.node:
        if not set(node.input) <= known:
            return False
        known.update(node.output)
    return True


class Latent:
    """One sentence's latent frames: the prior's (``shape`` [1, C, T]), through the flow on demand.
    ``upto(n, flow)`` gives frames whose first ``n`` are final, running the caller's ``flow``
    where they aren't yet: over all frames, except on the first call of a latent made ``partial``
    (a request's first audio), which runs it on the first ``n + FLOW_CONTEXT`` frames if that is
    at most half of them (a larger part saves little, and its frames would run twice). ``final``:
    the prior needs no flow. ``tokens``: the phoneme ids it was made from. Thread-safe: segments
    of one sentence may be decoded by several workers."""

    def __init__(self, prior: np.ndarray, final: bool = False, partial: bool = False, tokens: int = 0) -> None:
        self.prior = prior
        self.partial = partial
        self.tokens = tokens
        self._z: np.ndarray | None = prior if final else None
        self._final = prior.shape[2] if final else 0  # frames of ``_z`` that are final
        self._lock = threading.Lock()

    @property
    def shape(self) -> tuple[int, ...]:
        return self.prior.shape

    def upto(self, n: int, flow: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        frames = self.prior.shape[2]
        with self._lock:
            if self._z is None or self._final < min(n, frames):
                stop = n + FLOW_CONTEXT if self._z is None and self.partial else frames
                stop = stop if 2 * stop <= frames else frames
                self._z = flow(np.ascontiguousarray(self.prior[:, :, :stop]))
                self._final = frames if stop == frames else n
            return self._z


class PiperVoiceModel:
    """One voice's ONNX sessions and phonemiser (``phonemizer``: shared by an engine's sessions,
    else its own). A cut voice gives a text's ``latents`` and ``decode``s any stretch of them (the
    flow runs as the decodes need it); ``whole`` speaks a text in one go. Audio is float32 in
    [-1, 1], scaled by ``gain``."""

    def __init__(
        self,
        path: Path,
        config: dict[str, Any],
        threads: int,
        gain: float,
        seed: int | None,
        phonemizer: Phonemizer | None = None,
    ) -> None:
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
        self.flow = session(cut / "flow.onnx") if (cut / "flow.onnx").is_file() else None
        self.piper = PiperVoice(config=PiperConfig.from_dict(config), session=self.front)  # phoneme ids
        self.phonemizer = phonemizer or Phonemizer(config)  # eSpeak NG, out of process: it can crash
        self.gain = gain
        self.hop = self.piper.config.hop_length
        self._prior_in = self.front.get_outputs()[0].name  # the flow's, named alike on both sides of the cut
        inputs = [i.name for i in self.flow.get_inputs()] if self.flow is not None else []
        self._mask_in = next((name for name in inputs if name not in (self._prior_in, "sid")), "")
        self._latent_in = self.decoder.get_inputs()[0].name if self.decoder is not None else ""

    @property
    def cut(self) -> bool:
        return self.decoder is not None

    def latents(self, text: str, length_scale: float, first: bool = False) -> list[Latent]:
        """``text``'s latent frames, ``[1, C, T]`` for each sentence the phonemiser finds, through
        the flow; with ``first`` (a request's first audio), not yet: the first sentence's flow may
        then run on its first frames alone (``Latent``), the others' at their first decode."""
        assert self.cut
        final = self.flow is None
        out = [
            Latent(self._front(ids, length_scale), final, first and i == 0, len(ids))
            for i, ids in enumerate(self._phoneme_ids(text))
        ]
        if not first:
            for z in out:
                z.upto(z.shape[2], self._run_flow)
        return out

    def whole(self, text: str, length_scale: float) -> tuple[np.ndarray, int]:
        """``text``'s audio in one go (how an uncut voice speaks), and the phoneme ids it read."""
        if self.cut:
            latents = self.latents(text, length_scale)
            parts, tokens = [self.decode(z, 0, z.shape[2]) for z in latents], sum(z.tokens for z in latents)
        else:
            ids = self._phoneme_ids(text)
            parts, tokens = [self._scale(self._front(x, length_scale).reshape(-1)) for x in ids], sum(map(len, ids))
        return (np.concatenate(parts) if parts else np.zeros(0, np.float32)), tokens

    def decode(self, latent: Latent, start: int, stop: int) -> np.ndarray:
        """Audio of frames ``[start, stop)`` of ``latent``, decoded with ``CONTEXT_FRAMES`` on each side."""
        assert self.decoder is not None
        lo, hi = max(0, start - CONTEXT_FRAMES), min(latent.shape[2], stop + CONTEXT_FRAMES)
        z = latent.upto(hi, self._run_flow)  # this worker's session, not the front's
        feed = self._feed(self.decoder, **{self._latent_in: np.ascontiguousarray(z[:, :, lo:hi])})
        audio = self.decoder.run(None, feed)[0].reshape(-1)
        return self._scale(audio[(start - lo) * self.hop : (stop - lo) * self.hop])

    def _phoneme_ids(self, text: str) -> list[list[int]]:
        return [self.piper.phonemes_to_ids(p) for p in self.phonemizer.phonemize(text) if p]

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

    def _run_flow(self, prior: np.ndarray) -> np.ndarray:
        assert self.flow is not None
        mask = np.ones((1, 1, prior.shape[2]), dtype=np.float32)  # one sentence: every frame counts
        return self.flow.run(None, self._feed(self.flow, **{self._prior_in: prior, self._mask_in: mask}))[0]

    def _scale(self, audio: np.ndarray) -> np.ndarray:
        # Piper's own post-processing with a fixed volume, not its per-sentence peak normalisation:
        # loudness must not jump between pieces (a short first piece would be scaled up to twice
        # the next), and stretches must scale exactly as the whole would.
        return np.clip(audio * self.gain, -1.0, 1.0).astype(np.float32)
