"""The uploaded-audio chain's data: its stages and options, and the ``StageStore`` that keeps
each stage's output frames, attempts and timings (Redis under celery dispatch, shared by the
gateway and the workers; in memory under local dispatch) so that a failed stage is retried alone
and a chain run again skips the stages already done."""

from __future__ import annotations

import json
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import redis.exceptions

from modalities.audio import ASR_RATE
from pipelines.frames import AudioFrame, Frame


@dataclass(frozen=True)
class StageSpec:
    name: str
    modality: str  # whose queue/workers run it (VAD rides with ASR: same workers, no engine)
    needs: tuple[str, ...]


STAGES = (
    StageSpec("vad", "asr", ()),
    StageSpec("asr", "asr", ("asr",)),
    StageSpec("llm", "llm", ("llm",)),
    StageSpec("tts", "tts", ("tts",)),
)


@dataclass
class ChainOptions:
    """What to run: ``respond`` adds the LLM stage, ``speak`` the TTS stage. ``fail_once`` names
    stages whose first attempt raises (fault injection for tests and drills). A stage is tried
    ``max_attempts`` times; an attempt a busy engine refused (a 429) is not one, it waits, up to
    ``max_wait_s`` for all the chain's stages together (``pipelines.chain.after_failure``)."""

    respond: bool = True
    speak: bool = True
    instructions: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    voice: str | None = None
    sample_rate: int = 24_000
    llm: str | None = None
    asr: str | None = None
    tts: str | None = None
    fail_once: list[str] = field(default_factory=list)
    max_attempts: int = 3
    max_wait_s: float = 600.0

    def stages(self) -> list[StageSpec]:
        names = ["vad", "asr"] + (["llm"] if self.respond else []) + (["tts"] if self.respond and self.speak else [])
        return [s for s in STAGES if s.name in names]


class Progress(Protocol):
    """Where a chain is: ``step`` stages done of ``total``, ``detail`` as ``progress_detail``
    (``JobContext.progress`` is one)."""

    def __call__(self, step: int, total: int, *, detail: dict[str, Any] | None = None) -> None: ...


def no_progress(step: int, total: int, *, detail: dict[str, Any] | None = None) -> None:
    return None


class StageFailed(RuntimeError):
    """A stage attempt failed (injected or real); the chain retries it."""


