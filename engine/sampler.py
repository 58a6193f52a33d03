"""Token sampling: logits processors, then greedy or seeded random choice, plus logprobs.

Every row is processed on its own numbers only, so a seeded request samples the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def _apply_penalties(row: torch.Tensor, seq: Sequence, p: SamplingParams) -> None:
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        ids, counts = torch.tensor(seq.output_token_ids, dtype=torch.long, device=row.device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def _process_row(row: torch.Tensor, seq: Sequence, eos_token_ids: set[int]) -> None:
    """In-place logits processing for one sequence: bias, min_tokens, begin suppression, penalties."""
    p = seq.params
    if p.allowed_token_ids is not None:
        keep = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=row.device)
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


def _truncate(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p filtering; returns probabilities."""
    logits = row / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) > p.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


class Sampler:
    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        """``logits[i]`` belongs to ``seqs[i]``; returns (token id, logprob or None) per row."""
        logits = logits.float()
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        needs_processing = [self._needs_processing(s) for s in seqs]
        if any(needs_processing):
            logits = logits.clone()
            for i, seq in enumerate(seqs):
                if needs_processing[i]:
                    _process_row(logits[i], seq, self.eos_token_ids)

        greedy = [s.params.greedy for s in seqs]
        tokens = logits.argmax(dim=-1).tolist() if any(greedy) else [0] * len(seqs)
        for i, seq in enumerate(seqs):
            if not greedy[i]:
                tokens[i] = self._sample(logits[i], seq)

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

    def _needs_processing(self, seq: Sequence) -> bool:
        p = seq.params
        return bool(
            p.allowed_token_ids is not None
            or p.logit_bias
            or p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
            or seq.num_output_tokens < p.min_tokens
            or (p.begin_suppress_token_ids and seq.num_output_tokens == 0)
        )

    @staticmethod
    def _sample(row: torch.Tensor, seq: Sequence) -> int:
        probs = _truncate(row, seq.params)
        if seq.params.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(device=row.device).manual_seed(seq.params.seed + seq.index)
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) samples from p.
        noise = torch.empty_like(probs).exponential_(generator=seq.generator)
        return int((probs / noise).argmax())
