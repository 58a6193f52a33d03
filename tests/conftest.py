"""Session fixtures shared by the whole suite: the converted SmolLM2 directory and tiny models.

``MMSERVE_CACHE`` defaults to ``~/.cache/mmserve`` and is exported, so every test (and every
subprocess a test starts) reuses one cache: the GGUF conversion happens at most once per machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("MMSERVE_CACHE", str(Path.home() / ".cache" / "mmserve"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default LLM converted from GGUF to a safetensors HF directory (cached)."""
    from engine.model_loader import DEFAULT_LLM, resolve_model_path

    return resolve_model_path(DEFAULT_LLM)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Callable[..., Path]:
    """``tiny_model_dir(arch, seed=0) -> Path``: a cached tiny random model of ``arch``."""
    from engine.tiny_models import tiny_model_dir as make

    return make
