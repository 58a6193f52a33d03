"""Iteration-level scheduler: decides which tokens of which sequences run this step.

It never touches tensors: its output is plain data the model runner turns into tensors.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.block_manager import KVCacheManager
from engine.config import EngineConfig
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (== num_computed_tokens before it)
    num_new_tokens: int
    # Sequences that sample a token from this step's last position: [] for a prefill chunk
    # that does not reach the end, [seq] normally, [seq, *siblings] when an n>1 prompt completes.
    sample_seqs: list[Sequence] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    block_copies: list[tuple[int, int]]  # (src, dst) block copies to run before the forward pass
    preempted: list[Sequence]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    token_id: int
    logprob: object = None  # engine.outputs.TokenLogprob | None


class Scheduler:
    """FCFS (or priority) continuous batching with chunked prefill and preemption by recompute.

    Each ``schedule()``: running sequences first (decodes and unfinished prefill chunks), then
    waiting ones, under ``max_num_batched_tokens`` and ``max_num_seqs``. When KV blocks run out,
    the lowest-priority running sequence is preempted: its blocks are freed and it is requeued
    at the front to be recomputed from its tokens (prompt + output so far), losing nothing.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager, eos_token_ids: set[int], max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple[float, float, int]:
        prio = seq.priority if self.config.scheduling_policy == "priority" else 0
        return (prio, seq.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        keys = [self._key(s) for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, self._key(seq)), seq)

    def _requeue_front(self, seq: Sequence) -> None:
        if self.config.scheduling_policy == "priority":
            self.add(seq)
        else:
            seq.status = SequenceStatus.WAITING
            self.waiting.insert(0, seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- schedule ------------------------------------------------------------------------------
    def _sample_seqs(self, seq: Sequence, end: int) -> list[Sequence]:
        if end < seq.num_tokens:
            return []
        return [seq, *seq.siblings]

    def _pick_victim(self) -> Sequence:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=self._key)
        return self.running[-1]

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0  # its block hashes stay valid: they hash token content
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue_front(victim)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = self._pick_victim()
                for j, s in enumerate(scheduled):
                    if s.seq is victim:  # already scheduled this step: take it back
                        budget += s.num_new_tokens
                        del scheduled[j]
                        break
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                start = seq.num_computed_tokens
                scheduled.append(ScheduledSeq(seq, start, num_new, self._sample_seqs(seq, start + num_new)))
                budget -= num_new
                i += 1

        # Admit waiting sequences only when nothing had to be preempted (no thrashing).
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            if len(self.running) + 1 + len(seq.siblings) > self.config.max_num_seqs:
                break
            hits = self.kv.match_prefix(seq)
            remaining = seq.num_tokens - len(hits) * self.kv.block_size
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if not self.kv.admit(seq, hits, num_new):
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            start = seq.num_computed_tokens
            scheduled.append(ScheduledSeq(seq, start, num_new, self._sample_seqs(seq, start + num_new)))
            budget -= num_new

        return SchedulerOutput(
            scheduled=scheduled,
            block_copies=self.kv.take_copies(),
            preempted=preempted,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
        )

    # -- update --------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[int, SampledToken]) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, fork n>1 siblings, finish sequences on
        token-level stop conditions. Returns every sequence that received a token."""
        touched: list[Sequence] = []
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.cache_computed(seq)
            for target in item.sample_seqs[1:]:
                self._fork(seq, target)  # before the parent's own token: children copy the prompt
            for target in item.sample_seqs:
                token = sampled[target.seq_id]
                target.append_token(token.token_id)
                touched.append(target)
                self._check_stop(target, token.token_id)
        return touched

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        self.kv.fork(parent, child)
        child.token_ids = list(parent.token_ids)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        parent.siblings = [s for s in parent.siblings if s is not child]

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        p = seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token_id in self.eos_token_ids:
                return self.finish(seq, FinishReason.STOP)
            if token_id in p.stop_token_ids:
                return self.finish(seq, FinishReason.STOP, token_id)
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            self.finish(seq, FinishReason.LENGTH)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Retire a sequence (also used for stop strings and aborts) and free its blocks."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.kv.free(seq)
        for sibling in seq.siblings:  # unforked siblings die with a parent that never prefilled
            sibling.status, sibling.finish_reason = SequenceStatus.FINISHED, reason
        seq.siblings = []
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
