"""Process groups and instrumented collectives for context parallelism.

Every collective the CP hooks issue goes through :class:`CPGroups`, which counts the payload bytes
*this rank sends* per operation kind (``a2a``, ``ring``, ``gather``, ``reduce``), so bytes per denoising step can
be reported and checked against the analytic model in :mod:`.model`. Conventions (what a rank puts on
the wire, excluding the share it keeps for itself):

- all-to-all of a local tensor of ``b`` bytes over ``n`` ranks: ``b * (n - 1) / n``;
- all-gather of a local chunk of ``b`` bytes over ``n`` ranks: ``b * (n - 1)`` (each chunk reaches
  ``n - 1`` peers, whatever algorithm the backend uses);
- one ring hop: the bytes of the tensors passed to the next rank;
- all-reduce of ``b`` bytes (the step cache's decision, a few floats): ``2 * b * (n - 1) / n`` (ring
  all-reduce: a reduce-scatter then an all-gather).

Rank layout for ``ulysses_degree = u`` and ``ring_degree = r`` (``world = u * r``): ``rank = ring_idx * u +
ulysses_idx``. Ulysses groups are ``u`` consecutive ranks (all-to-all is the bandwidth-hungry one, so it
gets the closest ranks); ring groups stride by ``u``. Rank ``k`` holds sequence chunk ``k``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ContextParallelConfig:
    """How a transformer's token sequence is split: ``ulysses_degree * ring_degree`` ranks in all.

    Ulysses (all-to-all) needs the head count divisible by ``ulysses_degree``; ring attention passes
    K/V around ``ring_degree`` ranks and merges partial attention with an online softmax. Both need
    the sharded sequence lengths divisible by the world size.
    """

    ulysses_degree: int = 1
    ring_degree: int = 1

    def __post_init__(self) -> None:
        if self.ulysses_degree < 1 or self.ring_degree < 1:
            raise ValueError("ulysses_degree and ring_degree must be >= 1")

    @property
    def world_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @classmethod
    def for_degree(cls, degree: int, mode: str = "ulysses") -> ContextParallelConfig:
        """``mode``: ``ulysses`` (all ranks in one all-to-all group), ``ring`` or ``hybrid`` (Ulysses
        over 2 ranks, ring over the rest; needs an even degree)."""
        if mode == "ulysses":
            return cls(ulysses_degree=degree)
        if mode == "ring":
            return cls(ring_degree=degree)
        if mode == "hybrid":
            if degree % 2:
                raise ValueError("hybrid context parallelism needs an even degree")
            return cls(ulysses_degree=2, ring_degree=degree // 2)
        raise ValueError(f"unknown context-parallel mode {mode!r} (ulysses, ring, hybrid)")


@dataclass
class CommCounter:
    """Bytes sent and calls by this rank, per operation kind."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def add(self, op: str, nbytes: int) -> None:
        self.bytes[op] += int(nbytes)
        self.calls[op] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> dict[str, int]:
        return {**{f"{k}_bytes": v for k, v in self.bytes.items()}, **{f"{k}_calls": v for k, v in self.calls.items()}}


class CPGroups:
    """The world, Ulysses and ring groups of this rank (``torch.distributed`` must be initialised,
    with exactly ``config.world_size`` ranks)."""

    def __init__(self, config: ContextParallelConfig) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised")
        world = dist.get_world_size()
        if world != config.world_size:
            raise ValueError(f"config needs {config.world_size} ranks, the process group has {world}")
        self.config = config
        self.rank = dist.get_rank()
        self.world_size = world
        self.counter = CommCounter()
        u, r = config.ulysses_degree, config.ring_degree
        self.ulysses_index, self.ring_index = self.rank % u, self.rank // u
        # new_group must be called by every rank for every group, in the same order.
        self.ulysses_group = self.ulysses_ranks = None
        for ri in range(r):
            ranks = [ri * u + j for j in range(u)]
            group = dist.new_group(ranks) if u > 1 else None
            if ri == self.ring_index:
                self.ulysses_group, self.ulysses_ranks = group, ranks
        self.ring_ranks: list[int] = [ri * u + self.ulysses_index for ri in range(r)]

    # -- collectives ---------------------------------------------------------------------------

    def all_to_all(self, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Ulysses all-to-all: split ``x`` into ``u`` chunks along ``scatter_dim``, send chunk ``j``
        to Ulysses peer ``j``, and concatenate what arrives along ``gather_dim`` (peer order)."""
        n = self.config.ulysses_degree
        if x.size(scatter_dim) % n:
            raise ValueError(f"dimension {scatter_dim} of size {x.size(scatter_dim)} is not divisible by {n}")
        inputs = [c.contiguous() for c in x.chunk(n, dim=scatter_dim)]
        outputs = [torch.empty_like(inputs[0]) for _ in range(n)]
        dist.all_to_all(outputs, inputs, group=self.ulysses_group)
        self.counter.add("a2a", x.numel() * x.element_size() * (n - 1) // n)
        return torch.cat(outputs, dim=gather_dim)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order (the inverse of :meth:`split`)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        self.counter.add("gather", x.numel() * x.element_size() * (self.world_size - 1))
        return torch.cat(parts, dim=dim)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (a new tensor; ``x`` is left alone)."""
        out = x.detach().clone().contiguous()
        dist.all_reduce(out)
        self.counter.add("reduce", 2 * out.numel() * out.element_size() * (self.world_size - 1) // self.world_size)
        return out

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous chunk of ``x`` along ``dim`` (local, no communication)."""
        if x.size(dim) % self.world_size:
            raise ValueError(
                f"context parallelism needs a sequence divisible by {self.world_size} ranks: "
                f"dimension {dim} has {x.size(dim)} (shape {tuple(x.shape)})"
            )
        return x.chunk(self.world_size, dim=dim)[self.rank]

    def ring_shift_start(self, x: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Start sending ``x`` to the next ring rank and receiving the previous one's; returns the
        receive buffer and the requests to wait on (the caller overlaps compute meanwhile)."""
        r, i = self.config.ring_degree, self.ring_index
        x = x.contiguous()
        buf = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, self.ring_ranks[(i + 1) % r]),
            dist.P2POp(dist.irecv, buf, self.ring_ranks[(i - 1) % r]),
        ]
        self.counter.add("ring", x.numel() * x.element_size())
        return buf, dist.batch_isend_irecv(ops)