class StageStore:
    """Chain state in Redis under ``<prefix>:chain:<id>``: the input audio, each stage's output
    frames, and a ``meta`` hash (options, status, per-stage attempts and timings). Keys expire
    after ``ttl_s``."""

    def __init__(self, redis_url: str | None, prefix: str = "mmserve", ttl_s: int = 86_400, client: Any = None) -> None:
        """``redis_url`` None: an in-process store (local dispatch without Redis). ``client``: a
        Redis client to use rather than one of its own (``shared_store``'s)."""
        if client is not None:
            self.r: Any = client
        elif redis_url is None:
            self.r = MemoryKV()
        else:
            self.r = redis_client(redis_url)
        self.prefix, self.ttl = prefix, ttl_s

    def _key(self, chain_id: str, what: str) -> str:
        return f"{self.prefix}:chain:{chain_id}:{what}"

    def meta_key(self, chain_id: str) -> str:
        """The Redis hash whose ``status`` field follows the chain (an async client may poll it)."""
        return self._key(chain_id, "meta")

    def create(self, chain_id: str, audio: np.ndarray, opts: ChainOptions) -> None:
        meta = self._key(chain_id, "meta")
        with self.r.pipeline() as p:
            p.set(self._key(chain_id, "input"), np.asarray(audio, np.float32).tobytes(), ex=self.ttl)
            mapping = {"status": "queued", "options": pickle.dumps(opts), "created": time.time(), "dispatch": 0}
            p.hset(meta, mapping=mapping)
            p.expire(meta, self.ttl)
            p.execute()

    def options(self, chain_id: str) -> ChainOptions:
        raw = self.r.hget(self._key(chain_id, "meta"), "options")
        if raw is None:
            raise KeyError(f"no chain {chain_id!r}")
        return pickle.loads(raw)  # noqa: S301 - written by this cluster only

    def input_frames(self, chain_id: str, stage: str, opts: ChainOptions) -> list[Frame]:
        names = [s.name for s in opts.stages()]
        i = names.index(stage)
        if i == 0:
            raw = self.r.get(self._key(chain_id, "input"))
            if raw is None:
                raise KeyError(f"chain {chain_id!r} has no input audio")
            return [AudioFrame(np.frombuffer(raw, np.float32).copy(), ASR_RATE)]
        out = self.output(chain_id, names[i - 1])
        if out is None:
            raise StageFailed(f"stage {names[i - 1]!r} of chain {chain_id} has no output")
        return out

    def output(self, chain_id: str, stage: str) -> list[Frame] | None:
        raw = self.r.get(self._key(chain_id, f"out:{stage}"))
        return None if raw is None else pickle.loads(raw)  # noqa: S301

    def attempts(self, chain_id: str, stage: str) -> int:
        return int(self.r.hget(self._key(chain_id, "meta"), f"{stage}.attempts") or 0)

    def begin(self, chain_id: str, stage: str, where: str, dispatch: int | None = None) -> int:
        """Count an attempt on worker ``where`` (sent as ``dispatch``); returns its number
        (1-based), or 0 when the chain ended or was sent again (nothing is written)."""
        mapping = {"status": f"running:{stage}", f"{stage}.started": time.time(), f"{stage}.where": where}
        mapping |= {} if dispatch is None else {f"{stage}.dispatch": dispatch}

        def write(p: Any, meta: str) -> None:  # (shown as running and counted at once)
            p.hset(meta, mapping=mapping)
            p.hincrby(meta, f"{stage}.attempts", 1)

        done = self._while_live(chain_id, dispatch, write)
        return 0 if done is None else int(done[1])

    def finish(
        self, chain_id: str, stage: str, frames: list[Frame], seconds: float, dispatch: int | None = None
    ) -> bool:
        """Store ``stage``'s output, unless its ``dispatch`` went stale while it ran (a worker
        taken for lost that was not: the attempt sent since is the one kept); whether it did."""
        data = pickle.dumps(frames)

        def write(p: Any, meta: str) -> None:
            p.set(self._key(chain_id, f"out:{stage}"), data, ex=self.ttl)
            p.hset(meta, mapping={f"{stage}.seconds": seconds, f"{stage}.finished": time.time()})

        return self._while_live(chain_id, dispatch, write) is not None

    def wait(self, chain_id: str, stage: str, seconds: float, dispatch: int | None = None) -> bool:
        """``stage``'s attempt was refused by a busy engine and is tried again in ``seconds``: it
        does not count as an attempt; the chain shows ``waiting:<stage>`` until then
        (``under_way``) and ``<stage>.waited`` adds up its waits. False when the chain ended or
        was sent again (nothing is written: a cancelled chain is not shown waiting)."""

        def write(p: Any, meta: str) -> None:  # (never a wait shown with its attempt counted)
            p.hset(meta, mapping={"status": f"waiting:{stage}", f"{stage}.due": time.time() + seconds})
            p.hincrby(meta, f"{stage}.attempts", -1)
            p.hincrbyfloat(meta, f"{stage}.waited", seconds)

        return self._while_live(chain_id, dispatch, write) is not None

    def _while_live(self, chain_id: str, dispatch: int | None, write: Callable[[Any, str], None]) -> list[Any] | None:
        """Run ``write(pipeline, meta key)`` as one transaction if the chain is ``live`` for
        ``dispatch`` until it commits (a cancel or a new sending in between makes it look again);
        its results, or None when the chain is not live. (A check then a write let a chain
        cancelled in between show as running or waiting again, and its next stage run.)"""
        meta = self._key(chain_id, "meta")
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(meta)
                    if not _live(*p.hmget(meta, ["status", "dispatch"]), dispatch):
                        p.unwatch()
                        return None
                    p.multi()
                    write(p, meta)
                    p.expire(meta, self.ttl, nx=True)
                    return list(p.execute())
                except redis.exceptions.WatchError:
                    continue

    def redispatch(self, chain_id: str) -> int:
        """Make the chain's tasks sent so far stale (``live`` says no to them); returns the number
        the tasks sent next must carry. (One atomic command: no state in between.)"""
        meta = self._key(chain_id, "meta")
        dispatch = int(self.r.hincrby(meta, "dispatch", 1))
        self._expiring(meta)
        return dispatch

    def live(self, chain_id: str, dispatch: int | None) -> bool:
        """Whether a task of the chain sent as ``dispatch`` (None: any) should run: the chain has
        not ended and was not sent again since."""
        return _live(*self.r.hmget(self._key(chain_id, "meta"), ["status", "dispatch"]), dispatch)

    def set_status(
        self, chain_id: str, status: str, error: str | None = None, failure: dict[str, Any] | None = None
    ) -> None:
        """``error``: why it failed, in words; ``failure``: the failed stage's error object
        (``gateway.errors.failure_error``), which a job following the chain reports."""
        mapping: dict[str, Any] = {"status": status}
        if error is not None:
            mapping["error"] = error
        if failure is not None:
            mapping["failure"] = json.dumps(failure)
        meta = self._key(chain_id, "meta")
        self.r.hset(meta, mapping=mapping)
        self._expiring(meta)

    def _expiring(self, meta: str) -> None:
        """A ``meta`` written after the chain was deleted (a stage or follower under way when its
        job was deleted) is made anew: it expires too, not never."""
        self.r.expire(meta, self.ttl, nx=True)

    def failure(self, chain_id: str) -> dict[str, Any] | None:
        raw = self.r.hget(self._key(chain_id, "meta"), "failure")
        return json.loads(raw) if raw else None

    @staticmethod
    def stages_done(meta: dict[bytes, bytes], opts: ChainOptions) -> int:
        """How many of the chain's stages have finished, from its ``meta`` hash."""
        return sum(f"{s.name}.finished".encode() in meta for s in opts.stages())

    @staticmethod
    def next_stage(meta: dict[bytes, bytes], opts: ChainOptions) -> StageSpec | None:
        """The chain's first stage not finished, from its ``meta`` hash (None once all are)."""
        return next((s for s in opts.stages() if f"{s.name}.finished".encode() not in meta), None)

    @staticmethod
    def under_way(meta: dict[bytes, bytes], state: str) -> str | None:
        """The stage of the current dispatch whose status is ``<state>:<stage>`` (``running``,
        ``waiting``: for capacity), from the chain's ``meta`` hash; None if there is none."""
        status = meta.get(b"status", b"").decode()
        if not status.startswith(f"{state}:"):
            return None
        stage = status.removeprefix(f"{state}:")
        sent = meta.get(f"{stage}.dispatch".encode())  # (None: a local chain's)
        if f"{stage}.finished".encode() in meta or (sent is not None and sent != meta.get(b"dispatch")):
            return None
        return stage

    @staticmethod
    def stages_view(meta: dict[bytes, bytes], opts: ChainOptions) -> dict[str, dict[str, Any]]:
        """``{name: {modality, attempts, seconds, worker, waited_s}}`` of the chain's stages, from
        its ``meta`` hash (``seconds``: of the attempt that finished, None until one has;
        ``waited_s``: for a busy engine's capacity)."""
        stages = {}
        for s in opts.stages():
            seconds, where = meta.get(f"{s.name}.seconds".encode()), meta.get(f"{s.name}.where".encode())
            stages[s.name] = {
                "modality": s.modality,
                "attempts": int(meta.get(f"{s.name}.attempts".encode(), 0)),
                "seconds": float(seconds) if seconds is not None else None,
                "worker": where.decode() if where else None,
                "waited_s": round(float(meta.get(f"{s.name}.waited".encode(), 0)), 3),
            }
        return stages

    @classmethod
    def progress_detail(cls, meta: dict[bytes, bytes], opts: ChainOptions) -> dict[str, Any]:
        """A job's progress ``detail``: ``{"stage": the first stage not finished (None once all
        are), "stages": stages_view}``, and ``waiting_for_capacity`` (the modality) while that
        stage waits to be tried again after a busy engine refused it."""
        stage = cls.next_stage(meta, opts)
        detail: dict[str, Any] = {"stage": stage.name if stage else None, "stages": cls.stages_view(meta, opts)}
        if stage is not None and cls.under_way(meta, "waiting") == stage.name:
            detail["waiting_for_capacity"] = stage.modality
        return detail

    def meta(self, chain_id: str) -> dict[bytes, bytes]:
        return self.r.hgetall(self._key(chain_id, "meta"))

    def status(self, chain_id: str) -> dict[str, Any] | None:
        """``{"id", "status", "error", "stages": stages_view}``; None if unknown."""
        meta = self.meta(chain_id)
        if not meta:
            return None
        opts: ChainOptions = pickle.loads(meta[b"options"])  # noqa: S301
        err = meta.get(b"error")
        return {
            "id": chain_id,
            "status": meta[b"status"].decode(),
            "error": err.decode() if err else None,
            "stages": self.stages_view(meta, opts),
        }

    def delete(self, chain_id: str) -> None:
        """Every key of the chain (idempotent)."""
        keys = [self._key(chain_id, w) for w in ("meta", "input")]
        keys += [self._key(chain_id, f"out:{s.name}") for s in STAGES]
        self.r.delete(*keys)


