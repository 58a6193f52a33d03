"""The paged KV block pool with a content-addressed prefix cache.

The pool never touches tensors: it hands out block ids into the KV tensors the runner owns.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

BlockHash = bytes


def hash_block(
    parent: BlockHash | None, token_ids: list[int] | tuple[int, ...], extra_keys: tuple[str, ...]
) -> BlockHash:
    """Chained hash of one full block: the parent block's hash, the block's tokens and any extra
    keys (image/audio content hashes, a cache salt) that also shape the block's KV."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\x00")
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x1f" + key.encode())
    return h.digest()


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # Kept to verify a hit: a hash match alone must never hand out another prompt's KV.
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Fixed set of KV blocks, ref-counted, with an eviction-ordered free queue.

    Contract:
    - a block with ``ref_count > 0`` is owned by at least one sequence and never handed out;
    - a free block keeps its cached content (``block_hash``) until ``allocate`` reuses it, so a
      later request may revive it with ``lookup`` + ``acquire`` (prefix caching);
    - ``allocate`` takes the block at the head of the free queue: blocks that never held cached
      content first, then cached blocks least-recently freed first (LRU eviction).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.enable_caching = enable_caching

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self) -> int:
        """Take a free block (evicting its cached content) and give it one reference."""
        if not self.free_queue:
            raise NoFreeBlocksError
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def acquire(self, block_id: int) -> None:
        """Add a reference (a prefix hit or a fork); revives the block if it was free."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """Drop a reference; at zero the block joins the free queue."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than acquired")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:  # nothing worth keeping: reuse it first
                self.free_queue.move_to_end(block_id, last=False)

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def cache(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Register a full, computed block's content. A duplicate of an already cached block
        stays uncached (both hold the same KV; the first one keeps the key)."""
        if not self.enable_caching or block_hash in self.cached:
            return
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block_id

    def reset_cache(self) -> None:
        """Forget all cached content of free blocks (e.g. after weights change)."""
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash, block.token_ids = None, ()
