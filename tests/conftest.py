"""Session fixtures shared by the whole suite: the converted SmolLM2 directory and tiny models.

``MMSERVE_CACHE`` defaults to ``~/.cache/mmserve`` and is exported, so every test (and every
subprocess a test starts) reuses one cache: the GGUF conversion happens at most once per machine.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="session")
def smollm2_tools_client(smollm2_dir: Path) -> Iterator[Any]:
    """An ``openai.OpenAI`` client of ``/v1`` served by SmolLM2 with mmserve's ChatML template
    with tools (function calling and structured outputs)."""
    import asyncio

    import openai

    from gateway.app import create_app
    from modalities.llm.plugin import build, router
    from modalities.llm.tools import CHATML_TOOLS
    from tests.helpers import serve_app

    built = build(
        argparse.Namespace(llm=str(smollm2_dir), served_model_name="smollm2", chat_template=str(CHATML_TOOLS))
    )
    app = create_app(built.engines, routers=[router])
    with serve_app(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    for engine in built.engines.values():
        asyncio.run(engine.shutdown())
