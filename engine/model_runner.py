"""Turns a scheduler decision into flat tensors, runs the model, samples. Owns the KV cache."""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, AttentionMetadata, select_backend
from engine.config import EngineConfig
from engine.model_adapter import ModelAdapter
from engine.sampler import Sampler
from engine.scheduler import SampledToken, ScheduledSeq, SchedulerOutput


def num_kv_blocks(config: EngineConfig, model: ModelAdapter, dtype: torch.dtype) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = AttentionBackend.bytes_per_block(
        model.num_layers, config.block_size, model.num_kv_heads, model.head_dim, dtype
    )
    return max(1, config.kv_cache_memory_bytes // per_block)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: ModelAdapter, sampler: Sampler, dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.sampler = sampler
        self.device = torch.device(config.device)
        self.num_blocks = num_kv_blocks(config, model, dtype)
        backend_cls = select_backend(config.attention_backend, self.device, dtype, model.head_dim)
        self.backend: AttentionBackend = backend_cls(
            model.num_layers, self.num_blocks, config.block_size, model.num_kv_heads, model.head_dim, dtype, self.device
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[int, SampledToken]:
        """Run one step; return the sampled token of every sequence that samples, by seq id."""
        self.backend.copy_blocks(out.block_copies)
        bs = self.config.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        sample_seqs = []
        # Decodes first: the attention backend then addresses them as one contiguous slice.
        items = sorted(out.scheduled, key=lambda item: item.num_new_tokens > 1)
        for item in items:
            seq, start, end = item.seq, item.start, item.start + item.num_new_tokens
            token_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(len(token_ids))
            for target in item.sample_seqs:  # n>1 siblings sample from the same row
                sample_rows.append(len(token_ids) - 1)
                sample_seqs.append(target)

        dev = self.device
        ids_t = torch.tensor(token_ids, dtype=torch.long, device=dev)
        embeds = self.model.embed(ids_t)
        self._insert_embeds(embeds, items)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start=query_start,
            seq_lens=[s.start + s.num_new_tokens for s in items],
            block_tables=[s.seq.block_table for s in items],
            block_size=bs,
            encoder_outputs=[s.seq.inputs.encoder_output for s in items],
        )
        self.backend.prepare(meta)
        hidden = self.model(embeds, torch.tensor(positions, dtype=torch.long, device=dev), meta, self.backend)
        if not sample_rows:
            return {}
        hidden = hidden[torch.tensor(sample_rows, device=dev)]
        sampled: dict[int, SampledToken] = {}
        for rows, subset in self.sampler.plan(sample_seqs):
            h = hidden if len(rows) == len(sample_seqs) else hidden[torch.tensor(rows, device=dev)]
            logits = self.model.compute_logits(h) if subset is None else self.model.compute_logits_for(h, subset)
            seqs = [sample_seqs[i] for i in rows]
            for seq, (tok, lp) in zip(seqs, self.sampler(logits, seqs, subset), strict=True):
                sampled[seq.seq_id] = SampledToken(tok, lp)
        return sampled

    def _insert_embeds(self, embeds: torch.Tensor, items: list[ScheduledSeq]) -> None:
        """Overwrite token embeddings with precomputed ones (image/audio features) where the
        scheduled positions overlap a sequence's ``EmbedInput`` spans."""
        row = 0
        for item in items:
            start, end = item.start, item.start + item.num_new_tokens
            for e in item.seq.inputs.embeds:
                lo, hi = max(start, e.offset), min(end, e.end)
                if lo < hi:
                    src = e.embeds[lo - e.offset : hi - e.offset]
                    embeds[row + lo - start : row + hi - start] = src.to(embeds.dtype)
            row += item.num_new_tokens
