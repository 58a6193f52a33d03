"""Per-sequence KV bookkeeping on top of the block pool: prefix hits, slots, forks, copy-on-write."""

from __future__ import annotations

from engine.block_pool import BlockHash, BlockPool, hash_block
from engine.sequence import Sequence


class KVCacheManager:
    """Maps sequences to KV blocks.

    Invariants: a sequence's ``block_table`` covers at least its ``num_computed_tokens``; full
    blocks are immutable once computed (only they are cached, and only they may be shared by a
    prefix hit); a partially filled block may be shared only by forked siblings and is copied on
    the first write (the copy is recorded in ``pending_copies`` for the runner to execute).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pending_copies: list[tuple[int, int]] = []
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which served from it

    # -- hashing -------------------------------------------------------------------------------
    def _extra_keys(self, seq: Sequence, block_idx: int) -> tuple[str, ...]:
        start, end = block_idx * self.block_size, (block_idx + 1) * self.block_size
        keys = [e.content_hash for e in seq.inputs.embeds if e.offset < end and e.end > start]
        if seq.inputs.cache_salt:
            keys.append(seq.inputs.cache_salt)
        return tuple(keys)

    def _block_tokens(self, seq: Sequence, block_idx: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[block_idx * self.block_size : (block_idx + 1) * self.block_size])

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Hashes of the first ``num_blocks`` full blocks, computed once per sequence."""
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, self._block_tokens(seq, i), self._extra_keys(seq, i)))
        return hashes

    # -- admission -----------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq`` (not yet referenced). At least one token is
        always left to compute, so the sequence still produces logits."""
        if not self.enable_caching:
            return []
        hits: list[int] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i, block_hash in enumerate(self._hashes(seq, max_blocks)):
            block_id = self.pool.lookup(block_hash, self._block_tokens(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def admit(self, seq: Sequence, hit_blocks: list[int], num_new_tokens: int) -> bool:
        """Give a waiting sequence its prefix hits plus slots for ``num_new_tokens`` after them."""
        num_computed = len(hit_blocks) * self.block_size
        needed = self._num_blocks_for(num_computed + num_new_tokens) - len(hit_blocks)
        revived = sum(1 for b in hit_blocks if self.pool.blocks[b].ref_count == 0)
        if needed > self.pool.num_free - revived:
            return False
        for block_id in hit_blocks:
            self.pool.acquire(block_id)
        seq.block_table = list(hit_blocks)
        seq.num_computed_tokens = seq.num_cached_tokens = num_computed
        seq.num_cached_blocks = len(hit_blocks)
        self.query_tokens += seq.num_tokens
        self.hit_tokens += num_computed
        ok = self.allocate_slots(seq, num_new_tokens)
        assert ok, "admission checked the free count"
        return True

    # -- growth --------------------------------------------------------------------------------
    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` after the computed ones; False (and no change) if
        the pool is short. Copies a shared partial block before it is written."""
        table = seq.block_table
        write_idx = seq.num_computed_tokens // self.block_size
        cow = num_new_tokens > 0 and write_idx < len(table) and self.pool.blocks[table[write_idx]].ref_count > 1
        needed = self._num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(table) + int(cow)
        if needed > self.pool.num_free:
            return False
        if cow:
            new_block = self.pool.allocate()
            self.pending_copies.append((table[write_idx], new_block))
            self.pool.release(table[write_idx])
            table[write_idx] = new_block
            needed -= 1
        table.extend(self.pool.allocate() for _ in range(needed))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every block of ``parent`` with ``child`` (n > 1 samples of one prompt)."""
        for block_id in parent.block_table:
            self.pool.acquire(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks

    def cache_computed(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            self.pool.cache(seq.block_table[i], hashes[i], self._block_tokens(seq, i))
        seq.num_cached_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first so a shared prefix outlives its tails."""
        for block_id in reversed(seq.block_table):
            self.pool.release(block_id)
        freed = {b for b in seq.block_table if self.pool.blocks[b].ref_count == 0}
        if freed and self.pending_copies:
            self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in freed]
        seq.block_table = []
        seq.num_cached_blocks = 0

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
