"""Which worker gets a request: prefix affinity with a load fallback (pure logic, no I/O).

LLM workers keep a prefix cache of KV blocks. Requests sharing their leading blocks (same system
prompt, same conversation) should land on the same worker, so the prefix key is a hash of the
prompt's first ``num_blocks`` full blocks of ``block_size`` token ids, and the worker is chosen by
rendezvous (highest-random-weight) hashing of that key over the live workers: a consistent hash,
so a worker joining or leaving only moves the keys it gains or loses. When that worker is
overloaded (every slot busy, or far busier than the least-loaded one), or when the prompt has no
full block to share, the least-loaded live worker gets the request instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerLoad:
    """A live worker as its heartbeat describes it (plus the gateway's own in-flight count)."""

    worker_id: str
    models: list[str] = field(default_factory=list)
    capacity: int = 1  # concurrent calls it runs (``--concurrency``)
    inflight: int = 0  # calls running on it
    queue_depth: int = 0  # calls waiting in its queues
    kv_usage: float = 0.0  # KV-cache fraction in use (LLM workers)
    local_inflight: int = 0  # calls this gateway has sent it and not seen finish
    draining: bool = False  # shutting down: finishes its calls, gets no new ones
    stats: dict[str, dict[str, float]] = field(default_factory=dict)  # per served model

    @property
    def load(self) -> int:
        """Calls on the worker; the gateway's own count covers the time between heartbeats."""
        return max(self.inflight + self.queue_depth, self.local_inflight)

    @property
    def overloaded(self) -> bool:
        return self.load >= self.capacity or self.kv_usage >= 0.95

    @classmethod
    def from_heartbeat(cls, data: dict[str, Any]) -> WorkerLoad:
        return cls(
            worker_id=str(data["worker_id"]),
            models=list(data.get("models", [])),
            capacity=max(1, int(data.get("capacity", 1))),
            inflight=int(data.get("inflight", 0)),
            queue_depth=int(data.get("queue_depth", 0)),
            kv_usage=float(data.get("kv_usage", 0.0)),
            draining=bool(data.get("draining", False)),
            stats=dict(data.get("stats", {})),
        )


def prefix_key(token_ids: Sequence[int], block_size: int = 16, num_blocks: int = 2) -> str | None:
    """Hash of the leading full blocks (at most ``num_blocks``); ``None`` without a full block."""
    full = min(len(token_ids) // block_size, num_blocks)
    if full == 0:
        return None
    head = token_ids[: full * block_size]
    return hashlib.blake2b(",".join(map(str, head)).encode(), digest_size=8).hexdigest()


def _weight(key: str, worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{worker_id}".encode(), digest_size=8).digest(), "big")


def affinity_worker(key: str, worker_ids: Iterable[str]) -> str | None:
    """Rendezvous hashing: the worker with the highest weight for ``key``."""
    return max(worker_ids, key=lambda w: _weight(key, w), default=None)


def least_loaded(workers: Sequence[WorkerLoad]) -> WorkerLoad | None:
    """Lowest load relative to capacity; ties go to the lower KV usage, then the id."""
    return min(workers, key=lambda w: (w.load / w.capacity, w.kv_usage, w.worker_id), default=None)


def choose_worker(
    workers: Sequence[WorkerLoad],
    key: str | None,
    *,
    exclude: Iterable[str] = (),
    slack: int = 4,
) -> WorkerLoad | None:
    """The worker for a request with prefix ``key`` (``None``: no affinity) among ``workers``
    (live ones serving the model), skipping ``exclude`` (workers already tried). The affinity
    worker is kept unless it is overloaded or more than ``slack`` calls busier than the least
    loaded one. ``None`` when no worker is left."""
    skip = set(exclude)
    live = [w for w in workers if w.worker_id not in skip]
    best = least_loaded(live)
    if key is None or best is None:
        return best
    by_id = {w.worker_id: w for w in live}
    preferred = by_id[affinity_worker(key, by_id)]  # type: ignore[index]
    if preferred.overloaded and not best.overloaded:
        return best
    if preferred.load - best.load > slack:
        return best
    return preferred
