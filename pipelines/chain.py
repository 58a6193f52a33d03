"""The uploaded-audio chain: VAD → ASR → LLM (→ TTS), one stage per modality.

Each stage is a small processor pipeline run depth-first over the previous stage's output frames;
its output frames, timing and attempt count are persisted in a ``StageStore`` (Redis, shared by
the gateway and the workers) before the next stage starts. So a failed stage is retried alone
(earlier outputs are read back, never recomputed), and running a chain again skips the stages
already done. ``run_local`` runs the stages in-process (local dispatch); ``celery_chain`` builds a
Celery chain with each stage task on its modality's queue (``pipelines.tasks``) so each stage
scales with its own workers.
"""

from __future__ import annotations

import functools
import pickle
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from modalities.audio import ASR_RATE
from pipelines.conversation import Conversation
from pipelines.frames import AudioFrame, End, Frame, LLMDone, Transcript, TTSAudio, UserAudio
from pipelines.processor import Pipeline, Processor
from pipelines.reply import LLM, LLMOptions
from pipelines.services import Services
from pipelines.speech import ASR, TTS, Sentences, TTSOptions


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
    stages whose first attempt raises (fault injection for tests and drills)."""

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

    def stages(self) -> list[StageSpec]:
        names = ["vad", "asr"] + (["llm"] if self.respond else []) + (["tts"] if self.respond and self.speak else [])
        return [s for s in STAGES if s.name in names]


class StageFailed(RuntimeError):
    """A stage attempt failed (injected or real); the chain retries it."""


# -- processors only the chain needs ---------------------------------------------------------------


class SpeechSegments(Processor):
    """A whole recording → one ``UserAudio`` per speech segment (the shared offline VAD)."""

    def __init__(self, backend: str = "webrtc") -> None:
        self.backend = backend

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if not isinstance(frame, AudioFrame):
            yield frame
            return
        from modalities.vad import speech_segments

        for i, (start, end) in enumerate(speech_segments(frame.samples, self.backend)):
            lo, hi = int(start * ASR_RATE), int(end * ASR_RATE)
            ms = (int(start * 1000), int(end * 1000))
            yield UserAudio(frame.samples[lo:hi], ASR_RATE, *ms, item_id=f"seg_{i:04d}", respond=False)


class JoinTranscripts(Processor):
    """Segment transcripts → one user turn (at ``End``) that asks for a reply."""

    def __init__(self) -> None:
        self.parts: list[Transcript] = []

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, Transcript):
            self.parts.append(frame)
        elif isinstance(frame, End):
            text = " ".join(p.text for p in self.parts if p.text)
            if text:
                yield Transcript(text, self.parts[0].start_ms, self.parts[-1].end_ms, item_id="user", respond=True)
            yield frame
        else:
            yield frame


def stage_pipeline(name: str, services: Services, opts: ChainOptions) -> Pipeline:
    if name == "vad":
        return Pipeline([SpeechSegments()])
    if name == "asr":
        return Pipeline([ASR(services)])
    if name == "llm":
        conv = Conversation(opts.instructions) if opts.instructions else Conversation()
        llm_opts = LLMOptions(max_tokens=opts.max_tokens, temperature=opts.temperature)
        return Pipeline([JoinTranscripts(), LLM(services, conv, llm_opts), Sentences()])
    if name == "tts":
        return Pipeline([TTS(services, TTSOptions(True, opts.voice, opts.sample_rate))])
    raise ValueError(f"unknown stage {name!r}")


# -- persisted stage state -------------------------------------------------------------------------


class StageStore:
    """Chain state in Redis under ``<prefix>:chain:<id>``: the input audio, each stage's output
    frames, and a ``meta`` hash (options, status, per-stage attempts and timings). Keys expire
    after ``ttl_s``."""

    def __init__(self, redis_url: str | None, prefix: str = "mmserve", ttl_s: int = 86_400) -> None:
        """``redis_url`` None: an in-process store (local dispatch without Redis)."""
        if redis_url is None:
            self.r: Any = MemoryKV()
        else:
            import redis

            self.r = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10)
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
        (1-based)."""
        meta = self._key(chain_id, "meta")
        n = int(self.r.hincrby(meta, f"{stage}.attempts", 1))
        mapping = {"status": f"running:{stage}", f"{stage}.started": time.time(), f"{stage}.where": where}
        self.r.hset(meta, mapping={**mapping, **({} if dispatch is None else {f"{stage}.dispatch": dispatch})})
        return n

    def finish(
        self, chain_id: str, stage: str, frames: list[Frame], seconds: float, dispatch: int | None = None
    ) -> bool:
        """Store ``stage``'s output, unless its ``dispatch`` went stale while it ran (a worker
        taken for lost that was not: the attempt sent since is the one kept); whether it did."""
        if not self.live(chain_id, dispatch):
            return False
        meta = self._key(chain_id, "meta")
        with self.r.pipeline() as p:
            p.set(self._key(chain_id, f"out:{stage}"), pickle.dumps(frames), ex=self.ttl)
            p.hset(meta, mapping={f"{stage}.seconds": seconds, f"{stage}.finished": time.time()})
            p.execute()
        return True

    def redispatch(self, chain_id: str) -> int:
        """Make the chain's tasks sent so far stale (``live`` says no to them); returns the number
        the tasks sent next must carry. (One atomic command: no state in between.)"""
        return int(self.r.hincrby(self._key(chain_id, "meta"), "dispatch", 1))

    def live(self, chain_id: str, dispatch: int | None) -> bool:
        """Whether a task of the chain sent as ``dispatch`` (None: any) should run: the chain has
        not ended and was not sent again since."""
        status, current = self.r.hmget(self._key(chain_id, "meta"), ["status", "dispatch"])
        if status in (None, b"succeeded", b"failed", b"cancelled"):
            return False
        return dispatch is None or int(current or 0) == dispatch

    def state(self, chain_id: str) -> str | None:
        raw = self.r.hget(self._key(chain_id, "meta"), "status")
        return raw.decode() if raw is not None else None

    def set_status(self, chain_id: str, status: str, error: str | None = None) -> None:
        mapping: dict[str, Any] = {"status": status}
        if error is not None:
            mapping["error"] = error
        self.r.hset(self._key(chain_id, "meta"), mapping=mapping)

    @staticmethod
    def stages_done(meta: dict[bytes, bytes], opts: ChainOptions) -> int:
        """How many of the chain's stages have finished, from its ``meta`` hash."""
        return sum(f"{s.name}.finished".encode() in meta for s in opts.stages())

    def status(self, chain_id: str) -> dict[str, Any] | None:
        """``{"id", "status", "error", "stages": {name: {attempts, seconds}}}``; None if unknown."""
        meta = {k.decode(): v for k, v in self.r.hgetall(self._key(chain_id, "meta")).items()}
        if not meta:
            return None
        opts: ChainOptions = pickle.loads(meta["options"])  # noqa: S301
        stages = {}
        for s in opts.stages():
            seconds = meta.get(f"{s.name}.seconds")
            where = meta.get(f"{s.name}.where")
            stages[s.name] = {
                "modality": s.modality,
                "attempts": int(meta.get(f"{s.name}.attempts", 0)),
                "seconds": float(seconds) if seconds is not None else None,
                "worker": where.decode() if where else None,
            }
        err = meta.get("error")
        return {
            "id": chain_id,
            "status": meta["status"].decode(),
            "error": err.decode() if err else None,
            "stages": stages,
        }

    def delete(self, chain_id: str) -> None:
        keys = [self._key(chain_id, w) for w in ("meta", "input")]
        keys += [self._key(chain_id, f"out:{s.name}") for s in STAGES]
        self.r.delete(*keys)


