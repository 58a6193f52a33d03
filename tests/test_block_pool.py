"""Property tests of the KV block pool and manager: no leaks, ref counts return to zero, prefix
hits never hand out another prompt's KV."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import KVCacheManager
from engine.block_pool import BlockPool
from engine.sampling_params import SamplingParams
from engine.sequence import EmbedInput, PromptInputs, Sequence

BS = 4


def _seq(tokens: list[int], **inputs) -> Sequence:
    return Sequence("r", 0, PromptInputs(tokens, **inputs), SamplingParams())


def _compute(kv: KVCacheManager, seq: Sequence, owner: dict[int, tuple[int, ...]]) -> None:
    """Admit and 'compute' the whole sequence, recording which tokens each block holds."""
    hits = kv.match_prefix(seq)
    for i, b in enumerate(hits):  # a hit must hold exactly this sequence's tokens
        assert owner[b] == tuple(seq.token_ids[i * BS : (i + 1) * BS])
    assert kv.admit(seq, hits, seq.num_tokens - len(hits) * BS)
    for i in range(len(hits), len(seq.block_table)):
        owner[seq.block_table[i]] = tuple(seq.token_ids[i * BS : (i + 1) * BS])
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed(seq)


def _assert_all_free(kv: KVCacheManager) -> None:
    pool = kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert len(set(pool.free_queue)) == pool.num_blocks


prompts = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(prompts=prompts, live=st.integers(1, 4), num_blocks=st.integers(8, 24))
def test_pool_no_leaks_and_hits_are_exact(prompts: list[list[int]], live: int, num_blocks: int) -> None:
    kv = KVCacheManager(num_blocks, BS, enable_caching=True)
    owner: dict[int, tuple[int, ...]] = {}
    running: list[Sequence] = []
    for tokens in prompts:
        seq = _seq(tokens)
        if len(tokens) // BS + 1 > num_blocks:
            continue
        while True:
            hits = kv.match_prefix(seq)
            needed = -(-seq.num_tokens // BS) - len(hits)
            revived = sum(1 for b in hits if kv.pool.blocks[b].ref_count == 0)
            if needed <= kv.pool.num_free - revived or not running:
                break
            kv.free(running.pop(0))
        if needed > kv.pool.num_free - revived:
            continue
        _compute(kv, seq, owner)
        running.append(seq)
        if len(running) > live:
            kv.free(running.pop(0))
        # Every live block is referenced exactly by the sequences holding it.
        refs: dict[int, int] = {}
        for s in running:
            for b in s.block_table:
                refs[b] = refs.get(b, 0) + 1
        for b in kv.pool.blocks:
            assert b.ref_count == refs.get(b.block_id, 0)
    for s in running:
        kv.free(s)
    _assert_all_free(kv)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 50), min_size=2, max_size=30), appends=st.integers(1, 9))
def test_fork_copy_on_write(tokens: list[int], appends: int) -> None:
    kv = KVCacheManager(32, BS)
    parent, child = _seq(tokens), _seq(tokens)
    assert kv.admit(parent, [], parent.num_tokens)
    parent.num_computed_tokens = parent.num_tokens
    kv.fork(parent, child)
    shared_tail = parent.block_table[-1]
    for step in range(appends):
        for s, tok in ((parent, 1000 + step), (child, 2000 + step)):
            s.append_token(tok)
            assert kv.allocate_slots(s, 1)
            s.num_computed_tokens += 1
    copies = kv.take_copies()
    if len(tokens) % BS:
        # The shared partial tail block was written by both: exactly one copy was made of it.
        assert [src for src, _ in copies] == [shared_tail]
    else:
        assert copies == []
    assert not set(parent.block_table[len(tokens) // BS :]) & set(child.block_table[len(tokens) // BS :])
    kv.free(parent)
    kv.free(child)
    _assert_all_free(kv)


def test_lru_eviction_order() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    for block, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache(block, key, (block,))
    pool.release(b)
    pool.release(a)
    pool.release(c)
    # Least recently freed cached block goes first; the others stay revivable.
    assert pool.allocate() == b
    assert pool.lookup(b"b", (b,)) is None
    assert pool.lookup(b"a", (a,)) == a and pool.lookup(b"c", (c,)) == c


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(2)
    x, y = pool.allocate(), pool.allocate()
    pool.cache(x, b"x", (0,))
    pool.release(x)
    pool.release(y)  # y holds nothing worth keeping
    assert pool.allocate() == y


def test_extra_keys_separate_same_tokens() -> None:
    """Same placeholder tokens, different image content: no prefix sharing."""
    import torch

    kv = KVCacheManager(16, BS)
    tokens = [7] * 9
    img1 = EmbedInput(2, torch.zeros(3, 8), "image-1")
    img2 = EmbedInput(2, torch.zeros(3, 8), "image-2")
    owner: dict[int, tuple[int, ...]] = {}
    _compute(kv, _seq(tokens, embeds=[img1]), owner)
    assert kv.match_prefix(_seq(tokens, embeds=[img2])) == []
    assert len(kv.match_prefix(_seq(tokens, embeds=[img1]))) == 2
    assert kv.match_prefix(_seq(tokens, embeds=[img1], cache_salt="audio-9")) == []
