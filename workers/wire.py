"""What the gateway and the workers exchange through Redis besides Celery messages.

Keys (``prefix`` as in ``workers.celery_app``):

- ``<prefix>:w:<worker_id>``: the worker's heartbeat (JSON, TTL a few heartbeat periods): the
  models it serves, capacity, calls in flight, queue depth, KV usage, engine stats;
- ``<prefix>:s:<call_id>``: a Redis Stream carrying one engine call's reply, written (XADD) by the
  worker and read (XREAD) by the gateway: ``start`` (the worker took it), then ``item`` per
  streamed chunk, then ``end`` (the return value, if any) or ``error`` (the exception);
- ``<prefix>:abort:<call_id>``: set by the gateway when the caller went away; the worker checks it
  before starting a call, and ``<prefix>:ctl:<worker_id>`` (pub/sub) carries the call id so a
  running call is cancelled at once (its engine request aborted).

Values are pickled (trusted cluster). Exceptions travel as (class, message, attributes) so
engine errors whose ``__init__`` takes other arguments (``QueueFullError``) still rebuild.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import RequestOutput

START, ITEM, END, ERROR = b"start", b"item", b"end", b"error"
STREAM_TTL_S = 600


def redis_where(url: str) -> str:
    """Where ``url``'s Redis is, for log lines and errors: ``host:port/db`` (or the socket's
    path), never its user or password."""
    from redis.connection import parse_url

    kw = parse_url(url)
    place = kw.get("path") or f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"
    return f"{place}/{kw.get('db', 0)}"


def restart_retry(aio: bool = False) -> dict[str, Any]:
    """Redis client options for one immediate retry, on a fresh connection, of a command that
    failed on its connection: pooled connections are stale after a Redis restart, and a Redis
    that is down still fails at once (no backoff). ``aio``: for a ``redis.asyncio`` client, whose
    ``Retry`` is its own (given the sync one, it retries nothing: it does not await the command).
    A connection lost after Redis ran a command but before its reply runs it twice (a rate-limit
    take, a job's idempotency key): rarer than a restart, and the retry is what a restart needs."""
    import redis.asyncio.retry
    import redis.exceptions
    import redis.retry
    from redis.backoff import NoBackoff

    retry = (redis.asyncio.retry.Retry if aio else redis.retry.Retry)(NoBackoff(), 1)
    return {"retry": retry, "retry_on_error": [redis.exceptions.ConnectionError]}


@dataclass(frozen=True)
class Keys:
    prefix: str = "mmserve"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:w:{worker_id}"

    @property
    def worker_pattern(self) -> str:
        return f"{self.prefix}:w:*"

    def stream(self, call_id: str) -> str:
        return f"{self.prefix}:s:{call_id}"

    def abort(self, call_id: str) -> str:
        return f"{self.prefix}:abort:{call_id}"

    def control(self, worker_id: str) -> str:
        return f"{self.prefix}:ctl:{worker_id}"


@dataclass
class Call:
    """One engine method call sent to a worker (the Celery task's single argument)."""

    call_id: str
    engine: str  # served model name on the worker
    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


class RemoteError(RuntimeError):
    """An exception raised on a worker whose class cannot be rebuilt here."""


def dump(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def load(data: bytes) -> Any:
    return pickle.loads(data)  # noqa: S301 - trusted cluster (see module docstring)


def slim(item: Any, first: bool) -> Any:
    """What a worker streams for ``item``: an unfinished LLM ``RequestOutput`` goes without its
    cumulative fields (text, token ids, logprobs; the prompt ids after the first item), which
    would make a stream quadratic in its length; ``RemoteLLMEngine`` rebuilds them from the
    deltas. Anything else, and the final output, goes whole."""
    if not isinstance(item, RequestOutput) or item.finished:
        return item
    outputs = [
        dataclasses.replace(co, text="", token_ids=[], logprobs=None if co.logprobs is None else [])
        for co in item.outputs
    ]
    return dataclasses.replace(item, outputs=outputs, prompt_token_ids=item.prompt_token_ids if first else [])


def dump_error(exc: BaseException) -> bytes:
    attrs = {k: v for k, v in vars(exc).items() if _picklable(v)}
    try:
        return dump((type(exc), str(exc), attrs))
    except Exception:  # noqa: BLE001 - a class pickle cannot reference
        return dump((RemoteError, f"{type(exc).__name__}: {exc}", {}))


def load_error(data: bytes) -> BaseException:
    """The exception ``dump_error`` packed, rebuilt without calling its ``__init__``."""
    try:
        cls, message, attrs = load(data)
        exc = cls.__new__(cls)
        BaseException.__init__(exc, message)
        exc.__dict__.update(attrs)
        return exc
    except Exception as err:  # noqa: BLE001 - unknown class on this side
        return RemoteError(f"a worker failed and its error could not be decoded: {err!r}")


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001
        return False
    return True