@functools.cache
def shared_store(redis_url: str, prefix: str) -> StageStore:
    """The stage store on ``redis_url`` of this process (one Redis connection pool, thread-safe),
    shared by every job and stage task it runs."""
    return StageStore(redis_url, prefix)


class MemoryKV:
    """The few Redis commands ``StageStore`` uses, in memory (no expiry: local chains are few)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def pipeline(self) -> MemoryKV:
        return self

    def __enter__(self) -> MemoryKV:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def execute(self) -> None:
        return None

    def set(self, key: str, value: bytes, ex: int | None = None) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def expire(self, key: str, seconds: int) -> None:
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

    def delete(self, *keys: str) -> None:
        for k in keys:
            self.data.pop(k, None)


# -- running ---------------------------------------------------------------------------------------


async def run_stage(
    store: StageStore,
    chain_id: str,
    stage: str,
    services: Services | Callable[[ChainOptions], Services],
    where: str = "local",
    dispatch: int | None = None,
) -> None:
    """One attempt of ``stage`` (on worker ``where``, sent as ``dispatch``) with ``services`` (or
    those it makes of the chain's options); a stage whose output is stored, of a chain that ended,
    or of a stale dispatch is skipped. The attempt counts from the start, so one that fails on
    its input or on a missing engine is bounded by ``max_attempts`` too."""
    if store.output(chain_id, stage) is not None or not store.live(chain_id, dispatch):
        return
    attempt = store.begin(chain_id, stage, where, dispatch)
    opts = store.options(chain_id)
    if stage in opts.fail_once and attempt == 1:
        raise StageFailed(f"injected failure of stage {stage!r} (attempt 1)")
    frames = store.input_frames(chain_id, stage, opts)
    engines = services if isinstance(services, Services) else services(opts)
    t0 = time.perf_counter()
    out = await stage_pipeline(stage, engines, opts).run_all(frames)
    if error := next((f.error for f in out if isinstance(f, LLMDone) and f.error), None):
        raise StageFailed(error)  # the engine refused or failed the reply: retry, then fail the chain
    store.finish(chain_id, stage, out, time.perf_counter() - t0, dispatch)


async def run_local(
    store: StageStore,
    chain_id: str,
    services: Services,
    check: Callable[[], None] = lambda: None,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> dict[str, Any]:
    """Every stage in-process, each retried up to ``max_attempts``; returns ``result(...)``.
    ``check()`` runs before each attempt (it raises to stop, e.g. ``JobContext.check_cancelled``);
    ``progress(done, total)`` counts the stages done."""
    opts = store.options(chain_id)
    stages = opts.stages()
    for done, spec in enumerate(stages):
        progress(done, len(stages))
        for attempt in range(1, opts.max_attempts + 1):
            check()
            try:
                await run_stage(store, chain_id, spec.name, services)
                break
            except Exception as exc:
                if attempt == opts.max_attempts:
                    store.set_status(chain_id, "failed", f"{spec.name}: {exc}")
                    raise
    progress(len(stages), len(stages))
    store.set_status(chain_id, "succeeded")
    return result(store, chain_id)


def celery_chain(app: Any, chain_id: str, opts: ChainOptions, prefix: str = "mmserve", dispatch: int = 0) -> Any:
    """The Celery chain of stage tasks on ``app``, each routed to ``<prefix>.<modality>`` and
    carrying ``dispatch`` (``StageStore.redispatch``); ``.apply_async()`` returns at once. The
    last task returns ``result(...)`` (without audio)."""
    from celery import chain

    from pipelines.tasks import TASK_NAME
    from workers.celery_app import modality_queue

    stages = opts.stages()
    sigs = [
        app.signature(
            TASK_NAME,
            args=(chain_id, s.name, prefix),
            kwargs={"last": i == len(stages) - 1, "dispatch": dispatch},
            immutable=True,
            queue=modality_queue(s.modality, prefix),
        )
        for i, s in enumerate(stages)
    ]
    return chain(*sigs, app=app)


def result(store: StageStore, chain_id: str) -> dict[str, Any]:
    """The chain's outputs: transcript, reply text, reply audio (float32 array at its rate), and
    the per-stage status (attempts, seconds)."""
    opts = store.options(chain_id)
    names = [s.name for s in opts.stages()]
    asr = store.output(chain_id, "asr") or []
    out: dict[str, Any] = {
        "transcript": " ".join(f.text for f in asr if isinstance(f, Transcript) and f.text),
        "segments": [asdict_light(f) for f in asr if isinstance(f, Transcript)],
        "status": store.status(chain_id),
    }
    if "llm" in names:
        llm = store.output(chain_id, "llm") or []
        done = next((f for f in llm if isinstance(f, LLMDone)), None)
        out["reply"] = done.text if done else ""
        out["usage"] = (
            {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens} if done else {}
        )
    if "tts" in names:
        chunks = [f.samples for f in store.output(chain_id, "tts") or [] if isinstance(f, TTSAudio)]
        out["audio"] = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        out["sample_rate"] = opts.sample_rate
    return out


def asdict_light(t: Transcript) -> dict[str, Any]:
    d = asdict(t)
    return {"text": d["text"], "start_ms": d["start_ms"], "end_ms": d["end_ms"]}