def redis_client(redis_url: str) -> Any:
    """A Redis client (its own connection pool) for a stage store."""
    import redis

    from workers.wire import restart_retry

    return redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10, **restart_retry())


_SHARED: dict[tuple[str, str], StageStore] = {}
_CLIENTS: dict[str, Any] = {}
_SHARED_LOCK = threading.Lock()


def _live(status: bytes | None, current: bytes | None, dispatch: int | None) -> bool:
    """``StageStore.live`` of a chain's ``status`` and ``dispatch`` fields."""
    if status in (None, b"succeeded", b"failed", b"cancelled"):
        return False
    return dispatch is None or int(current or 0) == dispatch


def shared_store(redis_url: str, prefix: str) -> StageStore:
    """The stage store of ``prefix`` on ``redis_url`` in this process, shared by every job and
    stage task it runs; every prefix's on one client of that Redis (one connection pool). A
    redis-py client is thread-safe, and its pool makes new connections in a forked child (it
    checks the pid), so the one made before a fork serves the child too."""
    with _SHARED_LOCK:  # (a check-then-make: two threads must not each make one)
        if (store := _SHARED.get((redis_url, prefix))) is None:
            if (client := _CLIENTS.get(redis_url)) is None:
                client = _CLIENTS[redis_url] = redis_client(redis_url)
            store = _SHARED[(redis_url, prefix)] = StageStore(redis_url, prefix, client=client)
        return store


