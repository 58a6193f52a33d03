"""``EmbeddingEngine``: dynamic batching of embedding requests on a background thread.

Every input of every request becomes one item in a pending list kept sorted by token length.
The engine thread repeatedly takes the shortest item of the oldest request and grows a batch
around it through neighbouring lengths, under a padded-token budget (``max_batch_tokens``), a size
cap, and a padding cap (``max_padding``: short inputs are not padded to long ones). Concurrent
HTTP requests are therefore batched together, and a request with thousands of inputs is split
into length buckets. The async front (``await engine.embed(...)``) resolves when all of a
request's rows are filled.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.batch_loop import BatchLoop, resolve
from engine.errors import EngineDeadError, QueueFullError, check_token_ids
from engine.offload import run_sized
from engine.token_bound import head, prepare
from modalities.embed.model import EmbeddingModel

# A text over this many characters per token of the model's limit is tokenized by its head first.
HEAD_CHARS_PER_TOKEN = 32

logger = logging.getLogger("mmserve.embed")


class InputTooLongError(ValueError):
    """An input has more tokens than the model accepts (and truncation was not requested)."""


@dataclass
class EmbedResult:
    """Embeddings [N, dim] (float32, in input order), the number of tokens each input used, and
    the time split: ``queue_s`` (submitted -> its first batch starts) and ``inference_s`` (the rest)."""

    embeddings: np.ndarray
    token_counts: list[int]
    queue_s: float = 0.0
    inference_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return int(sum(self.token_counts))


# Queue seconds of the last local ``embed_ids`` call in this task (unset for remote engines,
# which override ``embed_ids``): lets ``embed`` report its split without changing that signature.
_QUEUE_S: contextvars.ContextVar[float | None] = contextvars.ContextVar("embed_queue_s", default=None)


@dataclass(eq=False)
class _Request:
    seq: int
    out: np.ndarray
    future: asyncio.Future[np.ndarray]
    loop: asyncio.AbstractEventLoop
    remaining: int
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when its first batch began


@dataclass(order=True)
class _Item:
    length: int
    seq: int
    index: int
    ids: list[int] = field(compare=False)
    request: _Request = field(compare=False)


def default_workers(cpu_threads: int | None = None) -> tuple[int, int]:
    """``(num_workers, threads_per_worker)`` for ``cpu_threads`` (default: torch's thread count):
    one model thread using every intra-op thread. Measured on a quiet 2-core machine, 1 x 2
    threads embeds 1.6x faster than 2 x 1 (several workers only paid off while other jobs held
    a core); ``num_workers`` / ``threads_per_worker`` override it."""
    return 1, max(1, cpu_threads or torch.get_num_threads())


class EmbeddingEngine(BatchLoop):
    """Batches ``embed`` calls from any number of coroutines onto ``num_workers`` model threads."""

    _engine_label = "embedding"

    def __init__(
        self,
        model: EmbeddingModel,
        *,
        served_name: str | None = None,
        max_batch_tokens: int = 4096,
        max_batch_size: int = 256,
        max_padding: float = 0.15,
        max_inputs: int = 2048,
        max_pending: int = 65536,
        num_workers: int | None = None,
        threads_per_worker: int | None = None,
    ) -> None:
        self.model = model
        prepare(model.tokenizer)  # the head rule's terms, not on the first long input's path
        self.model_name = served_name or model.name
        self.max_model_len = model.max_len
        self.dim = model.dim
        self.tokenizer = model.tokenizer
        self.max_batch_tokens = max(max_batch_tokens, model.max_len)
        self.max_batch_size = max_batch_size
        self.max_padding = max_padding
        self.max_inputs = max_inputs
        self.max_pending = max_pending
        auto_workers, auto_threads = default_workers()
        self.num_workers = num_workers or auto_workers
        self.threads_per_worker = threads_per_worker or (auto_threads if num_workers is None else 0)
        self._pending: list[_Item] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats = {
            "num_batches": 0,
            "num_inputs": 0,
            "num_tokens": 0,
            "num_padded_tokens": 0,
            "busy_s": 0.0,
            "num_running": 0,  # inputs in the batches running now
        }

    @classmethod
    def from_path(cls, path: str | None = None, **kwargs: Any) -> EmbeddingEngine:
        """Load ``path`` (default: the packaged all-MiniLM-L6-v2) and wrap it in an engine."""
        return cls(EmbeddingModel(path), **kwargs)

    # -- lifecycle -------------------------------------------------------------------------------

    def start_sync(self) -> None:
        """Start the model threads (idempotent)."""
        with self._cond:
            if self._threads and all(t.is_alive() for t in self._threads):
                return
            self._stopping = False
            self._threads = [t for t in self._threads if t.is_alive()]
            for i in range(len(self._threads), self.num_workers):
                thread = threading.Thread(target=self._loop, name=f"embed-worker-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)

    async def start(self) -> None:
        self.start_sync()

    async def shutdown(self) -> None:
        """Stop the thread; requests still pending fail with ``EngineDeadError``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 30)
        self._fail_pending(EngineDeadError("the embedding engine was shut down"))

    def stats(self) -> dict[str, float]:
        with self._cond:
            return {**self._stats, "num_pending": len(self._pending)}

    # -- front -----------------------------------------------------------------------------------

    def prepare(self, inputs: list[str] | list[list[int]], truncate: int | None = None) -> list[list[int]]:
        """Token ids per input, checked against the model's limit. ``truncate`` caps each input at
        ``min(truncate, max_model_len)`` tokens (texts keep their special tokens); without it an
        over-long input raises ``InputTooLongError``."""
        if not inputs:
            raise ValueError("input must not be empty")
        if len(inputs) > self.max_inputs:
            raise ValueError(f"too many inputs: {len(inputs)} > {self.max_inputs} per request")
        limit = self.max_model_len if truncate is None or truncate <= 0 else min(truncate, self.max_model_len)
        if all(isinstance(x, str) for x in inputs):
            if any(not x for x in inputs):
                raise ValueError("input strings must not be empty")
            ids, partial = self._tokenize(list(inputs), limit if truncate is not None else None)  # type: ignore[arg-type]
        else:
            ids, partial = [list(x) for x in inputs], set()  # type: ignore[arg-type]
            if any(not x for x in ids):
                raise ValueError("token id lists must not be empty")
            check_token_ids((t for x in ids for t in x), self.model.vocab_size, "input")
            if truncate is not None:
                ids = [x[:limit] for x in ids]
        for i, x in enumerate(ids):
            if len(x) > self.max_model_len:
                where = f"input[{i}]" if len(ids) > 1 else "the input"
                raise InputTooLongError(
                    f"{where} has {'at least ' if i in partial else ''}{len(x)} tokens, more than this model's "
                    f"maximum of {self.max_model_len} tokens; shorten it or set `truncate: true`"
                )
        return ids

    def _tokenize(self, texts: list[str], max_length: int | None) -> tuple[list[list[int]], set[int]]:
        """``model.tokenize(texts, max_length)``, but a text far longer than the model's limit is
        tokenized by its head first (``engine.token_bound.head``): if the head alone is over the
        limit, its tokens stand for the text's (truncated: the same first tokens; else, enough to
        refuse it: the indices of those are returned too). 28 MiB of text took 54 s of CPU and
        ~5 GB to refuse whole (docs/BENCHMARKS.md)."""
        out: list[list[int] | None] = [None] * len(texts)
        partial: set[int] = set()
        keeps_first = getattr(self.model.tokenizer, "truncation_side", "right") == "right"
        for i, text in enumerate(texts):
            cut = head(self.model.tokenizer, text, HEAD_CHARS_PER_TOKEN * self.max_model_len)
            if cut is not None and len(ids := self.model.tokenize([cut])[0]) > self.max_model_len:
                if max_length is None:
                    out[i] = ids
                    partial.add(i)
                elif keeps_first:  # (a tokenizer truncating on the left keeps the text's end)
                    out[i] = self.model.tokenize([cut], max_length)[0]
        rest = [i for i, ids in enumerate(out) if ids is None]
        for i, ids in zip(rest, self.model.tokenize([texts[i] for i in rest], max_length) if rest else [], strict=True):
            out[i] = ids
        return [ids or [] for ids in out], partial

    async def embed(self, inputs: list[str] | list[list[int]], truncate: int | None = None) -> EmbedResult:
        """Embed ``inputs`` (strings or token-id lists); batched with every other concurrent call."""
        ids = await run_sized(sum(len(x) for x in inputs), self.prepare, inputs, truncate)
        _QUEUE_S.set(None)
        start = time.perf_counter()
        vectors = await self.embed_ids(ids)
        total = time.perf_counter() - start
        queue = min(total, _QUEUE_S.get() or 0.0)
        return EmbedResult(vectors, [len(x) for x in ids], queue_s=queue, inference_s=total - queue)

    async def embed_ids(self, ids: list[list[int]]) -> np.ndarray:
        """Embeddings [N, dim] for already-checked token-id lists."""
        if self._dead is not None:
            raise EngineDeadError(f"the embedding engine died: {self._dead!r}")
        self.start_sync()
        loop = asyncio.get_running_loop()
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        req = _Request(next(self._seq), out, loop.create_future(), loop, len(ids))
        with self._cond:
            if len(self._pending) + len(ids) > self.max_pending:
                raise QueueFullError(len(self._pending), 1.0)
            for i, x in enumerate(ids):
                bisect.insort(self._pending, _Item(len(x), req.seq, i, x, req))
            self._cond.notify()
        try:
            vectors = await req.future
            _QUEUE_S.set((req.started or req.submitted) - req.submitted)
            return vectors
        finally:
            req.cancelled = True  # a client that left frees its queued inputs

    # -- engine thread ---------------------------------------------------------------------------

    def _next_batch(self) -> list[_Item]:
        """Pop the batch around the shortest input of the oldest request (call with the lock)."""
        pending = self._pending
        if any(it.request.cancelled for it in pending):
            pending[:] = [it for it in pending if not it.request.cancelled]
        if not pending:
            return []
        start = min(range(len(pending)), key=lambda k: (pending[k].seq, pending[k].length))
        lo, hi, total = start, start + 1, pending[start].length

        def fits(n: int, longest: int, tokens: int) -> bool:
            padded = n * longest
            return (
                n <= self.max_batch_size
                and padded <= self.max_batch_tokens
                and tokens >= padded * (1 - self.max_padding)
            )

        while hi < len(pending) and fits(hi - lo + 1, pending[hi].length, total + pending[hi].length):
            total += pending[hi].length
            hi += 1
        longest = pending[hi - 1].length
        while lo > 0 and fits(hi - lo + 1, longest, total + pending[lo - 1].length):
            lo -= 1
            total += pending[lo].length
        batch = pending[lo:hi]
        del pending[lo:hi]
        return batch

    def _loop(self) -> None:
        if self.threads_per_worker:
            torch.set_num_threads(self.threads_per_worker)  # this thread's intra-op pool only
        self._serve_batches()

    def _run(self, batch: list[_Item]) -> None:
        start = time.perf_counter()
        for it in batch:
            if it.request.started is None:
                it.request.started = start
        with self._cond:
            self._stats["num_running"] += len(batch)
        try:
            vectors = self.model.forward([it.ids for it in batch]).numpy()
        except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
            logger.exception("embedding batch failed")
            for req in {id(it.request): it.request for it in batch}.values():
                resolve(req, exc)
            with self._cond:
                self._stats["num_running"] -= len(batch)
            return
        done: list[_Request] = []
        for row, it in enumerate(batch):
            it.request.out[it.index] = vectors[row]
            it.request.remaining -= 1
            if it.request.remaining == 0:
                done.append(it.request)
        for req in done:
            resolve(req, None)
        with self._cond:
            s = self._stats
            s["num_batches"] += 1
            s["num_running"] -= len(batch)
            s["num_inputs"] += len(batch)
            s["num_tokens"] += sum(it.length for it in batch)
            s["num_padded_tokens"] += len(batch) * max(it.length for it in batch)
            s["busy_s"] += time.perf_counter() - start
