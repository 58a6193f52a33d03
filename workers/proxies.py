"""Proxies the gateway serves under ``--dispatch celery``: the same types and interface as the
local engines, so the modality routes do not change.

- ``RemoteLLMEngine`` is an ``AsyncEngine``: ``generate`` streams ``RequestOutput`` from a worker
  (routed by prefix affinity), ``abort`` and early exit abort it there; the tokenizer and context
  length are loaded locally from the same model path (no weights).
- ``RemoteEmbeddingEngine`` is an ``EmbeddingEngine``: validation and tokenization run here,
  ``embed_ids`` on the least-loaded worker.
- Any other modality is proxied when its plugin defines ``remote_engines(args, cluster) -> Built``,
  typically ``RemoteEngine(cluster, served_name, modality)`` per engine (``run``/``stream`` and any
  other method forwarded); its routes must accept that proxy where they check engine types.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from engine.async_engine import AsyncEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from gateway.plugins import Built
from modalities.embed.engine import EmbeddingEngine
from workers.remote import Cluster
from workers.routing import prefix_key
from workers.wire import END, ITEM, START

logger = logging.getLogger("mmserve.dispatch")


class RemoteLLMEngine(AsyncEngine):
    """An ``AsyncEngine`` whose requests run on LLM workers (see module docstring)."""

    def __init__(self, cluster: Cluster, name: str, tokenizer: Any, max_model_len: int, block_size: int = 16) -> None:
        # No local engine: AsyncEngine's state (command queue, thread) is deliberately not set up.
        self.cluster, self._name, self._tokenizer = cluster, name, tokenizer
        self._max_model_len, self.block_size = max_model_len, block_size
        self._workers: dict[str, str] = {}  # request id -> worker running it

    @classmethod
    def from_args(cls, cluster: Cluster, args: Any, spec: str, served: str | None) -> RemoteLLMEngine:
        from transformers import AutoConfig, AutoTokenizer

        from engine.model_loader import resolve_model_path, served_name
        from modalities.llm.chat import override_template

        path = resolve_model_path(spec)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        override_template(tokenizer, getattr(args, "chat_template", None))  # the gateway renders prompts
        if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        context = int(getattr(text, "max_position_embeddings", None) or 2048)
        limit = getattr(args, "max_model_len", None)
        context = min(context, limit) if limit else context
        block = getattr(args, "block_size", None) or 16
        return cls(cluster, served or served_name(path), tokenizer, context, block)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def is_running(self) -> bool:
        return self.cluster.redis_ok and bool(self.cluster.live(self._name))

    def stats(self) -> dict[str, float]:
        return self.cluster.model_stats(self._name)

    async def start(self) -> None:
        await self.cluster.start()

    async def shutdown(self) -> None:
        await self.cluster.shutdown()

    async def generate(
        self, request_id: str | None, prompt: Any, params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs from a worker; leaving early aborts it there."""
        ids = prompt if isinstance(prompt, list) else getattr(prompt, "token_ids", None)
        if ids is None and isinstance(prompt, str):
            ids = self._tokenizer.encode(prompt)
        key = prefix_key(ids or [], self.block_size)
        replies = self.cluster.call(
            self._name, "generate", (request_id, prompt, params), {"priority": priority}, key=key
        )
        rebuild = _Cumulative()
        try:
            async for kind, value in replies:
                if kind == ITEM:
                    yield rebuild(value)
                elif kind == START and request_id is not None:
                    self._workers[request_id] = value
                elif kind == END:
                    return
        finally:
            if request_id is not None:
                self._workers.pop(request_id, None)
            await replies.aclose()  # leaving early aborts the call on its worker

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` on its worker; its stream then ends with ``finish_reason="abort"``."""
        worker = self._workers.get(request_id)
        if worker is not None:
            async for _ in self.cluster.call(self._name, "abort", (request_id,), pin=worker):
                pass


class _Cumulative:
    """Restores the cumulative fields ``workers.wire.slim`` left out of streamed outputs."""

    def __init__(self) -> None:
        self.prompt: list[int] = []
        self.text: dict[int, str] = {}
        self.ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[Any]] = {}

    def __call__(self, out: RequestOutput) -> RequestOutput:
        if out.prompt_token_ids:
            self.prompt = out.prompt_token_ids
        else:
            out.prompt_token_ids = self.prompt
        if out.finished:  # sent whole
            return out
        for co in out.outputs:
            i = co.index
            self.text[i] = co.text = self.text.get(i, "") + co.delta_text
            self.ids[i] = self.ids.get(i, []) + co.delta_token_ids
            co.token_ids = self.ids[i]
            if co.logprobs is not None:
                self.logprobs[i] = co.logprobs = self.logprobs.get(i, []) + (co.delta_logprobs or [])
        return out


class RemoteEmbeddingEngine(EmbeddingEngine):
    """An ``EmbeddingEngine`` that tokenizes and validates here and embeds on workers."""

    def __init__(self, cluster: Cluster, model: Any, served_name: str | None = None) -> None:
        super().__init__(model, served_name=served_name)
        self.cluster = cluster

    async def start(self) -> None:
        await self.cluster.start()

    async def shutdown(self) -> None:
        await self.cluster.shutdown()

    def stats(self) -> dict[str, float]:
        return self.cluster.model_stats(self.model_name)

    async def embed_ids(self, ids: list[list[int]]) -> Any:
        result = None
        async for kind, value in self.cluster.call(self.model_name, "embed_ids", (ids,)):
            if kind == END:
                result = value
        return result


def build_remote(args: Any) -> tuple[Built, Cluster]:
    """Proxies for the modalities ``args`` enables (``--only``), on one ``Cluster``."""
    from gateway.plugins import enabled, only_of

    url = getattr(args, "redis_url", None) or os.environ.get("MMSERVE_REDIS_URL", "redis://127.0.0.1:6379/0")
    cluster = Cluster(url, prefix=getattr(args, "prefix", None) or "mmserve")
    only = only_of(args)
    built = Built()
    if enabled("llm", only):
        llm = getattr(args, "llm", None)
        served = getattr(args, "served_model_name", None)
        models = [llm] if isinstance(llm, str) else list(llm or [])
        names = [served] if isinstance(served, str) else list(served or [])
        for i, spec in enumerate(models):
            engine = RemoteLLMEngine.from_args(cluster, args, spec, names[i] if i < len(names) else None)
            built.engines[engine.model_name] = engine
            if spec != engine.model_name:
                built.aliases.setdefault(spec, engine.model_name)
    if enabled("embed", only):
        from modalities.embed.model import DEFAULT_EMBED, EmbeddingModel

        spec = getattr(args, "embed", None)
        try:
            model = EmbeddingModel(spec)
        except FileNotFoundError:
            if spec is not None or "embed" in only:
                raise
            model = None
        if model is not None:
            engine = RemoteEmbeddingEngine(cluster, model)
            built.engines[engine.model_name] = engine
            for alias in (spec, DEFAULT_EMBED if spec is None else None, f"sentence-transformers/{engine.model_name}"):
                if alias and alias != engine.model_name:
                    built.aliases.setdefault(alias, engine.model_name)
    from gateway.plugins import MODALITIES, load_plugins

    plugins = load_plugins()
    for name in MODALITIES:
        if name in ("llm", "embed") or not enabled(name, only) or name not in plugins:
            continue
        hook = getattr(plugins[name], "remote_engines", None)
        if hook is not None:  # ``remote_engines(args, cluster) -> Built`` (e.g. ``RemoteEngine``s)
            extra: Built = hook(args, cluster)
            built.engines.update(extra.engines)
            for alias, served in extra.aliases.items():
                built.aliases.setdefault(alias, served)
        elif name in only:
            logger.warning("--dispatch celery: the %s plugin has no remote_engines hook; not served", name)
    from gateway.plugins import worker_options_given

    if given := worker_options_given(args):
        logger.warning(
            "--dispatch celery: %s apply where the engines run (give them to `mmserve worker`); this "
            "gateway ignores them",
            ", ".join(given),
        )
    logger.info("celery dispatch on %s (prefix %s): %s", url, cluster.prefix, ", ".join(built.engines))
    return built, cluster