class MemoryKV:
    """The few Redis commands ``StageStore`` uses, in memory (no expiry: local chains are few)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def pipeline(self) -> MemoryPipeline:
        return MemoryPipeline(self)

    def set(self, key: str, value: bytes, ex: int | None = None) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def expire(self, key: str, seconds: int, nx: bool = False) -> None:
        return None

    def hset(self, key: str, mapping: dict[str, Any]) -> None:
        h = self.data.setdefault(key, {})
        h.update({k: v if isinstance(v, bytes) else str(v).encode() for k, v in mapping.items()})

    def hget(self, key: str, field: str) -> bytes | None:
        return self.data.get(key, {}).get(field)

    def hmget(self, key: str, fields: list[str]) -> list[bytes | None]:
        return [self.hget(key, f) for f in fields]

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        return {k.encode(): v for k, v in self.data.get(key, {}).items()}

    def hincrby(self, key: str, field: str, amount: int) -> int:
        h = self.data.setdefault(key, {})
        h[field] = str(int(h.get(field, b"0")) + amount).encode()
        return int(h[field])

    def hincrbyfloat(self, key: str, field: str, amount: float) -> float:
        h = self.data.setdefault(key, {})
        h[field] = repr(float(h.get(field, b"0")) + amount).encode()
        return float(h[field])

    def delete(self, *keys: str) -> None:
        for k in keys:
            self.data.pop(k, None)


class MemoryPipeline:
    """A redis-py pipeline on ``MemoryKV``: commands run at once, except those after ``multi()``,
    which run at ``execute()`` and give it their results (a transaction's). Nothing else writes
    in between (local chains run on one thread), so ``watch`` has nothing to watch."""

    def __init__(self, kv: MemoryKV) -> None:
        self.kv = kv
        self.queued: list[Callable[[], Any]] | None = None

    def __enter__(self) -> MemoryPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def watch(self, *keys: str) -> None:
        return None

    def unwatch(self) -> None:
        return None

    def multi(self) -> None:
        self.queued = []

    def execute(self) -> list[Any]:
        queued, self.queued = self.queued or [], None
        return [command() for command in queued]

    def __getattr__(self, name: str) -> Any:
        command = getattr(self.kv, name)
        if self.queued is None:
            return command
        queued = self.queued
        return lambda *args, **kw: queued.append(lambda: command(*args, **kw))
