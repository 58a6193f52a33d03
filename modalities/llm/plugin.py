"""LLM modality plugin: ``--llm`` models on the shared autoregressive engine."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from engine.config import DEFAULT_MAX_WAITING
from gateway.argtypes import at_least, count_or_unbounded, positive
from gateway.plugins import Built
from modalities.llm.api import router

__all__ = ["WORKER_OPTIONS", "add_serve_args", "build", "router"]

logger = logging.getLogger("mmserve.llm")


WORKER_OPTIONS = (  # (see gateway.plugins; the gateway reads --max-model-len and --block-size itself)
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_waiting",
    "kv_cache_gb",
    "dtype",
    "device",
    "quantization",
    "scheduling_policy",
    "foreground_wait_ms",
)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("llm")
    g.add_argument("--llm", default="smollm2", help="'smollm2', a .gguf file or a local HF directory")
    g.add_argument("--served-model-name", default=None)
    g.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file that replaces the model's own (e.g. one that renders tools in "
        "the Hermes <tool_call> format, which function calling needs)",
    )
    g.add_argument("--max-num-seqs", type=at_least(int, 1), default=None)
    g.add_argument(
        "--max-num-batched-tokens",
        type=at_least(int, 1),
        default=None,
        help="tokens per engine step, prefill chunks and decodes together (default 256 on CPU, where a step of "
        "2048 prefill tokens stalls every stream and abort for seconds; 2048 on GPU)",
    )
    g.add_argument(
        "--max-waiting",
        type=count_or_unbounded,
        default=DEFAULT_MAX_WAITING,
        help="requests waiting for a place in the running batch past which new ones get 429 with "
        f"Retry-After: every request, live voice turns', pipeline stages' and batch lines' too "
        f"(default {DEFAULT_MAX_WAITING}; 0: no bound)",
    )
    g.add_argument("--kv-cache-gb", type=positive, default=None)
    g.add_argument("--block-size", type=at_least(int, 1), default=None)
    g.add_argument("--max-model-len", type=at_least(int, 1), default=None)
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None)
    g.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "gguf", "int8", "none"],
        help="auto (default): a .gguf model's own Q4_1/Q8_0 blocks for decode steps on CPU, where that "
        "applies; none: the dequantized fp32 weights only (what transformers computes)",
    )
    g.add_argument(
        "--scheduling-policy",
        default=None,
        choices=["fcfs", "priority"],
        help="fcfs (default): requests are admitted in arrival order; priority: a lower `priority` (a "
        "request field, as vLLM's) is admitted first and preempted last, live voice turns ask for -1",
    )
    g.add_argument(
        "--foreground-wait-ms",
        type=float,
        default=None,
        help="on CPU, an LLM step waits up to this long while a TTS first piece is synthesised in this "
        "process, so a reply's first audio does not share the cores (default 250 on CPU, 0 on GPU; 0: off)",
    )


def engine_config(args: Any, model: str) -> Any:
    """An ``EngineConfig`` for ``model`` from the engine options in ``args`` (unset ones default)."""
    from engine.config import EngineConfig
    from engine.foreground import default_wait_s

    kwargs: dict[str, Any] = {"model": model}
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "max_model_len",
        "dtype",
        "device",
        "scheduling_policy",
    ):
        value = getattr(args, name, None)
        if value is not None:
            kwargs[name] = value
    if hasattr(args, "max_waiting"):
        kwargs["max_waiting"] = args.max_waiting or sys.maxsize  # (``count_or_unbounded``: None is no bound)
    quant = getattr(args, "quantization", None)
    if quant is not None:
        kwargs["quantization"] = None if quant == "none" else quant
    wait_ms = getattr(args, "foreground_wait_ms", None)
    if wait_ms is None:
        wait_ms = default_wait_s(str(kwargs.get("device", "cpu"))) * 1000.0
    kwargs["foreground_wait_s"] = float(wait_ms) / 1000.0
    kv_gb = getattr(args, "kv_cache_gb", None)
    if kv_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(float(kv_gb) * (1 << 30))
    return EngineConfig(**kwargs)


def build(args: Any, explicit: bool = False) -> Built:
    """One ``AsyncEngine`` per ``--llm`` model, served as ``--served-model-name`` or its own name."""
    from engine import token_bound
    from engine.async_engine import AsyncEngine
    from modalities.llm.chat import override_template

    llm = getattr(args, "llm", None)
    models = [llm] if isinstance(llm, str) else list(llm or [])
    served = getattr(args, "served_model_name", None)
    served_names = [served] if isinstance(served, str) else list(served or [])
    built = Built()
    for i, model in enumerate(models):
        engine = AsyncEngine.from_config(engine_config(args, model))
        override_template(engine.tokenizer, getattr(args, "chat_template", None))
        token_bound.prepare(engine.tokenizer)  # not on the first long prompt's path
        name = served_names[i] if i < len(served_names) else engine.model_name
        built.engines[name] = engine
        for alias in (model, engine.model_name):  # also answer to the --llm spec and the model's own name
            if alias != name:
                built.aliases.setdefault(alias, name)
        logger.info("serving %s as %r (max_model_len %d)", model, name, engine.max_model_len)
    return built
