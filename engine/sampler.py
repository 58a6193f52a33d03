"""Token sampling: logits processors, then greedy or seeded random choice, plus logprobs.

Every row is processed on its own numbers only, so a seeded request samples the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@dataclass(frozen=True, eq=False)
class VocabSubset:
    """The only token ids some rows may sample (their ``allowed_token_ids``), sorted: logits of
    just these columns are all such a row needs (an AR TTS row: ~500 codec ids of a 49k vocab)."""

    ids: tuple[int, ...]
    index: torch.Tensor  # ``ids`` as a LongTensor


@functools.lru_cache(maxsize=32)
def vocab_subset(ids: tuple[int, ...]) -> VocabSubset:
    """One shared ``VocabSubset`` per id set (built once, not per step)."""
    ordered = tuple(sorted(set(ids)))
    return VocabSubset(ordered, torch.tensor(ordered, dtype=torch.long))


def _apply_penalties(row: torch.Tensor, seq: Sequence, p: SamplingParams) -> None:
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        ids, counts = torch.tensor(seq.output_token_ids, dtype=torch.long, device=row.device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def _process_row(row: torch.Tensor, seq: Sequence, eos_token_ids: set[int]) -> None:
    """In-place logits processing for one sequence: bias, min_tokens, begin suppression, penalties,
    then the grammar (last: what it forbids stays forbidden)."""
    p = seq.params
    if p.allowed_token_ids is not None:
        keep = vocab_subset(tuple(p.allowed_token_ids)).index.to(row.device)
        kept = row[keep]
        row.fill_(float("-inf"))
        row[keep] = kept
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
    if seq.num_output_tokens < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
        if banned:
            row[torch.tensor(sorted(banned), dtype=torch.long, device=row.device)] = float("-inf")
    if p.begin_suppress_token_ids and seq.num_output_tokens == 0:
        row[torch.tensor(p.begin_suppress_token_ids, dtype=torch.long, device=row.device)] = float("-inf")
    _apply_penalties(row, seq, p)
    if seq.guide is not None:
        seq.guide.constrain_(row, seq.output_token_ids)


def _top_p_(probs: torch.Tensor, top_p: float) -> None:
    """Zero, in place, every token outside the smallest most-probable set whose mass reaches
    ``top_p`` (a token is kept when the mass of the tokens ranked above it is <= ``top_p``).
    The kept set is a prefix of the ranking: look at the top 64 first and widen only when they
    do not cover ``top_p`` (sorting all 49k probabilities cost ~3 ms a row on 2 cores)."""
    k = 64
    while True:
        k = min(k, probs.numel())
        vals, ids = probs.topk(k)
        covered = vals.cumsum(0)
        if covered[-1] > top_p or k == probs.numel():
            break
        k *= 8
    keep = int((covered - vals <= top_p).sum())
    probs.zero_()
    probs[ids[:keep]] = vals[:keep]


def _truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Per row: temperature, then top-k / top-p / min-p filtering; returns probabilities [S, V].
    Batched where rows share the work (scaling, softmax), per row where they do not; each row's
    numbers never depend on the other rows."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    scaled = logits / temps[:, None]
    vocab = scaled.shape[-1]
    for row, p in zip(scaled, params, strict=True):
        if 0 < p.top_k < vocab:
            row.masked_fill_(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    for row, p in zip(probs, params, strict=True):
        if p.top_p < 1.0:
            _top_p_(row, p.top_p)
        if p.min_p > 0.0:
            row.masked_fill_(row < p.min_p * row.max(), 0.0)
    return probs / probs.sum(-1, keepdim=True)


class Sampler:
    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def plan(self, seqs: list[Sequence]) -> list[tuple[list[int], VocabSubset | None]]:
        """Rows grouped by the logits they need: every row whose only constraint beyond
        temperature/top-k/top-p/min-p is ``allowed_token_ids`` needs just those columns (grouped
        by id set); the others need the whole vocabulary (``None``). A row's group depends on its
        own request only, so its numbers do not depend on what shares the batch."""
        groups: dict[VocabSubset | None, list[int]] = {}
        for i, seq in enumerate(seqs):
            p = seq.params
            subset = None
            if p.allowed_token_ids is not None and p.logprobs is None and not self._needs_processing(seq, False):
                subset = vocab_subset(tuple(p.allowed_token_ids))
            groups.setdefault(subset, []).append(i)
        return [(rows, subset) for subset, rows in groups.items()]

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], subset: VocabSubset | None = None
    ) -> list[tuple[int, TokenLogprob | None]]:
        """``logits[i]`` belongs to ``seqs[i]``; returns (token id, logprob or None) per row.
        With ``subset`` (rows from ``plan``), column ``j`` of ``logits`` is token ``subset.ids[j]``."""
        logits = logits.float()
        if subset is not None:
            picked = self._pick(logits, seqs)
            return [(subset.ids[j], None) for j in picked]
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        needs_processing = [self._needs_processing(s) for s in seqs]
        if any(needs_processing):
            logits = logits.clone()
            for i, seq in enumerate(seqs):
                if needs_processing[i]:
                    _process_row(logits[i], seq, self.eos_token_ids)
        tokens = self._pick(logits, seqs)

        results: list[tuple[int, TokenLogprob | None]] = []
        for i, seq in enumerate(seqs):
            lp = None
            if raw_logprobs is not None and want_logprobs[i]:
                row = raw_logprobs[i]
                top: list[tuple[int, float]] = []
                if seq.params.logprobs:
                    vals, ids = row.topk(seq.params.logprobs)
                    top = list(zip(ids.tolist(), vals.tolist(), strict=True))
                lp = TokenLogprob(tokens[i], float(row[tokens[i]]), top)
            results.append((tokens[i], lp))
        return results

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """The column each row picks: argmax for greedy rows, a draw for the others."""
        greedy = [s.params.greedy for s in seqs]
        tokens = logits.argmax(dim=-1).tolist() if any(greedy) else [0] * len(seqs)
        rows = [i for i, g in enumerate(greedy) if not g]
        if rows:
            picked = self._sample(logits[rows] if len(rows) < len(seqs) else logits, [seqs[i] for i in rows])
            for i, tok in zip(rows, picked, strict=True):
                tokens[i] = tok
        return tokens

    def _needs_processing(self, seq: Sequence, allowed: bool = True) -> bool:
        """Whether the row's logits need ``_process_row`` (``allowed``: counting ``allowed_token_ids``)."""
        p = seq.params
        return bool(
            (allowed and p.allowed_token_ids is not None)
            or p.logit_bias
            or p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
            or seq.num_output_tokens < p.min_tokens
            or (p.begin_suppress_token_ids and seq.num_output_tokens == 0)
            or seq.guide is not None
        )

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row, drawn from its filtered distribution by inverting its CDF at a
        uniform number from the sequence's own generator (seeded requests) or the global one:
        one draw per row, so a seeded row is reproducible whatever shares the batch."""
        probs = _truncated_probs(logits, [s.params for s in seqs])
        u = torch.empty(len(seqs), dtype=probs.dtype)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None and seq.generator is None:
                # On the CPU whatever the device: the uniform is drawn there, so a seed gives the
                # same draws on every device.
                seed = seq.params.seed + seq.index  # (past 2**64 by the index: wrapped, as torch takes no more)
                seq.generator = torch.Generator().manual_seed(seed % (1 << 64) if seed > 0 else seed)
            u[i] = torch.rand((), generator=seq.generator, dtype=torch.float64).item()
        cdf = probs.cumsum(-1)
        # 1 - u lies in (0, 1]: the first index whose CDF reaches it has a nonzero probability.
        target = (1.0 - u).to(probs.device) * cdf[:, -1]
        picked = torch.searchsorted(cdf, target[:, None]).squeeze(1)
        return picked.clamp_(max=probs.shape[-1] - 1).tolist()
